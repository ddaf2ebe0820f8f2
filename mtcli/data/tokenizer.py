"""The joint SentencePiece model shared by source and target: train, encode, decode.

One subword vocabulary is learnt from both sides of the training split (Sennrich et al. and
Kudo & Richardson), so source and target embeddings can be tied. The special ids are fixed
across every model mtcli trains::

    pad = 0    unk = 1    bos = 2    eos = 3

The cache stores SentencePiece ids only; batching adds ``bos``/``eos`` (see ARCHITECTURE.md).

Vocabulary size: SentencePiece refuses a ``vocab_size`` larger than the pieces a corpus can
yield (``hard_vocab_limit``). mtcli keeps that hard limit and turns the refusal into a
one-line :class:`~mtcli.errors.DataError` that names the largest size the corpus allows, rather
than silently training a smaller vocabulary than the config asks for.
"""

from __future__ import annotations

import io
import itertools
import logging
import operator
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from mtcli.errors import DataError
from mtcli.errors import one_line as exception_line
from mtcli.fileio import atomic_write
from mtcli.logs import get_logger

WORD_START = "\u2581"  # SentencePiece's mark of a word's start (the space before it)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_IDS = frozenset((PAD_ID, BOS_ID, EOS_ID))

#: The smallest SentencePiece sample: it rejects 1..100 as input_sentence_size (0 means "use
#: every sentence"), so a smaller data.spm_max_sentences is raised to this.
MIN_SAMPLE = 101

#: SentencePiece's settings for mtcli's fixed special ids and pieces
_SPECIALS = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID, "pad_piece": PAD_PIECE,
             "unk_piece": UNK_PIECE, "bos_piece": BOS_PIECE, "eos_piece": EOS_PIECE}

_LINE_BREAKS = str.maketrans({"\n": " ", "\r": " "})


def one_line(text: str) -> str:
    """``text`` with each line break (``\\n``, ``\\r``) a space: a byte-fallback model can spell
    one in byte pieces (``<0x0A>``), and a hypothesis must stay one line of its output file, in
    line with its source (other separators, U+2028, stay: no line reader splits on them)."""
    return text.translate(_LINE_BREAKS) if "\n" in text or "\r" in text else text


