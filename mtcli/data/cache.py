"""The binarised, memory-mapped cache of a prepared corpus (``PreparedCorpus``).

Layout of ``data/prepared/<name>/``::

    manifest.json          counts, vocab, settings, input hashes, and size + sha256 of every file
    spm.model, spm.vocab   the joint SentencePiece model
    <split>.<lang>.bin     all sentences' token ids back to back (uint16 if the vocab fits, else int32)
    <split>.<lang>.idx     int64 offsets, one more than sentences: sentence i is bin[idx[i]:idx[i+1]]
    <split>.<lang>.txt     the text that was encoded (cleaned for the training split), one line each

Ids are SentencePiece ids only (no bos/eos). Arrays are written in a stream by
:class:`ArrayWriter` (memory stays flat in corpus size) and read with ``numpy.memmap``, so
opening a 4.5M-pair cache costs the offsets only. The manifest is written last; together with
the atomic directory swap done by ``prepare`` this means a cache is either complete and
verifiable or rejected by :meth:`PreparedCorpus.open`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from mtcli.data.vocabmap import VocabTokenizer, load_tokenizer, tokenizer_files
from mtcli.errors import DataError
from mtcli.fileio import FileHasher, atomic_write, sha256_file, still_names, unchanged_since

try:
    import fcntl
except ImportError:  # not a POSIX system: caches are not locked
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPM_MODEL = "spm.model"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest id type for a vocabulary: uint16 up to 65,536 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def array_name(split: str, lang: str) -> str:
    """File stem of one split and language, e.g. ``train.de``."""
    return f"{split}.{lang}"


def direction_split(split: str, src: str, tgt: str) -> str:
    """The cache's name for one corpus's own copy of a validation or test split, kept apart
    because its text differs from what other corpora give the split in a shared language
    (:mod:`mtcli.data.corpora`): ``test.en-zh``."""
    return f"{split}.{src}-{tgt}"


def eval_split_name(split: str, src: str, tgt: str, holds: Callable[[str, str], bool]) -> str:
    """The split that pairs ``split``'s sentences in ``src`` and ``tgt``: ``split`` itself when
    ``holds(split, lang)`` for both, else the corpus's own copy in that direction or its
    reverse (:func:`direction_split`), else ``split`` (whose lookup then names what is missing)."""
    if holds(split, src) and holds(split, tgt):
        return split
    for name in (direction_split(split, src, tgt), direction_split(split, tgt, src)):
        if holds(name, src) and holds(name, tgt):
            return name
    return split


class ArrayWriter:
    """Appends encoded sentences of one split/language to ``.bin`` and ``.idx`` as they come,
    each after the ids of ``prefix`` (a corpus's tags), when given."""

    def __init__(self, directory: str | Path, split: str, lang: str, dtype: np.dtype,
                 prefix: Sequence[int] = ()) -> None:
        self.directory = Path(directory)
        self.dtype = np.dtype(dtype)
        self.prefix = np.asarray(prefix, dtype=np.int64)
        stem = array_name(split, lang)
        self.bin_path = self.directory / f"{stem}.bin"
        self.idx_path = self.directory / f"{stem}.idx"
        self._bin = open(self.bin_path, "wb")
        self._idx = open(self.idx_path, "wb")
        self._idx.write(np.zeros(1, dtype=np.int64).tobytes())
        self.sentences = 0
        self.tokens = 0
        self.unknown = 0  # ids of UNK_ID: text the vocabulary has no piece for

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Add sentences given as one flat id array and their lengths (``sum(lengths) == len(ids)``)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.asarray(ids)
        if int(lengths.sum()) != len(ids):
            raise ValueError("lengths do not add up to the number of ids")
        self.unknown += int(np.count_nonzero(ids == UNK_ID))
        if len(self.prefix):
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
            ids = np.insert(ids, np.repeat(starts, len(self.prefix)), np.tile(self.prefix, len(lengths)))
            lengths = lengths + len(self.prefix)
        if ids.dtype != self.dtype:  # ids in the file's own type cannot be out of its range
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(self.dtype).max):
                raise ValueError(f"ids out of range for {self.dtype}")
            ids = ids.astype(self.dtype)
        self._bin.write(memoryview(np.ascontiguousarray(ids)))  # no copy into a bytes object
        self._idx.write(memoryview(self.tokens + np.cumsum(lengths, dtype=np.int64)))
        self.sentences += len(lengths)
        self.tokens += len(ids)

    def close(self) -> dict[str, int]:
        """Flush and close both files; return ``{"sentences": n, "tokens": t}``."""
        for handle in (self._bin, self._idx):
            if not handle.closed:
                handle.flush()
                handle.close()
        return {"sentences": self.sentences, "tokens": self.tokens}

    def __enter__(self) -> ArrayWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Record every file in ``directory`` (size, sha256, and what lets :meth:`PreparedCorpus.open`
    skip re-reading it later: :func:`~mtcli.fileio.file_record`) and write ``manifest.json`` last."""
    directory = Path(directory)
    hasher = FileHasher()
    hasher.many((path, path.name) for path in sorted(directory.iterdir())
                if path.is_file() and path.name != MANIFEST and not path.name.startswith("."))
    manifest = dict(manifest, format=FORMAT_VERSION, files=hasher.records)
    with atomic_write(directory / MANIFEST) as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False, sort_keys=False)
        handle.write("\n")
    return manifest


class TokenArray:
    """The token ids of one language of one split, memory-mapped; ``arr[i]`` is sentence ``i``."""

    def __init__(self, bin_path: str | Path, idx_path: str | Path, dtype: str | np.dtype) -> None:
        """Map ``bin_path``/``idx_path``; :class:`DataError` if they are inconsistent."""
        self.bin_path, self.idx_path = Path(bin_path), Path(idx_path)
        self.dtype = np.dtype(dtype)
        idx_size = self.idx_path.stat().st_size
        if idx_size < 8 or idx_size % 8:
            raise DataError(f"{self.idx_path}: truncated offsets file ({idx_size} bytes)")
        offsets = np.memmap(self.idx_path, dtype=np.int64, mode="r")
        bin_size = self.bin_path.stat().st_size
        total = int(offsets[-1])
        if offsets[0] != 0 or total * self.dtype.itemsize != bin_size:
            raise DataError(
                f"{self.bin_path}: holds {bin_size} bytes but {self.idx_path.name} expects "
                f"{total * self.dtype.itemsize} (incomplete or corrupt cache)"
            )
        self.offsets = offsets
        self.lengths: np.ndarray = np.diff(np.asarray(offsets)).astype(np.int64)
        if len(self.lengths) and int(self.lengths.min()) < 0:
            raise DataError(f"{self.idx_path}: offsets are not increasing (corrupt cache)")
        self._data = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        """Number of sentences."""
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """Ids of sentence ``i`` as a fresh int32 array (no bos/eos)."""
        n = len(self.lengths)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sentence {i} out of range ({n} sentences)")
        return np.array(self._data[self.offsets[i] : self.offsets[i + 1]], dtype=np.int32)

    def id_counts(self, size: int, chunk: int = 1 << 24) -> np.ndarray:
        """How often each id ``0..size-1`` occurs over all sentences (read in ``chunk``-id slices,
        so memory stays flat on a large corpus). :class:`DataError` for an id >= ``size``."""
        counts = np.zeros(size, dtype=np.int64)
        for start in range(0, len(self._data), chunk):
            part = np.asarray(self._data[start : start + chunk])
            if part.size and int(part.max()) >= size:
                raise DataError(f"{self.bin_path}: holds id {int(part.max())}, beyond the vocabulary "
                                f"of {size} (corrupt cache)")
            counts += np.bincount(part, minlength=size)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        """Pickle by path (for DataLoader workers), never the mapped data."""
        return {"bin_path": str(self.bin_path), "idx_path": str(self.idx_path), "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Re-map the files named in the pickled state."""
        self.__init__(state["bin_path"], state["idx_path"], state["dtype"])  # type: ignore[misc]


