"""A block of text lines laid out for cleaning: line ends, lengths, hashes.

Cleaning a range of lines needs, for each line, where it ends, its length (its number of words,
as ``str.split`` counts them, or of characters other than spaces for a language written without
them) and, for dedup, the hash of its bytes (:func:`line_hashes`). numpy finds the line ends and
counts the words or characters over the bytes without decoding them (:func:`line_layout`);
pandas hashes the lines (:func:`numpy_lines` gives all three).
"""

from __future__ import annotations

import functools
import itertools
import unicodedata
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Lines(NamedTuple):
    """A block's lines: ``stops[i]`` is the offset just after line ``i`` (its ``\\n``
    included), ``lengths[i]`` its :func:`text_length`, ``hashes[i]`` (or None) its
    :func:`line_hashes` value."""

    stops: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray | None


def text_length(text: str, characters: bool = False) -> int:
    """How long ``text`` is for cleaning: its words (``len(text.split())``), or with
    ``characters`` its characters other than spaces; 0 for text of spaces and invisible format
    characters alone (a zero-width space, a direction mark: Unicode's ``Cf``), which reads as empty."""
    words = text.split()
    if words and not text.isascii() and all(unicodedata.category(c) == "Cf" for word in words for c in word):
        return 0
    return sum(map(len, words)) if characters else len(words)


@functools.cache
def _format_characters() -> np.ndarray:
    """The code points of Unicode's invisible format characters (``Cf``), sorted: all are in
    the first two planes or among the tags (U+E0000-U+E0FFF), the only places looked at (10 ms)."""
    places = itertools.chain(range(0x20000), range(0xE0000, 0xE1000))
    return np.array([c for c in places if unicodedata.category(chr(c)) == "Cf"], dtype=np.int64)


def line_ends(block: np.ndarray) -> np.ndarray:
    """The offset just after each ``\n`` of ``block`` (uint8), int64."""
    return np.flatnonzero(block == 10) + 1


def take_spans(block: bytes | memoryview, starts: np.ndarray, ends: np.ndarray) -> bytes:
    """The spans ``block[starts[i]:ends[i]]`` one after another (int64 offsets)."""
    view = memoryview(block)
    return b"".join([view[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])


def line_hashes(lines: Sequence[bytes | str]) -> np.ndarray:
    """The 64-bit hash (uint64) of each line: SipHash-2-4 of its UTF-8 bytes under a fixed key,
    then a 64-bit mixer (pandas' ``hash_array``, which a str and its UTF-8 bytes get alike).
    The same in every run and process."""
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


def line_layout(block: bytes, characters: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Where each line of a block of valid UTF-8 ends, and how long it is:
    ``(stops, counts)``, where line ``i`` is ``block[stops[i - 1]:stops[i]]`` (``stops[-1]``
    is 0) with its ``\n``, and ``counts[i]`` is :func:`text_length` ``(line, characters)``.
    Lines are ended by ``\n``, the last maybe not. Nothing is decoded: word starts (a byte that
    is not a space, after one that is), or character starts (a byte that is neither a space nor
    a UTF-8 continuation byte), are summed per line over the bytes, and only the few lines that
    hold a non-ASCII space are measured by ``str.split`` itself."""
    a = np.frombuffer(block, dtype=np.uint8)
    if not len(a):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    low = np.flatnonzero(a < 32)  # every line end, and the other control bytes (rare)
    low_bytes = a[low]
    ends = low[low_bytes == 10]
    space = a <= 32  # every ASCII space is; other control bytes are checked for above
    if not _ASCII_SPACE[low_bytes].all():
        space = _ASCII_SPACE[a]
    if characters:
        unit_start = ~space & ((a & 0xC0) != 0x80)
    else:
        unit_start = np.empty(len(a), dtype=bool)
        unit_start[0] = not space[0]
        np.greater(space[:-1], space[1:], out=unit_start[1:])
    stops = ends + 1 if a[-1] == 10 else np.append(ends + 1, len(a))
    line_starts = np.concatenate(([0], stops[:-1]))
    counts = np.add.reduceat(unit_start.view(np.uint8), line_starts, dtype=np.int32).astype(np.int64)
    for i in np.union1d(_wide_space_lines(a, stops), _format_led_lines(a, line_starts, counts)).tolist():
        start = int(stops[i - 1]) if i else 0
        counts[i] = text_length(block[start:int(stops[i])].decode("utf-8"), characters)
    return stops, counts


def _format_led_lines(a: np.ndarray, line_starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Indices of the lines of the UTF-8 bytes ``a`` (starting at ``line_starts``) counted as
    holding text whose first character is a space or an invisible format character: the few
    that may hold nothing else, which :func:`text_length` then measures (as 0 if so)."""
    last = len(a) - 1
    first = a[line_starts]
    maybe = np.flatnonzero((counts > 0) & ((first >= 0xC2) | _ASCII_SPACE[first]))
    if not len(maybe):
        return maybe
    b0, b1, b2, b3 = (a[np.minimum(line_starts[maybe] + k, last)].astype(np.int64) for k in range(4))
    point = np.where(b0 < 0xE0, ((b0 & 0x1F) << 6) | (b1 & 0x3F),
                     np.where(b0 < 0xF0, ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F),
                              ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F)))
    return maybe[_ASCII_SPACE[b0] | ((b0 >= 0xC2) & np.isin(point, _format_characters()))]


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


def numpy_lines(block: bytes, hashes: bool, characters: bool = False) -> Lines:
    """The :class:`Lines` of a ``block`` known to be valid UTF-8 (ended by ``\\n``, the last
    line maybe not), their lengths in characters when ``characters``, with their hashes when
    ``hashes``."""
    stops, lengths = line_layout(block, characters)
    return Lines(stops, lengths, line_hashes(block.split(b"\n")[:len(stops)]) if hashes else None)
