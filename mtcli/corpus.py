"""Parallel-corpus sources, strict UTF-8 line reading, and training-pair cleaning.

A source is where ``data.source`` points; :func:`open_source` decides its kind from what is
there:

``text``
    a directory of ``<split>.<lang>`` plain-text files, one sentence a line, optionally gzipped
    (``<split>.<lang>.gz``), e.g. ``../shared/data/multi30k``;
``dataset``
    a directory written by ``datasets.DatasetDict.save_to_disk`` (``dataset_dict.json`` and one
    sub-directory per split), read with ``datasets.load_from_disk``;
``parquet``
    a directory of parquet files in the hub layout: ``<split>-*.parquet``,
    ``<split>/*.parquet`` or ``data/<split>-*.parquet`` (optionally under ``<hub_config>/``);
``hub``
    a Hugging Face hub id (plus ``data.hub_config``) loaded with ``datasets.load_dataset``.

Hub-layout rows carry a ``translation`` dict ``{src_lang: ..., tgt_lang: ...}`` (or, failing
that, one column per language). Every source yields ``(source, target)`` string pairs as a
stream, so a 4.5M-pair corpus is never held in memory.

Text is read strictly as UTF-8 (an invalid byte is a :class:`DataError` naming file and line),
``\\r\\n`` is normalised, only the line ending is stripped (inner and trailing spaces stay), and a
stray ``\\r`` inside a line becomes a space (so any reader splits the written text identically).

Only the training split is cleaned (:class:`PairCleaner`); valid/test splits keep every line.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import select
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mtcli.errors import DataError
from mtcli.fileio import sha256_file
from mtcli.logs import get_logger

Pair = tuple[str, str]
_ARROW_BATCH = 10_000


# ----------------------------------------------------------------------------- reading text


def _open_binary(path: Path):
    """Binary handle on ``path``, transparently gunzipped for ``.gz`` files."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _normalise(text: str) -> str:
    """Make a sentence safe for one line: inner CR/LF (from hub rows or stray CRs) become spaces."""
    if "\r" in text or "\n" in text:
        text = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return text


def _decode_line(raw: bytes, name: str, lineno: int) -> str:
    """One line's bytes (its ending included or not) as text, by :func:`iter_binary_lines`' rules."""
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{name}:{lineno}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
        ) from None
    if lineno == 1 and line.startswith("\ufeff"):
        line = line[1:]
    if "\r" in line:
        line = line.replace("\r", " ")
    return line


def iter_binary_lines(handle: BinaryIO, name: str) -> Iterator[str]:
    """Decode a binary stream line by line as strict UTF-8, without the line endings.

    The one line reader of mtcli (``prepare``, ``translate``, ``evaluate``, validation):
    only ``\\n`` ends a line and ``\\r\\n`` counts as ``\\n``; a lone ``\\r`` becomes a space
    inside its line (other Unicode separators stay inside too), so one input line is always one
    sentence. A UTF-8 byte-order mark on the first line is dropped; an empty line stays an empty
    string. An undecodable line raises :class:`DataError` as ``NAME:LINE: invalid UTF-8 ...``.
    """
    for lineno, raw in enumerate(handle, start=1):
        yield _decode_line(raw, name, lineno)