class Tokenizer:
    """A loaded joint SentencePiece model with mtcli's fixed special ids."""

    def __init__(self, model_path: str | Path) -> None:
        """Load ``model_path``; raise :class:`DataError` if it is missing or not a model."""
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"{self.model_path}: SentencePiece model not found")
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(str(self.model_path))
        except (OSError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"{self.model_path}: not a readable SentencePiece model ({reason})") from None
        ids = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise DataError(
                f"{self.model_path}: special ids pad/unk/bos/eos are {ids}, expected "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (not a model trained by mtcli)"
            )
        self._sp = processor
        self.vocab_size: int = processor.get_piece_size()

    def __getstate__(self) -> dict:
        """Pickle by path (SentencePiece processors are not picklable)."""
        return {"model_path": str(self.model_path)}

    def __setstate__(self, state: dict) -> None:
        """Reload the model from the pickled path."""
        self.__init__(state["model_path"])  # type: ignore[misc]

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence (no bos/eos)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of many sentences at once (SentencePiece encodes them in C++ threads)."""
        if not texts:
            return []
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def encode_target_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of target sentences: :meth:`encode_batch` (the joint model serves both sides)."""
        return self.encode_batch(texts, num_threads)

    def words_encode_alone(self) -> bool:
        """True when a sentence's ids are its space-separated words' ids, each word encoded on its
        own: the model splits pieces at whitespace, so no piece holds a word boundary (a ``▁``
        past its first character), strips extra whitespace and gives every word its ``▁`` prefix,
        and is no word model (whose unknown words, one ``<unk>`` each alone, are one together).
        So is every other model mtcli trains; :class:`WordCache` relies on it."""
        proto = _model_proto(self.model_path)
        normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
        return (trainer.model_type != trainer.WORD and trainer.split_by_whitespace
                and not trainer.treat_whitespace_as_suffix
                and normalizer.add_dummy_prefix and normalizer.remove_extra_whitespaces
                and normalizer.escape_whitespaces
                and not any(WORD_START in piece.piece[1:] for piece in proto.pieces))

    def nbest(self, texts: list[str], n: int) -> list[list[tuple[list[int], float]]]:
        """The ``n`` most probable segmentations of each text, as ``(ids, log-probability)``."""
        if not texts:
            return []
        results = self._sp.nbest_encode(list(texts), return_type="proto", nbest_size=int(n))
        return [[([p.id for p in best.pieces], float(best.score)) for best in result.nbests]
                for result in results]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of ``ids``, on one line (:func:`one_line`); pad, bos and eos are
        skipped (unk decodes as " ⁇ "). Spaces at either end go: they come of a bare word-start
        piece that a search began or ended on, and are no part of the text (transformers'
        decoding of the HF export drops them too)."""
        return one_line(self._sp.decode([int(i) for i in ids if int(i) not in SPECIAL_IDS])).strip(" ")

    def piece_to_id(self, piece: str) -> int:
        """The id of a piece (unk's id for a piece the model does not have)."""
        return int(self._sp.piece_to_id(piece))

    def pieces(self, text: str) -> list[str]:
        """Subword pieces of one sentence (for inspection and attention plots)."""
        return self._sp.encode(text, out_type=str)

    def id_to_piece(self, i: int) -> str:
        """The piece string of id ``i``."""
        if not 0 <= int(i) < self.vocab_size:
            raise IndexError(f"id {i} outside the vocabulary (size {self.vocab_size})")
        return self._sp.id_to_piece(int(i))

    @staticmethod
    def train(
        sentences: Iterable[str] | list[Path],
        model_prefix: Path,
        vocab_size: int,
        model_type: str,
        character_coverage: float,
        max_sentences: int,
        seed: int = 1,
        num_threads: int = 1,
        control_symbols: Sequence[str] = (),
        byte_fallback: bool = False,
        normalization: str = "nmt_nfkc",
    ) -> Path:
        """Train a SentencePiece model on ``sentences``; return the path of ``<prefix>.model``.
        ``control_symbols`` (tags such as ``<2de>``) get ids of their own, after the four special
        ones; text never encodes to them and decoding never writes them. ``byte_fallback``: a
        character without a piece of its own is spelled in UTF-8 byte pieces (256 of the
        ``vocab_size``) instead of being unknown. ``normalization``: SentencePiece's rule for the
        text before it is cut (``nmt_nfkc``, its default; ``identity`` keeps it as written).

        ``sentences`` is a stream of sentences, or a list of text files (one sentence a line),
        which SentencePiece reads itself, several seconds faster on millions of sentences, into
        the same model. When there are more than ``max_sentences``, SentencePiece keeps a
        uniform reservoir sample of that many (its memory is bounded by the cap, not the
        corpus). That sample is not reproducible from run to run on large corpora, so
        ``prepare`` draws its own (:func:`mtcli.data.prepare.spm_sample`) and passes 0. Raises
        :class:`DataError` when the corpus cannot support ``vocab_size`` pieces, naming the
        largest size it allows.

        The model comes back in memory and is written here, atomically, with ``<prefix>.vocab``
        beside it. A model SentencePiece writes itself records its output path (and one trained
        on files, their paths), so its bytes (and the sha256 checkpoints record) would depend on
        where it was trained, not only on the data and settings: neither is kept.
        """
        model_prefix = Path(model_prefix)
        model_prefix.parent.mkdir(parents=True, exist_ok=True)
        log = get_logger()
        sample = max(int(max_sentences), MIN_SAMPLE) if max_sentences > 0 else 0
        files = [Path(f) for f in sentences] if isinstance(sentences, list) and all(
            isinstance(f, Path) for f in sentences) and sentences else None
        counted = None if files is not None else _CountingIterator(sentences)
        text = {"input": ",".join(map(str, files))} if files is not None else {"sentence_iterator": counted}
        spm.set_random_generator_seed(int(seed))
        verbose = log.isEnabledFor(logging.DEBUG)
        proto = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                **text,
                model_writer=proto,
                vocab_size=int(vocab_size),
                model_type=model_type,
                character_coverage=float(character_coverage),
                input_sentence_size=sample,
                shuffle_input_sentence=True,
                **_SPECIALS,
                num_threads=max(1, int(num_threads)),
                byte_fallback=bool(byte_fallback),
                normalization_rule_name=normalization,
                minloglevel=0 if verbose else 2,
                **({"control_symbols": list(control_symbols)} if control_symbols else {}),
            )
        except RuntimeError as exc:
            empty = counted.count == 0 if counted is not None else not any(f.stat().st_size for f in files or ())
            raise _training_error(str(exc), vocab_size, model_type, empty, bool(byte_fallback)) from None
        built = spm.SentencePieceProcessor(model_proto=proto.getvalue()).get_piece_size()
        if built < vocab_size:  # a char model is the text's characters, whatever the size asked
            raise _training_error(f"Vocabulary size too high ({vocab_size}). Please set it to a value <= {built}",
                                  vocab_size, model_type, False, bool(byte_fallback))
        model_path = Path(f"{model_prefix}.model")
        _write_model(_without_inputs(proto.getvalue()) if files else proto.getvalue(), model_path,
                     model_path.with_suffix(".vocab"))
        log.info(
            "trained SentencePiece %s model, %d pieces, from %s (sample cap %s)", model_type, vocab_size,
            f"{counted.count} sentences" if counted is not None else ", ".join(f.name for f in files or ()),
            sample or "none",
        )
        return model_path


