"""Cleaning the training pairs: each pair is kept or dropped for one counted reason.

Only the training split is cleaned (:class:`PairCleaner`); valid/test splits keep every line, so
scores are over the full test sets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from mtcli.data.sources import Pair


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