def _has_input(fd: int) -> bool:
    """True when reading ``fd`` would not block (data or end of input waiting), by ``select``."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # no select on this kind of descriptor: reading may block
        return True


class ArrivingLines:
    """The lines of a pipe, terminal or socket, handed over as they arrive.

    Iterating gives every line, like :func:`iter_binary_lines` (same decoding rules and errors).
    :meth:`windows` gives them in lists instead: it waits for one complete line, then adds the
    lines that have already arrived, without waiting for more. A consumer that works a window at
    a time (``mtcli translate``) then answers each line of a slow producer (``tail -f``, a
    program writing one request at a time) as soon as it is written, while a fast producer
    (``cat big.txt |``) still fills whole windows. Reads the file descriptor directly (unbuffered
    ``os.read``), so nothing may have read from ``handle`` before.
    """

    def __init__(self, handle: BinaryIO, name: str, chunk_bytes: int = 1 << 16) -> None:
        self.fd = handle.fileno()
        self.name = name
        self.chunk_bytes = int(chunk_bytes)

    def __iter__(self) -> Iterator[str]:
        for window in self.windows(1):
            yield from window

    def windows(self, max_lines: int) -> Iterator[list[str]]:
        """Lists of 1 to ``max_lines`` lines: the next line (waiting for it) and those already there."""
        max_lines = max(1, int(max_lines))
        pending = bytearray()  # read, not yet handed over
        scan = 0  # pending[:scan] holds no newline
        lineno = 0
        eof = False
        while True:
            window: list[str] = []
            while len(window) < max_lines:
                end = pending.find(b"\n", scan)
                if end >= 0:
                    lineno += 1
                    window.append(_decode_line(bytes(pending[:end + 1]), self.name, lineno))
                    del pending[:end + 1]
                    scan = 0
                    continue
                scan = len(pending)
                if eof:
                    if pending:  # a last line without a newline
                        lineno += 1
                        window.append(_decode_line(bytes(pending), self.name, lineno))
                        pending.clear()
                    break
                if window and not _has_input(self.fd):
                    break  # hand over what has arrived rather than wait for more
                chunk = os.read(self.fd, self.chunk_bytes)
                pending += chunk
                eof = not chunk
            if window:
                yield window
            if eof and not pending:
                return


def read_lines(path: str | Path) -> Iterator[str]:
    """Stream the lines of a UTF-8 text file (``.gz`` allowed); see :func:`iter_binary_lines`."""
    path = Path(path)
    try:
        with _open_binary(path) as handle:
            yield from iter_binary_lines(handle, str(path))
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt gzip data ({exc})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a text file") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied") from None


def count_lines(path: str | Path) -> int:
    """Number of lines of a text file (a last line without ``\\n`` counts), streamed."""
    count = 0
    last = b"\n"
    with _open_binary(Path(path)) as handle:
        while chunk := handle.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


# ----------------------------------------------------------------------------- sources


class Source:
    """A parallel corpus: named splits, each a stream of (source, target) sentence pairs."""

    kind = "?"

    def __init__(self, location: str, src_lang: str, tgt_lang: str) -> None:
        self.location = location
        self.src_lang = src_lang
        self.tgt_lang = tgt_lang

    def describe(self) -> str:
        """Short human description, e.g. ``text directory ../shared/data/multi30k``."""
        return f"{self.kind} source {self.location}"

    def splits(self) -> list[str]:
        """Names of the splits this source holds (sorted)."""
        raise NotImplementedError

    def check(self, splits: Iterable[str]) -> None:
        """Raise :class:`DataError` if a split or a language is missing, listing what exists."""
        raise NotImplementedError

    def pairs(self, split: str) -> Iterator[Pair]:
        """Stream the (source, target) pairs of ``split`` in corpus order."""
        raise NotImplementedError

    def fingerprint(self, splits: Iterable[str]) -> dict[str, Any]:
        """What identifies the input of ``splits`` (file hashes, or hub id + fingerprints)."""
        raise NotImplementedError

    def _missing_split(self, split: str) -> DataError:
        found = ", ".join(self.splits()) or "none"
        return DataError(f"{self.describe()}: no split '{split}' (found splits: {found})")


class TextDirSource(Source):
    """A directory of ``<split>.<lang>`` (or ``<split>.<lang>.gz``) aligned text files."""

    kind = "text"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root
        self._files: dict[tuple[str, str], list[Path]] = {}
        for entry in sorted(root.iterdir()):
            if not entry.is_file() or entry.name.startswith("."):
                continue
            name = entry.name[:-3] if entry.name.endswith(".gz") else entry.name
            if "." not in name:
                continue
            split, lang = name.rsplit(".", 1)
            if split and lang:
                self._files.setdefault((split, lang), []).append(entry)

    def describe(self) -> str:
        return f"text directory {self.root}"

    def splits(self) -> list[str]:
        return sorted({split for split, _ in self._files})

    def languages(self, split: str) -> list[str]:
        """Languages that have a file for ``split``."""
        return sorted(lang for s, lang in self._files if s == split)

    def path(self, split: str, lang: str) -> Path:
        """The file of one side of a split; :class:`DataError` if missing or ambiguous."""
        found = self._files.get((split, lang))
        if not found:
            if split not in self.splits():
                raise self._missing_split(split)
            langs = ", ".join(self.languages(split))
            raise DataError(
                f"{self.describe()}: no file {split}.{lang}[.gz] for language '{lang}' "
                f"(split '{split}' has languages: {langs})"
            )
        if len(found) > 1:
            names = " and ".join(p.name for p in found)
            raise DataError(f"{self.describe()}: both {names} exist; keep one")
        return found[0]

    def check(self, splits: Iterable[str]) -> None:
        for split in splits:
            self.path(split, self.src_lang)
            self.path(split, self.tgt_lang)

    def pairs(self, split: str) -> Iterator[Pair]:
        src_path, tgt_path = self.path(split, self.src_lang), self.path(split, self.tgt_lang)
        src_it, tgt_it = read_lines(src_path), read_lines(tgt_path)
        n = 0
        for src in src_it:
            tgt = next(tgt_it, None)
            if tgt is None:
                rest = 1 + sum(1 for _ in src_it)
                raise _mismatch(src_path, n + rest, tgt_path, n)
            n += 1
            yield src, tgt
        rest = sum(1 for _ in tgt_it)
        if rest:
            raise _mismatch(src_path, n, tgt_path, n + rest)

    def fingerprint(self, splits: Iterable[str]) -> dict[str, Any]:
        files = {}
        for split in splits:
            for lang in (self.src_lang, self.tgt_lang):
                path = self.path(split, lang)
                files[path.name] = sha256_file(path)
        return {"kind": self.kind, "files": files}


def _mismatch(src_path: Path, src_n: int, tgt_path: Path, tgt_n: int) -> DataError:
    return DataError(
        f"line counts differ: {src_path} has {src_n} lines but {tgt_path} has {tgt_n} lines"
    )


class _ArrowSource(Source):
    """Shared reading of hub-layout rows (``translation`` dicts) from Arrow tables."""

    def _schema(self, split: str) -> Any:
        raise NotImplementedError

    def _batches(self, split: str) -> Iterator[Any]:
        raise NotImplementedError

    def _check_schema(self, split: str, schema: Any) -> None:
        names = list(schema.names)
        if "translation" in names:
            field_type = schema.field("translation").type
            langs = [f.name for f in field_type] if hasattr(field_type, "num_fields") else []
            for lang in (self.src_lang, self.tgt_lang):
                if lang not in langs:
                    raise DataError(
                        f"{self.describe()}: split '{split}' has no language '{lang}' in its "
                        f"'translation' column (languages: {', '.join(langs) or 'none'})"
                    )
            return
        missing = [lang for lang in (self.src_lang, self.tgt_lang) if lang not in names]
        if missing:
            raise DataError(
                f"{self.describe()}: split '{split}' has neither a 'translation' column nor a "
                f"column for language '{missing[0]}' (columns: {', '.join(names) or 'none'})"
            )

    def check(self, splits: Iterable[str]) -> None:
        available = self.splits()
        for split in splits:
            if split not in available:
                raise self._missing_split(split)
            self._check_schema(split, self._schema(split))

    def pairs(self, split: str) -> Iterator[Pair]:
        import pyarrow.compute as pc

        for batch in self._batches(split):
            names = list(batch.schema.names)
            if "translation" in names:
                column = batch.column("translation")
                src_col = pc.struct_field(column, self.src_lang)
                tgt_col = pc.struct_field(column, self.tgt_lang)
            else:
                src_col, tgt_col = batch.column(self.src_lang), batch.column(self.tgt_lang)
            for src, tgt in zip(src_col.to_pylist(), tgt_col.to_pylist(), strict=True):
                yield _normalise(src or ""), _normalise(tgt or "")


def _split_of_parquet(name: str) -> str:
    """Split name of a hub-layout parquet file: ``train-00000-of-00002.parquet`` -> ``train``."""
    stem = name[: -len(".parquet")]
    match = re.match(r"^(.*?)-\d", stem)
    return match.group(1) if match else stem


class ParquetDirSource(_ArrowSource):
    """Parquet files in the hub layout, streamed batch by batch with pyarrow."""

    kind = "parquet"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str, hub_config: str | None) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root / hub_config if hub_config and (root / hub_config).is_dir() else root
        self._files: dict[str, list[Path]] = {}
        for base in (self.root, self.root / "data"):
            if not base.is_dir():
                continue
            for path in sorted(base.glob("*.parquet")):
                self._files.setdefault(_split_of_parquet(path.name), []).append(path)
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != "data"):
            files = sorted(sub.glob("*.parquet"))
            if files:
                self._files.setdefault(sub.name, []).extend(files)

    def describe(self) -> str:
        return f"parquet directory {self.root}"

    def splits(self) -> list[str]:
        return sorted(self._files)

    def _schema(self, split: str) -> Any:
        import pyarrow.parquet as pq

        return pq.read_schema(self._files[split][0])

    def _batches(self, split: str) -> Iterator[Any]:
        import pyarrow.parquet as pq

        if split not in self._files:
            raise self._missing_split(split)
        for path in self._files[split]:
            try:
                handle = pq.ParquetFile(path)
                yield from handle.iter_batches(batch_size=_ARROW_BATCH)
            except OSError as exc:
                raise DataError(f"{path}: unreadable parquet file ({exc})") from None

    def fingerprint(self, splits: Iterable[str]) -> dict[str, Any]:
        files = {}
        for split in splits:
            for path in self._files[split]:
                files[str(path.relative_to(self.root))] = sha256_file(path)
        return {"kind": self.kind, "files": files}


def _dataset_batches(dataset: Any) -> Iterator[Any]:
    """Arrow tables of a ``datasets.Dataset``, without converting rows to Python dicts."""
    yield from dataset.with_format("arrow").iter(batch_size=_ARROW_BATCH)


class DatasetDirSource(_ArrowSource):
    """A ``DatasetDict.save_to_disk`` directory (one memory-mapped Arrow dataset per split)."""

    kind = "dataset"

    def __init__(self, root: Path, src_lang: str, tgt_lang: str) -> None:
        super().__init__(str(root), src_lang, tgt_lang)
        self.root = root
        if (root / "state.json").is_file() and not (root / "dataset_dict.json").is_file():
            raise DataError(
                f"{root}: holds a single dataset without splits; save a DatasetDict "
                "(DatasetDict({'train': ds, ...}).save_to_disk) so splits have names"
            )
        self._splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        self._loaded: dict[str, Any] = {}

    def describe(self) -> str:
        return f"dataset directory {self.root}"

    def splits(self) -> list[str]:
        return list(self._splits)

    def _dataset(self, split: str) -> Any:
        if split not in self._loaded:
            import datasets

            try:
                self._loaded[split] = datasets.load_from_disk(str(self.root / split))
            except Exception as exc:  # noqa: BLE001 - any failure of the library is bad input
                raise DataError(f"{self.root / split}: cannot load dataset ({_one_line(exc)})") from None
        return self._loaded[split]

    def _schema(self, split: str) -> Any:
        return self._dataset(split).data.schema

    def _batches(self, split: str) -> Iterator[Any]:
        return _dataset_batches(self._dataset(split))

    def fingerprint(self, splits: Iterable[str]) -> dict[str, Any]:
        files = {}
        for split in splits:
            for path in sorted((self.root / split).rglob("*")):
                if path.is_file():
                    files[str(path.relative_to(self.root))] = sha256_file(path)
        return {"kind": self.kind, "files": files}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


class HubSource(_ArrowSource):
    """A Hugging Face hub dataset (``datasets.load_dataset(id, hub_config)``)."""

    kind = "hub"

    def __init__(self, hub_id: str, hub_config: str | None, src_lang: str, tgt_lang: str) -> None:
        super().__init__(hub_id, src_lang, tgt_lang)
        self.hub_id = hub_id
        self.hub_config = hub_config
        self._dict: Any = None

    def describe(self) -> str:
        config = f" (config {self.hub_config})" if self.hub_config else ""
        return f"hub dataset {self.hub_id}{config}"

    def _load(self) -> Any:
        if self._dict is None:
            try:
                import datasets

                loaded = datasets.load_dataset(self.hub_id, self.hub_config)
            except Exception as exc:  # noqa: BLE001 - network, auth, missing id: all bad input
                why = (
                    "it is not in the local cache and offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
                    if _offline()
                    else "the hub may be unreachable or the id/config wrong"
                )
                raise DataError(
                    f"cannot load Hugging Face dataset '{self.hub_id}'"
                    f"{f' config {self.hub_config!r}' if self.hub_config else ''}: {why} "
                    f"[{_one_line(exc)}]; with no internet, point data.source at a local directory "
                    "(<split>.<lang> text files, a save_to_disk directory, or parquet files)"
                ) from None
            if not hasattr(loaded, "keys"):
                loaded = {"train": loaded}
            self._dict = loaded
        return self._dict

    def splits(self) -> list[str]:
        return sorted(self._load().keys())

    def _schema(self, split: str) -> Any:
        return self._load()[split].data.schema

    def _batches(self, split: str) -> Iterator[Any]:
        return _dataset_batches(self._load()[split])

    def fingerprint(self, splits: Iterable[str]) -> dict[str, Any]:
        loaded = self._load()
        prints = {split: getattr(loaded[split], "_fingerprint", None) for split in splits}
        return {"kind": self.kind, "id": self.hub_id, "config": self.hub_config, "fingerprints": prints}


def detect_kind(root: Path) -> str:
    """``dataset``, ``parquet`` or ``text``: the kind of a local source directory."""
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        return "dataset"
    if any(root.glob("*.parquet")) or any(root.glob("*/*.parquet")) or any(root.glob("*/data/*.parquet")):
        return "parquet"
    return "text"


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", ".", "~")) or source.count("/") > 1


def open_source(source: str, src_lang: str, tgt_lang: str, hub_config: str | None = None) -> Source:
    """The :class:`Source` ``data.source`` names: a local directory (kind detected) or a hub id."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"data.source {source}: is a file, expected a directory or a hub id")
        kind = detect_kind(path)
        if kind == "dataset":
            return DatasetDirSource(path, src_lang, tgt_lang)
        if kind == "parquet":
            return ParquetDirSource(path, src_lang, tgt_lang, hub_config)
        text = TextDirSource(path, src_lang, tgt_lang)
        if not text.splits():
            entries = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
            raise DataError(
                f"data.source {source}: no <split>.<lang> text files, parquet files or saved "
                f"dataset found (it holds: {entries})"
            )
        return text
    if _looks_like_path(source) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        raise DataError(f"data.source {source}: directory not found (relative paths are from {Path.cwd()})")
    get_logger().info("data.source %s is not a local directory: loading it from the Hugging Face hub", source)
    return HubSource(source, hub_config, src_lang, tgt_lang)


