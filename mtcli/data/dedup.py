"""The dedup memory of cleaning: a pair's 64-bit key, and the set of keys already kept.

A pair is remembered by a 64-bit key made from its two lines' hashes
(:func:`~mtcli.data.scan.line_hashes`), not by its text, so memory is about 10 bytes per unique
pair in sorted numpy runs (:class:`SortedKeySet`, made by :func:`key_set`). Two different pairs share a
key with probability about ``n^2 / 2^65`` (about one in a million at WMT19's 38M pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mtcli.data.scan import line_hashes

# An odd 64-bit constant (2^64 over the golden ratio) that mixes the source's hash into a pair's key.
_MIX = np.uint64(0x9E3779B97F4A7C15)


def pair_keys(src: Sequence[bytes | str], tgt: Sequence[bytes | str]) -> np.ndarray:
    """The 64-bit keys (uint64) that stand for the pairs ``zip(src, tgt)`` in the dedup memory:
    :func:`keys_of` the lines' hashes (:func:`~mtcli.data.scan.line_hashes`; a str is hashed as
    its UTF-8 bytes, so a line gets one key as text or as bytes). The same in every run and
    process."""
    return keys_of(line_hashes(src), line_hashes(tgt))


def keys_of(src_hashes: np.ndarray, tgt_hashes: np.ndarray) -> np.ndarray:
    """Pair keys from the two sides' line hashes: ``hash(source) * C XOR hash(target)`` for an
    odd constant ``C``, so swapping the sides gives another key."""
    return src_hashes * _MIX ^ tgt_hashes


def key_set() -> SortedKeySet:
    """An empty dedup memory."""
    return SortedKeySet()


class SortedKeySet:
    """The dedup memory in numpy: 64-bit keys kept in a few sorted runs, 8 bytes a key (a Python set
    of ints takes about 80, 3 GB at WMT19's 38M pairs). Keys are looked up and added a batch at
    a time. A new batch becomes a run of its own, and runs are merged while the one before the
    last is less than four times its size, so there are at most ``log4(n)`` runs to search and
    each key is re-sorted a logarithmic number of times.

    Past :data:`FILTER_FROM` keys a bitmap of 8-16 bits a key (1-2 bytes), indexed by a key's
    top bits, says which keys cannot be there (their bit is clear), so only the few others (the
    real repeats and at most one key in eight) are searched for in the runs: a search costs
    about ten cache misses a key in a large run, the bitmap one.
    """

    #: Keys held before the bitmap is made (a worker's range of pairs stays below it).
    FILTER_FROM = 1 << 16

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []
        self._bitmap: np.ndarray | None = None
        self._bits = 0  # the bitmap has 2**_bits bits

    def __len__(self) -> int:
        return sum(len(run) for run in self._runs)

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Add ``keys`` (uint64); return the mask of those that are new: in no earlier batch, and
        the first of their value in this one."""
        mask = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return mask
        unique, first = np.unique(keys, return_index=True)
        new = ~self.contains(unique)
        mask[first[new]] = True
        if new.any():
            added = unique[new]
            self._runs.append(added)
            while len(self._runs) > 1 and len(self._runs[-2]) < 4 * len(self._runs[-1]):
                last = self._runs.pop()
                merged = np.concatenate((self._runs.pop(), last))
                merged.sort(kind="stable")  # timsort: two sorted runs merge in linear time
                self._runs.append(merged)
            self._update_bitmap(added)
        return mask

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """The mask of ``keys`` (uint64) that are held; adds nothing."""
        found = np.zeros(len(keys), dtype=bool)
        if not len(keys) or not self._runs:
            return found
        ask = np.flatnonzero(self._marked(keys)) if self._bitmap is not None else slice(None)
        asked = keys[ask]
        held = np.zeros(len(asked), dtype=bool)
        for run in self._runs:
            held |= run[np.searchsorted(run, asked).clip(max=len(run) - 1)] == asked
        found[ask] = held
        return found

    def _slots(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's byte in the bitmap and its bit there, from the key's top ``_bits`` bits."""
        slot = keys >> np.uint64(64 - self._bits)
        return (slot >> np.uint64(3)).astype(np.intp), (slot & np.uint64(7)).astype(np.uint8)

    def _marked(self, keys: np.ndarray) -> np.ndarray:
        """True where a kept key shares the key's bit (the key may be kept), False where none does."""
        byte, bit = self._slots(keys)
        return (self._bitmap[byte] >> bit) & 1 == 1

    def _update_bitmap(self, added: np.ndarray) -> None:
        """Mark ``added``; past :data:`FILTER_FROM` keys, (re)make the bitmap at >= 8 bits a key."""
        size = len(self)
        if size < self.FILTER_FROM:
            return
        if self._bitmap is None or 8 * size > 1 << self._bits:
            self._bits = (8 * size).bit_length()  # 8-16 bits a key now, >= 8 until remade
            self._bitmap = np.zeros(1 << (self._bits - 3), dtype=np.uint8)
            parts = [run[i:i + (1 << 18)] for run in self._runs for i in range(0, len(run), 1 << 18)]
        else:
            parts = [added]
        for part in parts:  # a slice at a time: the temporaries take 25 bytes a key
            byte, bit = self._slots(part)
            np.bitwise_or.at(self._bitmap, byte, np.left_shift(np.uint8(1), bit))
