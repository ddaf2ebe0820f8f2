"""Validation and test pairs that are also training pairs.

A test pair the model was trained on is scored as something it remembers, not as something it
translates, so a test set that shares pairs with the training data overstates the model; a
validation set that does rewards memorising when it picks checkpoints and stops a run. Corpora
that users split themselves (a translation memory cut into train and test after no deduplication,
a web crawl that holds a public test set) often do. ``prepare`` counts, for every training corpus,
the validation and test pairs in its two languages that are exactly one of its kept training
pairs (both sides byte for byte), records them in the cache's manifest and warns of each split
that has any (again whenever it finds the cache up to date); ``evaluate`` says them beside the
scores of such a split.

Pairs are compared by their 64-bit keys (:func:`~mtcli.data.dedup.pair_keys`). With
``data.dedup`` the cleaner already holds every kept pair's key, and is asked; otherwise the
training text is read again and hashed (about a second per million pairs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mtcli.data.dedup import pair_keys
from mtcli.logs import get_logger

# Training pairs hashed at a time when the cleaner's keys are not at hand.
PAIRS_PER_BLOCK = 1 << 17

#: Asked of a cleaner that deduplicated: the mask of the keys among its kept pairs'.
Held = Callable[[np.ndarray], np.ndarray]


def _line_blocks(src: Path, tgt: Path, size: int) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """Two line-aligned text files, ``size`` lines at a time, each line without its ``\\n``."""
    with open(src, "rb") as s, open(tgt, "rb") as t:
        while src_lines := [line.removesuffix(b"\n") for line in itertools.islice(s, size)]:
            yield src_lines, [line.removesuffix(b"\n") for line in itertools.islice(t, len(src_lines))]


def eval_pair_keys(src: Path, tgt: Path) -> np.ndarray:
    """The keys of the pairs of two line-aligned evaluation texts that hold text on both sides,
    in order (a pair that is there twice, twice)."""
    keys = [pair_keys(*zip(*pairs, strict=True)) for src_lines, tgt_lines in _line_blocks(src, tgt, PAIRS_PER_BLOCK)
            if (pairs := [(s, t) for s, t in zip(src_lines, tgt_lines, strict=True) if s.strip() and t.strip()])]
    return np.concatenate([np.zeros(0, dtype=np.uint64), *keys])


def found_in_text(src: Path, tgt: Path, wanted: np.ndarray) -> np.ndarray:
    """The mask of the keys ``wanted`` that are the key of a pair of the line-aligned training
    texts ``src`` and ``tgt`` (read a block at a time)."""
    targets = np.unique(wanted)
    found = np.zeros(len(targets), dtype=bool)
    if len(targets):
        for src_lines, tgt_lines in _line_blocks(src, tgt, PAIRS_PER_BLOCK):
            keys = pair_keys(src_lines, tgt_lines)
            at = np.searchsorted(targets, keys).clip(max=len(targets) - 1)
            found[at[targets[at] == keys]] = True
    return found[np.searchsorted(targets, wanted)] if len(wanted) else np.zeros(0, dtype=bool)


def count_overlap(train_texts: tuple[Path, Path], evaluations: dict[str, tuple[Path, Path]],
                  held: Held | None = None) -> dict[str, tuple[int, int]]:
    """For each evaluation split (name: its source and target text, in a training corpus's two
    languages) that has pairs that are also training pairs (the corpus's cleaned text
    ``train_texts``; ``held`` asks its cleaner instead, when it deduplicated): how many, and
    how many pairs with text on both sides it has."""
    keys = {split: eval_pair_keys(src, tgt) for split, (src, tgt) in evaluations.items()}
    every = np.concatenate([np.zeros(0, dtype=np.uint64), *keys.values()])
    found = held(every) if held is not None else found_in_text(*train_texts, every)  # the text read once
    shared: dict[str, tuple[int, int]] = {}
    start = 0
    for split, split_keys in keys.items():
        if n := int(found[start:start + len(split_keys)].sum()):
            shared[split] = (n, len(split_keys))
        start += len(split_keys)
    return shared


#: The manifest's record of them: ``{split: {training split: {"langs", "shared", "pairs"}}}``.
Record = dict[str, dict[str, dict[str, Any]]]


def warn_of_overlap(record: Record) -> None:
    """Warn of each split, and training split, of a manifest's :data:`Record`."""
    for split, corpora in record.items():
        for train_name, counts in corpora.items():
            get_logger().warning(
                "%s: pairs that are also training pairs (of %s, source and target alike): %d of %d (%.1f%%); scores "
                "on it overstate how the model translates text it has not seen: take them out of the training data, "
                "or score on other pairs", split, train_name, counts["shared"], counts["pairs"],
                100 * counts["shared"] / counts["pairs"])


def overlap_of(record: Record, split: str, langs: tuple[str, str]) -> dict[str, dict[str, int]]:
    """What a manifest's :data:`Record` says of ``split`` in either direction between ``langs``:
    ``{training split: {"shared", "pairs"}}``."""
    return {train_name: {"shared": int(counts["shared"]), "pairs": int(counts["pairs"])}
            for train_name, counts in record.get(split, {}).items() if set(counts["langs"]) == set(langs)}