def _training_error(message: str, vocab_size: int, model_type: str, empty: bool, in_bytes: bool = False) -> DataError:
    """SentencePiece's training error as a one-line :class:`DataError` that says what to change
    (``in_bytes``: the model has the 256 byte pieces of ``byte_fallback``)."""
    limit = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if limit:
        return DataError(
            f"data.vocab_size={vocab_size} is too large for this training corpus: "
            f"SentencePiece ({model_type}) can build at most {limit.group(2)} pieces from it; "
            "lower data.vocab_size"
        )
    small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if small:
        return DataError(
            f"data.vocab_size={vocab_size} is too small: covering the training text's characters "
            f"needs at least {small.group(2)} pieces (special ids"
            + (", and the 256 byte pieces a data.character_coverage below 1 adds," if in_bytes else "")
            + " included); raise data.vocab_size"
        )
    if empty:
        return DataError("cannot train SentencePiece: the training text is empty")
    if "char_model_trainer" in message and "vocab_size" in message:
        return DataError(
            f"data.vocab_size={vocab_size} is too small for a char model: it needs a piece for each character "
            "of the training text (special ids and any byte pieces included); raise data.vocab_size")
    first = message.strip().splitlines()[0] if message.strip() else "RuntimeError"
    return DataError(f"SentencePiece training failed: {first}")


def _model_pb2() -> Any:
    """SentencePiece's ``sentencepiece_model_pb2``, or a one-line :class:`DataError`: it needs a
    protobuf runtime of its own major version, at least as new as the one that generated it
    (which sentencepiece does not declare; mtcli's pyproject does)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # ImportError, or protobuf's VersionError (of no public class)
        raise DataError(f"sentencepiece's model reader cannot load with this protobuf ({exception_line(exc)}): "
                        "pip install 'protobuf>=7.36.1,<8'") from None
    return sentencepiece_model_pb2


def _without_inputs(model: bytes) -> bytes:
    """A serialized model without the paths of the files it was trained on: the same bytes as
    the model trained on the same sentences as a stream."""
    proto = _model_pb2().ModelProto()
    proto.ParseFromString(model)
    del proto.trainer_spec.input[:]
    return proto.SerializeToString()


def copy_model(source: Path, model_prefix: Path) -> Path:
    """Write the SentencePiece model ``source`` (checked like any model mtcli loads) as
    ``<prefix>.model``, byte for byte, with ``<prefix>.vocab`` beside it; return the model path."""
    Tokenizer(source)
    model_path = Path(f"{model_prefix}.model")
    _write_model(Path(source).read_bytes(), model_path, model_path.with_suffix(".vocab"))
    return model_path


def _write_model(model: bytes, model_path: Path, vocab_path: Path) -> None:
    """Write a serialized SentencePiece model and its ``piece<TAB>score`` listing atomically."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    listing = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    with atomic_write(model_path, "wb") as handle:
        handle.write(model)
    with atomic_write(vocab_path) as handle:
        handle.write(listing)


