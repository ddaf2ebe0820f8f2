"""A block of text lines scanned in one C pass for cleaning: line ends, word counts, hashes.

Cleaning a range of lines needs, for each line, where it ends, its number of words (as
``str.split`` counts them) and, for dedup, the hash of its bytes (:func:`line_hashes`), and
it needs to know the bytes are the lines the reader would give (valid UTF-8, no ``\\r``, no
byte-order mark). In numpy and pandas that takes several passes over the bytes and a Python
object a line (:func:`numpy_lines`); ``scan.c`` does all of it in one pass
(:func:`scan_lines`). It is compiled on first use (:mod:`mtcli.native`); without a compiler, or
with ``MTCLI_KERNELS=0``, :func:`scan_lines` returns None and cleaning takes the numpy path,
with the same result.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mtcli.native import library

SOURCE = Path(__file__).with_name("scan.c")
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {
    "scan_lines": (_L, [ctypes.c_char_p, _L, _I, _I, _L, _P, _P, _P]),
    "count_lines": (_L, [ctypes.c_char_p, _L]),
    "line_cuts": (_L, [_P, _L, _L, _L, _P, _L, ctypes.POINTER(_L)]),
    "join_rows": (_L, [_P, _P, _L, _P]),
    "take_spans": (_L, [_P, _P, _P, _L, _P]),
}


class Lines(NamedTuple):
    """A block's lines: ``stops[i]`` is the offset just after line ``i`` (its ``\\n``
    included), ``words[i]`` its ``len(line.split())``, ``hashes[i]`` (or None) its
    :func:`line_hashes` value."""

    stops: np.ndarray
    words: np.ndarray
    hashes: np.ndarray | None


_library = library(SOURCE, _SIGNATURES, "the C line scanner", "cleaning uses numpy")


def available() -> bool:
    """Whether the scanner is compiled and loaded (compiles it on the first call)."""
    return _library() is not None


def scan_lines(block: bytes, hashes: bool, strict: bool = False, file_start: bool = False) -> Lines | None:
    """The :class:`Lines` of ``block`` (UTF-8 lines ended by ``\\n``, the last maybe not),
    with their hashes when ``hashes``. None where the C scanner is unavailable, where the block
    is not valid UTF-8, or, when ``strict``, where the reader would change its bytes (a
    ``\\r``, or a byte-order mark at the ``file_start``): the caller then takes its own path,
    which also names the line of an error. Without ``strict``, ``\\r`` is a space."""
    lib = _library()
    if lib is None:
        return None
    capacity = lib.count_lines(block, len(block)) + 1
    stops = np.empty(capacity, dtype=np.int64)
    words = np.empty(capacity, dtype=np.int64)
    hashed = np.empty(capacity, dtype=np.uint64) if hashes else None
    lines = lib.scan_lines(block, len(block), int(strict), int(file_start), capacity, stops.ctypes.data,
                           words.ctypes.data, None if hashed is None else hashed.ctypes.data)
    if lines < 0:
        return None
    return Lines(stops[:lines], words[:lines], None if hashed is None else hashed[:lines])


def line_cuts(block: np.ndarray, every: int, seen: int) -> tuple[int, np.ndarray] | None:
    """The number of line ends (``\n``) in ``block`` (uint8) and the offsets just after every
    ``every``-th of them, counting on from ``seen`` line ends before the block (int64); None
    where the C scanner is unavailable."""
    lib = _library()
    if lib is None:
        return None
    block = np.ascontiguousarray(block, dtype=np.uint8)
    room = len(block) if every >= 64 else lib.line_cuts(block.ctypes.data, len(block), 0, 0, None, 0, None)
    cuts = np.empty(room // every + 1, dtype=np.int64)
    found = ctypes.c_long(0)
    count = lib.line_cuts(block.ctypes.data, len(block), every, seen, cuts.ctypes.data, len(cuts),
                          ctypes.byref(found))
    return count, cuts[:found.value]


def line_ends(block: np.ndarray) -> np.ndarray:
    """The offset just after each ``\n`` of ``block`` (uint8), int64: in C, or numpy without it."""
    found = line_cuts(block, 1, 0)
    return found[1] if found is not None else np.flatnonzero(block == 10) + 1


def take_spans(block: bytes | memoryview, starts: np.ndarray, ends: np.ndarray) -> bytes:
    """The spans ``block[starts[i]:ends[i]]`` one after another (int64 offsets): copied in C, or
    joined in Python without it."""
    lib = _library()
    if lib is None:
        return b"".join([block[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    out = np.empty(int((ends - starts).sum()), dtype=np.uint8)
    lib.take_spans(np.frombuffer(block, dtype=np.uint8).ctypes.data, starts.ctypes.data, ends.ctypes.data,
                   len(starts), out.ctypes.data)
    return out.tobytes()


def join_rows(data: np.ndarray, offsets: np.ndarray) -> bytes | None:
    """The rows of an Arrow string column (its ``data`` bytes from the first row's start, uint8,
    and its ``offsets``, ``len(rows) + 1`` of them) as lines, each ended by ``\n``; None where
    the C scanner is unavailable or a row holds a ``\n`` or ``\r``."""
    lib = _library()
    if lib is None:
        return None
    data = np.ascontiguousarray(data)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    rows = len(offsets) - 1
    out = bytearray(len(data) + rows)
    buffer = (ctypes.c_char * len(out)).from_buffer(out)
    written = lib.join_rows(data.ctypes.data, offsets.ctypes.data, rows, ctypes.addressof(buffer))
    del buffer  # the bytearray can be resized (and converted) only without an export
    return bytes(out) if written >= 0 else None


def line_hashes(lines: Sequence[bytes | str]) -> np.ndarray:
    """The 64-bit hash (uint64) of each line: SipHash-2-4 of its UTF-8 bytes under a fixed key,
    then a 64-bit mixer (pandas' ``hash_array``, which a str and its UTF-8 bytes get alike).
    The same in every run and process, and the same as :func:`scan_lines` gives."""
    from pandas.util import hash_array  # pandas comes with `datasets`; imported when deduplicating

    values = np.empty(len(lines), dtype=object)
    values[:] = lines
    return hash_array(values, categorize=False)


# What Python's str.split() splits on: ASCII whitespace (one byte in UTF-8) and the wider spaces
# (two or three bytes; none is above U+3000).
_ASCII_SPACE = np.zeros(256, dtype=bool)
_ASCII_SPACE[[ord(c) for c in map(chr, range(128)) if c.isspace()]] = True
_WIDE_SPACES = [chr(c).encode() for c in range(0x80, 0x3001) if chr(c).isspace()]
# Their first bytes are 0xC2 and 0xE1-0xE3 (the tests check this).
_WIDE_LEADS = sorted({wide[0] for wide in _WIDE_SPACES})


def line_layout(block: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Where each line of a block of valid UTF-8 ends, and how many words it holds:
    ``(stops, counts)``, where line ``i`` is ``block[stops[i - 1]:stops[i]]`` (``stops[-1]``
    is 0) with its ``\n``, and ``counts[i]`` is ``len(line.split())``. Lines are ended by
    ``\n``, the last maybe not. Nothing is decoded: word starts (a byte that is not a space,
    after one that is) are summed per line over the bytes, and only the few lines that hold a
    non-ASCII space are counted by ``str.split`` itself."""
    a = np.frombuffer(block, dtype=np.uint8)
    if not len(a):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    low = np.flatnonzero(a < 32)  # every line end, and the other control bytes (rare)
    low_bytes = a[low]
    ends = low[low_bytes == 10]
    space = a <= 32  # every ASCII space is; other control bytes are checked for above
    if not _ASCII_SPACE[low_bytes].all():
        space = _ASCII_SPACE[a]
    word_start = np.empty(len(a), dtype=bool)
    word_start[0] = not space[0]
    np.greater(space[:-1], space[1:], out=word_start[1:])
    stops = ends + 1 if a[-1] == 10 else np.append(ends + 1, len(a))
    line_starts = np.concatenate(([0], stops[:-1]))
    counts = np.add.reduceat(word_start.view(np.uint8), line_starts, dtype=np.int32).astype(np.int64)
    for i in _wide_space_lines(a, stops).tolist():
        start = int(stops[i - 1]) if i else 0
        counts[i] = len(block[start:int(stops[i])].decode("utf-8").split())
    return stops, counts


def _wide_space_lines(a: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Indices of the lines (ending before ``stops``) of the UTF-8 bytes ``a`` that hold a wide space."""
    at = np.flatnonzero((a == 0xC2) | (a - np.uint8(0xE1) <= 2))  # the few bytes worth a look
    if not len(at):
        return at
    found = np.zeros(len(at), dtype=bool)
    last = len(a) - 1
    for wide in _WIDE_SPACES:
        match = a[at] == wide[0]
        for k in range(1, len(wide)):
            match &= a[np.minimum(at + k, last)] == wide[k]
        found |= match
    return np.unique(np.searchsorted(stops, at[found], side="right"))


def numpy_lines(block: bytes, hashes: bool) -> Lines:
    """:func:`scan_lines`' result by numpy and pandas, for a ``block`` known to be valid UTF-8."""
    stops, words = line_layout(block)
    return Lines(stops, words, line_hashes(block.split(b"\n")[:len(stops)]) if hashes else None)