class ConcatArray:
    """Several :class:`TokenArray` read as one: sentence ``i`` of the first, then of the next."""

    def __init__(self, parts: list[TokenArray]) -> None:
        self.parts = parts
        self.lengths: np.ndarray = np.concatenate([p.lengths for p in parts])
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        """Number of sentences in all parts."""
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        """Ids of sentence ``i`` as a fresh int32 array."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sentence {i} out of range ({len(self)} sentences)")
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[part][i - int(self.starts[part])]

    def id_counts(self, size: int) -> np.ndarray:
        """How often each id occurs over all parts (see :meth:`TokenArray.id_counts`)."""
        return sum((p.id_counts(size) for p in self.parts), np.zeros(size, dtype=np.int64))


class PrefixedArray:
    """A :class:`TokenArray` whose every sentence starts with ``prefix`` (a target-language tag)."""

    def __init__(self, array: TokenArray, prefix: Sequence[int]) -> None:
        self.array = array
        self.prefix = np.asarray(prefix, dtype=np.int32)
        self.lengths: np.ndarray = array.lengths + len(self.prefix)

    def __len__(self) -> int:
        """Number of sentences."""
        return len(self.array)

    def __getitem__(self, i: int) -> np.ndarray:
        """``prefix`` then the ids of sentence ``i``."""
        return np.concatenate([self.prefix, self.array[i]])


#: The type of each mapping or list a manifest holds (one of another type was edited by hand).
_MANIFEST_KINDS = {"spm": dict, "data_config": dict, "inputs": dict, "input_files": dict, "source": dict,
                   "sentences": dict, "tokens": dict, "corpora": list, "split_langs": dict, "tags": dict}


class CacheLock:
    """Shared use of a prepared cache (a trainer reading it) or exclusive use (``prepare``
    rebuilding it), by an ``flock`` on the cache's directory: a cache is never rebuilt under a
    running trainer (whose validation would then read other sentences, or ids past its
    vocabulary). The lock goes with the process, or :meth:`release`, so it is never stale, and
    it writes nothing (a read-only cache is locked as well). A cache not built yet, or one on a
    file system that cannot lock a directory (NFS emulates ``flock`` with locks a directory cannot
    hold), is not locked."""

    def __init__(self, directory: Path, exclusive: bool) -> None:
        """Take the lock; :class:`DataError` when another process holds it the other way."""
        self.fd: int | None = None
        missing = 0
        while fcntl is not None:
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:  # none yet; or, for a reader, a prepare between its two renames
                missing += 1
                if exclusive or missing > 100:
                    return
                time.sleep(0.01)
                continue
            except OSError:  # not a directory: said where it is opened
                return
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if not isinstance(exc, BlockingIOError):  # a file system that cannot lock a directory (NFS)
                    return
                if exclusive:
                    raise DataError(f"{directory}: in use by a running `mtcli train` (or another `mtcli prepare` "
                                    "is rebuilding it): prepare again once it has finished, or into another "
                                    "data.prepared_dir") from None
                raise DataError(f"{directory}: another process is preparing it now (`mtcli prepare`): train "
                                "once it has finished") from None
            if still_names(fd, directory):
                self.fd = fd
                return
            os.close(fd)  # a prepare put a new cache in its place meanwhile: lock that one

    def release(self) -> None:
        """Let the cache go (also when the lock is garbage-collected, or the process ends)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> CacheLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class PreparedCorpus:
    """A complete prepared cache directory, as written by ``mtcli prepare``."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        """Use :meth:`open`, which checks the directory first."""
        self.directory = directory
        self.manifest = manifest
        self.lock: CacheLock | None = None  # a trainer's hold on the cache (mtcli.data.freshness.open_prepared)
        # the tokenizer's model: spm.model, or vocab.json beside source.spm and target.spm
        self.spm_path: Path = directory / manifest.get("spm", {}).get("model", SPM_MODEL)
        self.vocab_size: int = int(manifest["vocab"]["size"])
        self.src_lang: str = manifest["src_lang"]
        self.tgt_lang: str = manifest["tgt_lang"]
        self.splits: list[str] = list(manifest["splits"])
        self.train_split: str = manifest["train_split"]
        self.valid_split: str = manifest["valid_split"]
        self.test_splits: list[str] = list(manifest["test_splits"])
        self._dtype = np.dtype(manifest["token_dtype"])
        # caches of several corpora (data.sources): each corpus, each split's languages, the tags
        self.corpora: list[dict[str, Any]] = list(manifest.get("corpora", []))
        self.split_langs: dict[str, list[str]] = {
            split: list(manifest.get("split_langs", {}).get(split, [self.src_lang, self.tgt_lang]))
            for split in self.splits}
        self.target_tags: dict[str, str] = dict(manifest.get("target_tags", {}))
        self.tags: dict[str, int] = {k: int(v) for k, v in manifest.get("tags", {}).items()}

    @classmethod
    def open(cls, directory: str | Path, verify: bool = True) -> PreparedCorpus:
        """Open a cache; :class:`DataError` if it is missing, incomplete or corrupt.

        Always checks that the manifest parses, has this format version, and that every file it
        lists exists with the recorded size and consistent offsets; with ``verify`` also
        compares each file's sha256 with the manifest (reads every byte once), except for a
        file whose size, modification time and inode show it unchanged since it was hashed
        (:func:`~mtcli.fileio.unchanged_since`; a large cache then opens without a full read).
        """
        directory = Path(directory)
        hint = "run `mtcli prepare CONFIG` (add --force to rebuild)"
        if not directory.is_dir():
            raise DataError(f"{directory}: no prepared cache here; {hint}")
        path = directory / MANIFEST
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"{directory}: no {MANIFEST} (incomplete or not a prepared cache); {hint}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: unreadable manifest ({exc}); {hint}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise DataError(f"{path}: cache format {found!r}, expected {FORMAT_VERSION}; {hint}")
        mangled = [key for key, kind in _MANIFEST_KINDS.items() if key in manifest and not isinstance(manifest[key], kind)]
        if mangled or not all(isinstance(n, int) for n in (manifest.get("sentences") or {}).values()):
            raise DataError(f"{path}: manifest mangles {', '.join(mangled) or 'sentences'}; {hint}")
        try:
            files = manifest["files"]
            corpus = cls(directory, manifest)
            needed = [p.name for p in tokenizer_files(corpus.spm_path)] + [
                f"{array_name(split, lang)}.{ext}"
                for split in corpus.splits
                for lang in corpus.split_langs[split]
                for ext in ("bin", "idx", "txt")
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path}: manifest lacks or mangles {exc}; {hint}") from None
        if not isinstance(files, dict) or not all(
                isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)
                for info in files.values()):
            raise DataError(f"{path}: manifest mangles its list of files (each needs a size and a sha256); {hint}")

        for name in needed:
            if name not in files:
                raise DataError(f"{path}: manifest does not list {name}; {hint}")
        for name, info in files.items():
            file = directory / name
            if not file.is_file():
                raise DataError(f"{file}: missing from the prepared cache; {hint}")
            size = file.stat().st_size
            if size != info["size"]:
                raise DataError(f"{file}: {size} bytes, manifest says {info['size']} (incomplete or corrupt); {hint}")
            if verify and not unchanged_since(file, info) and sha256_file(file) != info["sha256"]:
                raise DataError(f"{file}: checksum differs from the manifest (corrupt); {hint}")
        for split in corpus.splits:
            for lang in corpus.split_langs[split]:
                expected = manifest.get("sentences", {}).get(split)
                array = corpus.array(split, lang)
                if expected is not None and len(array) != expected:
                    raise DataError(
                        f"{array.idx_path}: {len(array)} sentences, manifest says {expected}; {hint}"
                    )
        return corpus

    def array(self, split: str, lang: str) -> TokenArray:
        """The memory-mapped ids of ``split`` in ``lang``."""
        self._check(split, lang)
        stem = array_name(split, lang)
        return TokenArray(self.directory / f"{stem}.bin", self.directory / f"{stem}.idx", self._dtype)

    def text_path(self, split: str, lang: str) -> Path:
        """The text that was encoded for ``split`` in ``lang`` (cleaned for the training split).

        Read it with :func:`mtcli.data.textio.read_lines` (or split on ``\\n`` only).
        """
        self._check(split, lang)
        return self.directory / f"{array_name(split, lang)}.txt"

    def eval_split(self, split: str, src: str, tgt: str) -> str:
        """The split of this cache holding ``split``'s pairs in ``src`` and ``tgt``
        (:func:`eval_split_name`)."""
        return eval_split_name(split, src, tgt, lambda name, lang: lang in self.split_langs.get(name, ()))

    def eval_copies(self, split: str) -> list[str]:
        """``split`` and the corpora's own copies of it (:func:`direction_split`), as stored."""
        return [name for name in self.splits if name == split or (
            len(self.split_langs[name]) == 2 and name == direction_split(split, *self.split_langs[name]))]

    def content_sha256(self) -> dict[str, str]:
        """What the training pairs and the validation pairs are, as one sha256 each over the
        checksums the manifest records for their arrays (nothing is read): a checkpoint keeps
        them, so that a resume on a cache prepared from other data is refused."""
        training = ([(self.train_split, lang) for lang in (self.src_lang, self.tgt_lang)] if not self.corpora else
                    [(c["split"], lang) for c in self.corpora for lang in c["langs"]])
        valid = self.eval_split(self.valid_split, self.src_lang, self.tgt_lang)
        files = self.manifest["files"]

        def digest(arrays: list[tuple[str, str]]) -> str:
            names = [f"{array_name(split, lang)}.{ext}" for split, lang in arrays for ext in ("bin", "idx")]
            return hashlib.sha256("".join(files[name]["sha256"] for name in names).encode()).hexdigest()

        return {"train": digest(training), "valid": digest([(valid, self.src_lang), (valid, self.tgt_lang)])}

    def tokenizer(self) -> Tokenizer | VocabTokenizer:
        """The tokenizer the cache was encoded with."""
        return load_tokenizer(self.spm_path)

    def train_pairs(self) -> tuple[TokenArray | ConcatArray, TokenArray | ConcatArray]:
        """The training pairs (source, target), tags included: the training split's arrays, or
        with several corpora, theirs one after another (see :meth:`corpus_sizes`)."""
        if not self.corpora:
            return self.array(self.train_split, self.src_lang), self.array(self.train_split, self.tgt_lang)
        sides = [[self.array(c["split"], lang) for lang in c["langs"]] for c in self.corpora]
        return ConcatArray([s for s, _ in sides]), ConcatArray([t for _, t in sides])

    def corpus_sizes(self) -> list[int]:
        """How many training pairs each corpus holds, in the order of :meth:`train_pairs`."""
        if not self.corpora:
            return [len(self.array(self.train_split, self.src_lang))]
        return [int(self.manifest["sentences"][c["split"]]) for c in self.corpora]

    def languages(self, split: str) -> list[str]:
        """The languages ``split`` holds."""
        self._check(split, self.src_lang)
        return list(self.split_langs[split])

    def source_prefix(self, tgt_lang: str) -> list[int]:
        """The ids put before a source to ask for ``tgt_lang`` (its target tag; none when the
        model has one target language)."""
        if not self.target_tags:
            return []
        return [self.tags[self.target_tags[tgt_lang]]]

    def target_vocabulary(self) -> np.ndarray:
        """The sorted ids the training split's targets use, plus pad, unk, bos and eos: what
        ``model.output_vocab: target`` restricts the decoder's softmax to (a joint vocabulary
        also holds source-only pieces the decoder never has to produce). A pure function of the
        cache: every rank and every resume computes the same list."""
        used = np.zeros(self.vocab_size, dtype=bool)
        used[[PAD_ID, UNK_ID, BOS_ID, EOS_ID]] = True
        used |= self.train_pairs()[1].id_counts(self.vocab_size) > 0
        return np.flatnonzero(used)

    def counts(self) -> dict[str, Any]:
        """Per-split ``{"read", "kept", "dropped": {reason: n}}`` from the manifest."""
        return dict(self.manifest.get("counts", {}))

    def _check(self, split: str, lang: str) -> None:
        if split not in self.splits:
            raise DataError(f"{self.directory}: no split '{split}' (prepared splits: {', '.join(self.splits)})")
        if lang not in self.split_langs[split]:
            raise DataError(
                f"{self.directory}: split '{split}' has no language '{lang}' (prepared: "
                f"{', '.join(self.split_langs[split])})"
            )