class _CountingIterator:
    """Wraps an iterable of sentences, counting what SentencePiece pulls from it."""

    def __init__(self, sentences: Iterable[str]) -> None:
        self._it = iter(sentences)
        self.count = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> str:
        item = next(self._it)
        self.count += 1
        return item


def _model_proto(path: Path) -> Any:
    """The SentencePiece model file's settings and pieces (its ``ModelProto``)."""
    proto = _model_pb2().ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


#: What a SentencePiece model records of how it was trained, not of the ids it gives: the input
#: files and the threads (mtcli's number of them changed once).
TRAINING_ONLY = ("input", "input_format", "model_prefix", "num_threads")


def same_model(a: Path, b: Path) -> bool:
    """Whether two SentencePiece model files give the same pieces and ids: the same model but
    for :data:`TRAINING_ONLY` (a cache prepared again by another mtcli)."""
    protos = [_model_proto(a), _model_proto(b)]
    for proto in protos:
        for field in TRAINING_ONLY:
            proto.trainer_spec.ClearField(field)
    return protos[0].SerializeToString(deterministic=True) == protos[1].SerializeToString(deterministic=True)


def is_word_model(path: Path) -> bool:
    """Whether the SentencePiece model at ``path`` is a word model (``model_type: word``)."""
    trainer = _model_proto(path).trainer_spec
    return trainer.model_type == trainer.WORD