# ----------------------------------------------------------------------------- cleaning


@dataclass
class CleanCounts:
    """How many training pairs were read, kept, and dropped for each reason."""

    read: int = 0
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    ratio: int = 0
    duplicate: int = 0

    def dropped(self) -> dict[str, int]:
        """Dropped pairs per reason (``empty``, ``too_long``, ``ratio``, ``duplicate``)."""
        return {"empty": self.empty, "too_long": self.too_long, "ratio": self.ratio, "duplicate": self.duplicate}

    def to_dict(self) -> dict[str, Any]:
        """``{"read", "kept", "dropped": {reason: n}}`` as stored in the manifest."""
        return {"read": self.read, "kept": self.kept, "dropped": self.dropped()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CleanCounts:
        """Inverse of :meth:`to_dict`."""
        return cls(read=raw["read"], kept=raw["kept"], **raw.get("dropped", {}))


class PairCleaner:
    """Filters training pairs; each pair is dropped for the first rule it breaks, in order:

    1. ``empty``: either side is empty or whitespace only;
    2. ``too_long``: either side has more than ``max_length`` words (whitespace-separated);
    3. ``ratio``: ``max(|x|, |y|) / min(|x|, |y|) > max_ratio`` in words;
    4. ``duplicate`` (when ``dedup``): the exact (source, target) pair was already kept. Kept
       pairs are remembered by an 8-byte BLAKE2b hash, so memory is 8 bytes plus set overhead
       per unique pair, not the text.
    """

    def __init__(self, max_length: int, max_ratio: float, dedup: bool = False) -> None:
        self.max_length = max_length
        self.max_ratio = max_ratio
        self.dedup = dedup
        self.counts = CleanCounts()
        self._seen: set[int] = set()

    def reason(self, src: str, tgt: str) -> str | None:
        """Why the pair would be dropped (a :class:`CleanCounts` field name), or None to keep.

        Does not update counts or the dedup memory.
        """
        n_src, n_tgt = len(src.split()), len(tgt.split())
        if n_src == 0 or n_tgt == 0:
            return "empty"
        if n_src > self.max_length or n_tgt > self.max_length:
            return "too_long"
        if max(n_src, n_tgt) > self.max_ratio * min(n_src, n_tgt):
            return "ratio"
        return None

    def __call__(self, pairs: Iterable[Pair]) -> Iterator[Pair]:
        """Yield the kept pairs, counting every drop in :attr:`counts`."""
        counts = self.counts
        for src, tgt in pairs:
            counts.read += 1
            why = self.reason(src, tgt)
            if why is None and self.dedup:
                key = int.from_bytes(
                    hashlib.blake2b(f"{src}\x00{tgt}".encode(), digest_size=8).digest(), "little"
                )
                if key in self._seen:
                    why = "duplicate"
                else:
                    self._seen.add(key)
            if why is None:
                counts.kept += 1
                yield src, tgt
            else:
                setattr(counts, why, getattr(counts, why) + 1)

