"""A word table in C for :class:`~mtcli.data.tokenizer.WordCache`: each distinct word's ids,
looked up a block of text at a time without a Python object per word.

Encoding a block of lines (each ended by ``\\n``) is one pass of ``wordtable.c`` over its bytes
that finds every word's entry in the table (a word is what lies before a ``' '`` or ``'\\n'``)
and adds the words it does not know; SentencePiece encodes just those, and a second call writes
every word's ids and each line's count. The table keeps the first ``max_words`` distinct words
it meets, as the Python cache does. Compiled on first use (:mod:`mtcli.native`); without a
compiler, :func:`available` is False and the cache does the same in numpy, Arrow and Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mtcli.native import library

SOURCE = Path(__file__).with_name("wordtable.c")
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {
    "wt_new": (_P, [_L]),
    "wt_free": (None, [_P]),
    "wt_scan": (_L, [_P, ctypes.c_char_p, _L, _P, _P, _L, ctypes.POINTER(_L)]),
    "wt_keys_from": (_P, [_P, _L, _P]),
    "wt_set_ids": (_I, [_P, _L, _L, _P, _P]),
    "wt_count": (_L, [_P, _P, _L]),
    "wt_emit": (None, [_P, _P, _P, _L, _P, _I, _P]),
    "wt_end_block": (None, [_P]),
    "wt_count_words": (_L, [ctypes.c_char_p, _L]),
    "wt_entries": (_L, [_P]),
}


_library = library(SOURCE, _SIGNATURES, "the C word table", "encoding uses numpy and Arrow")


def available() -> bool:
    """Whether the word table is compiled and loaded (compiles it on the first call)."""
    return _library() is not None


class WordTable:
    """Distinct words and their ids, for up to ``max_words`` words (needs :func:`available`)."""

    def __init__(self, max_words: int) -> None:
        self._lib = _library()
        if self._lib is None:
            raise RuntimeError("the C word table is not available")
        self._table = self._lib.wt_new(max_words)
        if not self._table:
            raise MemoryError("cannot allocate the word table")

    def __len__(self) -> int:
        """The words the table holds."""
        return self._lib.wt_entries(self._table)

    def __del__(self) -> None:
        if getattr(self, "_table", None):
            self._lib.wt_free(self._table)
            self._table = None

    def encode_text(self, text: bytes, encode_words: Callable[[list[str]], list[list[int]]],
                    dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """The ids (``dtype``: uint16 or int32) of every line of ``text`` (valid UTF-8, lines
        ended by ``\\n``; a last line without one counts), as one flat array, and each line's
        number of ids; ``encode_words`` gives the ids of the words the table does not know."""
        lib, table = self._lib, self._table
        if np.dtype(dtype) not in (np.dtype(np.uint16), np.dtype(np.int32)):
            raise ValueError(f"ids are written as uint16 or int32, not {np.dtype(dtype)}")
        if text and not text.endswith(b"\n"):
            text += b"\n"
        capacity = lib.wt_count_words(text, len(text))
        entries = np.empty(capacity, dtype=np.int32)
        line_end = np.empty(capacity, dtype=np.uint8)
        first = ctypes.c_long()
        words = lib.wt_scan(table, text, len(text), entries.ctypes.data, line_end.ctypes.data, capacity,
                            ctypes.byref(first))
        if words < 0:
            raise MemoryError("the word table ran out of memory")
        new = lib.wt_entries(table) - first.value
        if new:
            self._add_ids(first.value, new, encode_words)
        ids = np.empty(lib.wt_count(table, entries.ctypes.data, words), dtype=dtype)
        lengths = np.empty(int(np.count_nonzero(line_end[:words])), dtype=np.int64)
        lib.wt_emit(table, entries.ctypes.data, line_end.ctypes.data, words, ids.ctypes.data, ids.itemsize,
                    lengths.ctypes.data)
        lib.wt_end_block(table)
        return ids, lengths

    def _add_ids(self, first: int, count: int, encode_words: Callable[[list[str]], list[list[int]]]) -> None:
        """Encode the ``count`` words added from entry ``first`` on and give the table their ids."""
        key_lengths = np.empty(count, dtype=np.int64)
        start = self._lib.wt_keys_from(self._table, first, key_lengths.ctypes.data)
        keys = ctypes.string_at(start, int(key_lengths.sum()))
        ends = np.cumsum(key_lengths).tolist()
        words = [keys[a:b].decode("utf-8") for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        encoded = encode_words(words)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=count)
        flat = np.fromiter((i for ids in encoded for i in ids), dtype=np.int32, count=int(lengths.sum()))
        if self._lib.wt_set_ids(self._table, first, count, flat.ctypes.data, lengths.ctypes.data):
            raise MemoryError("the word table ran out of memory")