class WordCache:
    """Encodes sentences a word at a time, remembering the ids of up to ``max_words`` words.

    Text is Zipfian: in a WMT-size corpus almost every word has been seen before, and looking its
    ids up costs a fraction of running SentencePiece over it again. The ids are those of
    :meth:`Tokenizer.encode_batch` for a model whose words encode alone
    (:meth:`Tokenizer.words_encode_alone`); for any other model this encodes whole sentences.
    The cache keeps the first ``max_words`` distinct words it meets (the frequent ones, in a
    large corpus) and never grows past them, in a dict.
    """

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, max_words: int = 500_000) -> None:
        self.tokenizer = tokenizer
        self.dtype = np.dtype(dtype)
        self.max_words = max_words
        self._words: dict[str, bytes] | None = {" ": b"", "\n": b""} if tokenizer.words_encode_alone() else None
        # whether a literal ▁ has other ids in its line than alone (its normalisation keeps it)
        probe = tokenizer.encode_batch(["a \u2581 b", "a", "\u2581", "b"]) if self._words is not None else []
        self._marks_differ = bool(probe) and probe[0] != probe[1] + probe[2] + probe[3]

    def encode(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all ``lines`` (no bos/eos; none may hold a ``\n``) as one flat array of
        :attr:`dtype`, and each line's number of ids (int64)."""
        if self._words is None:
            encoded = self.tokenizer.encode_batch(lines)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            flat_ids = itertools.chain.from_iterable(encoded)
            return np.fromiter(flat_ids, dtype=self.dtype, count=int(lengths.sum())), lengths
        return self.encode_text("".join(line + "\n" for line in lines).encode())

    def encode_text(self, text: bytes) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode` of the lines of ``text`` (valid UTF-8, each line ended by ``\n`` as in
        the text files ``prepare`` writes; a last line without one counts too), without making a
        Python string of each line: numpy finds the words, Arrow numbers the distinct ones, and
        only those go through Python (the table, and SentencePiece for the new ones).

        A word is what lies before a single space or a line's end, with that space or ``\n``
        kept as its last character, which costs nothing to cut out: "a  b" has an empty word
        (no ids, as in SentencePiece), and an empty line is one. Each word's ids are then
        gathered from the distinct words' ids by numpy, a few passes over the output in all.
        """
        ended = not text or text.endswith(b"\n")  # then the text after the last "\n" is no line
        if self._words is None:
            lines = text.decode("utf-8").split("\n")
            return self.encode(lines[:-1] if ended else lines)
        import pyarrow as pa

        if len(text) >= 1 << 31:  # an array's offsets are 32-bit
            raise ValueError("encode_text takes less than 2 GiB at a time")
        a = np.frombuffer(text if ended else text + b"\n", dtype=np.uint8)
        ends = np.flatnonzero((a == 32) | (a == 10))  # where each word ends
        offsets = np.empty(len(ends) + 1, dtype=np.int32)
        offsets[0] = 0
        np.add(ends, 1, out=offsets[1:])
        words = pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets), pa.py_buffer(a))
        per_line = np.diff(np.flatnonzero(a[ends] == 10), prepend=-1)  # each line's number of words
        ids, lengths = self._encode_words(words, per_line)
        if self._marks_differ and WORD_START.encode("utf-8") in text:
            return self._marked_lines_whole(a, ids, lengths)
        return ids, lengths

    def _marked_lines_whole(self, a: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)`` with each line of the text ``a`` that holds a literal ``▁`` encoded
        whole: SentencePiece reads it as a space, so its word alone is not its ids in the line
        (rare: only a normalisation other than ``nmt_nfkc`` keeps it; ``a`` holds one)."""
        mark = WORD_START.encode("utf-8")
        at = np.flatnonzero((a[:-2] == mark[0]) & (a[1:-1] == mark[1]) & (a[2:] == mark[2]))
        stops = np.flatnonzero(a == 10)
        marked = np.unique(np.searchsorted(stops, at)).tolist()
        whole = self.tokenizer.encode_batch([a[(stops[i - 1] + 1 if i else 0):stops[i]].tobytes().decode("utf-8")
                                             for i in marked])
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        pieces, done = [], 0  # the ids between the marked lines as they are, each marked line's anew
        for i, line_ids in zip(marked, whole, strict=True):
            pieces += [ids[done:offsets[i]], np.array(line_ids, dtype=self.dtype)]
            done = offsets[i + 1]
        lengths = lengths.copy()
        lengths[marked] = [len(line_ids) for line_ids in whole]
        return np.concatenate([*pieces, ids[done:]]), lengths

    def _encode_words(self, words, per_line: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_text` of its words (a pyarrow string array, each word ended by its space
        or ``\n``) and each line's number of words."""
        table, coded = self._words, words.dictionary_encode()
        distinct = coded.dictionary.to_pylist()
        per_word = list(map(table.get, distinct))  # each distinct word's ids as bytes; None if new
        new = np.flatnonzero(np.fromiter(map(operator.is_, per_word, itertools.repeat(None)), dtype=bool,
                                         count=len(per_word))).tolist()
        if new:
            encoded = self.tokenizer.encode_batch([distinct[i][:-1] for i in new])
            room = self.max_words - len(table)
            for n, (i, ids) in enumerate(zip(new, encoded, strict=True)):
                per_word[i] = np.array(ids, dtype=self.dtype).tobytes()
                if n < room:
                    table[distinct[i]] = per_word[i]
        flat = np.frombuffer(b"".join(per_word), dtype=self.dtype)
        sizes = np.fromiter(map(len, per_word), dtype=np.int64, count=len(per_word)) // self.dtype.itemsize
        which = coded.indices.to_numpy(zero_copy_only=False)  # distinct word of each word
        count = sizes[which]  # ids of each word
        ends = np.cumsum(count)
        starts = np.cumsum(sizes) - sizes  # where each distinct word's ids start in flat
        ids = flat[np.repeat(starts[which] - (ends - count), count) + np.arange(ends[-1] if len(ends) else 0)]
        first = np.cumsum(per_line) - per_line  # every line has at least one word
        lengths = np.add.reduceat(count, first) if len(per_line) else np.zeros(0, dtype=np.int64)
        return ids, lengths


def train_model(files: list[Path], prefix: Path, settings: dict[str, Any]) -> Path:
    """:meth:`Tokenizer.train` with keyword ``settings``: a function a new process can be given
    by name (this module imports quickly: not torch)."""
    return Tokenizer.train(files, prefix, **settings)
