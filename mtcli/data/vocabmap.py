"""Separate source and target SentencePiece models whose pieces one vocabulary maps to ids.

This is how Marian (and the OPUS-MT models on the Hugging Face hub) tokenize: the source side is
split into pieces by ``source.spm``, each piece is looked up in ``vocab.json`` (a piece the file
lacks becomes unk); the target ids go back to pieces through the same file and ``target.spm``
joins them into text. A run imported by ``mtcli import-hf`` keeps the three files, with the
vocabulary's ids renumbered to mtcli's fixed special ids (``pad=0, unk=1, bos=2, eos=3``).

:class:`VocabTokenizer` offers what decoding asks of :class:`~mtcli.data.tokenizer.Tokenizer`
(``encode``, ``encode_batch``, ``decode``, ``vocab_size``, ``id_to_piece``, ``piece_to_id``,
``pieces``, ``model_path``) plus ``encode_target_batch`` (the target side, for scoring). Like
Marian's tokenizer it takes a leading language code (``>>fr<<``) as one piece, and its
``decode`` skips unk as Marian's ``skip_special_tokens`` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from mtcli.data.tokenizer import (
    BOS_ID,
    BOS_PIECE,
    EOS_ID,
    EOS_PIECE,
    PAD_ID,
    PAD_PIECE,
    UNK_ID,
    UNK_PIECE,
    Tokenizer,
    one_line,
)
from mtcli.errors import DataError
from mtcli.rundir import SOURCE_SPM_NAME, TARGET_SPM_NAME, VOCAB_NAME

WORD_START = "\u2581"
_SPECIAL_PIECES = {PAD_ID: PAD_PIECE, UNK_ID: UNK_PIECE, BOS_ID: BOS_PIECE, EOS_ID: EOS_PIECE}


def load_spm(path: Path) -> spm.SentencePieceProcessor:
    """The SentencePiece model at ``path``; :class:`DataError` naming it when it is missing or
    does not load."""
    if not path.is_file():
        raise DataError(f"{path}: SentencePiece model not found")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a readable SentencePiece model ({reason})") from None
    return processor


def read_vocab(path: Path) -> dict[str, int]:
    """``vocab.json``: a JSON object mapping each piece to its id; :class:`DataError` naming the
    file when it is missing or is not one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: vocabulary not found") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a readable vocabulary ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in raw.items()):
        raise DataError(f"{path}: expected a JSON object mapping pieces to integer ids")
    return raw


class VocabTokenizer:
    """Source and target SentencePiece models mapped to mtcli ids through one vocabulary file
    (see the module docstring). ``model_path`` is the vocabulary file: it defines the ids, and
    checkpoints record its sha256."""

    def __init__(self, source_spm: str | Path, target_spm: str | Path, vocab: str | Path) -> None:
        """Load the three files; :class:`DataError` naming the file that is missing or wrong."""
        self.source_path, self.target_path = Path(source_spm), Path(target_spm)
        self.model_path = Path(vocab)
        self._src, self._tgt = load_spm(self.source_path), load_spm(self.target_path)
        self._ids = read_vocab(self.model_path)
        self.vocab_size: int = max(self._ids.values()) + 1
        ids = set(self._ids.values())
        if len(ids) != len(self._ids) or min(ids) < 0 or not ids >= set(range(1, self.vocab_size)):
            raise DataError(f"{self.model_path}: the ids must be distinct and cover 1..{self.vocab_size - 1}")
        if self._ids.get(UNK_PIECE) != UNK_ID:
            raise DataError(f"{self.model_path}: {UNK_PIECE} must have id {UNK_ID}")
        self._pieces = [""] * self.vocab_size
        for piece, i in self._ids.items():
            self._pieces[i] = piece
        for i, piece in _SPECIAL_PIECES.items():
            self._pieces[i] = piece

    def __getstate__(self) -> dict:
        """Pickle by path (SentencePiece processors are not picklable)."""
        return {"paths": (str(self.source_path), str(self.target_path), str(self.model_path))}

    def __setstate__(self, state: dict) -> None:
        """Reload the files from the pickled paths."""
        self.__init__(*state["paths"])  # type: ignore[misc]

    def _ids_of(self, pieces: list[str]) -> list[int]:
        get = self._ids.get
        return [get(p, UNK_ID) for p in pieces]

    def pieces(self, text: str) -> list[str]:
        """Source pieces of one sentence (a leading ``>>xx<<`` language code is one piece)."""
        code, rest = "", text
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, rest = text[: end + 2], text[end + 2:]
        return ([code] if code else []) + self._src.encode(rest, out_type=str)

    def encode(self, text: str) -> list[int]:
        """Source ids of one sentence (no bos/eos)."""
        return self._ids_of(self.pieces(text))

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Source ids of many sentences."""
        return [self.encode(text) for text in texts]

    def encode_target_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Target ids of many sentences (pieces of the target SentencePiece model)."""
        if not texts:
            return []
        return [self._ids_of(p) for p in self._tgt.encode(list(texts), out_type=str, num_threads=num_threads)]

    def decode(self, ids: Sequence[int]) -> str:
        """Target text of ``ids``: pad, unk, bos and eos skipped (as Marian's tokenizer does), the
        other pieces joined by the target SentencePiece model."""
        pieces = [self._pieces[int(i)] for i in ids if int(i) not in _SPECIAL_PIECES]
        return one_line(self._tgt.decode_pieces(pieces).replace(WORD_START, " ").strip())

    def piece_to_id(self, piece: str) -> int:
        """The id of a piece (unk's id for a piece the vocabulary does not have)."""
        return self._ids.get(piece, UNK_ID)

    def id_to_piece(self, i: int) -> str:
        """The piece of id ``i`` (the special ids by mtcli's names)."""
        if not 0 <= int(i) < self.vocab_size:
            raise IndexError(f"id {i} outside the vocabulary (size {self.vocab_size})")
        return self._pieces[int(i)]


def tokenizer_files(model_path: str | Path) -> list[Path]:
    """The files a tokenizer is made of: an ``spm.model``, or a ``vocab.json`` with the
    ``source.spm`` and ``target.spm`` beside it."""
    path = Path(model_path)
    if path.name == VOCAB_NAME:
        return [path, path.parent / SOURCE_SPM_NAME, path.parent / TARGET_SPM_NAME]
    return [path]


def load_tokenizer(model_path: str | Path) -> Tokenizer | VocabTokenizer:
    """The tokenizer of an ``spm.model``, or of a ``vocab.json`` and its two SentencePiece models."""
    path = Path(model_path)
    if path.name == VOCAB_NAME:
        return VocabTokenizer(*tokenizer_files(path)[1:], path)
    return Tokenizer(path)


__all__ = ["VocabTokenizer", "load_spm", "load_tokenizer", "read_vocab", "tokenizer_files"]
