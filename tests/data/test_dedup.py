"""Tests of mtcli.data.dedup: pair keys are the same in every process, and the key set (sorted
numpy runs) remembers every key across its merges and bitmaps."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mtcli.data.dedup import SortedKeySet, pair_keys


def _check_remembers_every_key(keys: SortedKeySet) -> None:
    """Batches of keys drawn with repeats, within and across, the key 0 and the largest among
    them: ``add_new`` marks exactly the first time each value is met, and ``contains`` exactly
    the values met before."""
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64, endpoint=True)
    pool[:2] = (0, 2**64 - 1)
    seen: set[int] = set()
    for size in (1, 7, 300, 5, 2000, 0, 64, 10_000, 3):
        batch = rng.choice(pool, size=size)
        expected = []
        for key in batch.tolist():
            expected.append(key not in seen)
            seen.add(key)
        assert keys.add_new(batch).tolist() == expected
        others = rng.choice(pool, size=50)  # some held, some not: contains asks and adds nothing
        assert keys.contains(others).tolist() == [key in seen for key in others.tolist()]
    assert len(keys) == len(seen)
    assert keys.add_new(np.array([2**64 - 1, 0, 12345, 12345], dtype=np.uint64)).tolist() == [
        False, False, 12345 not in seen, False]


@pytest.mark.parametrize("filter_from", [SortedKeySet.FILTER_FROM, 16, 1])
def test_sorted_key_set_remembers_every_key_across_merges(monkeypatch, filter_from: int) -> None:
    monkeypatch.setattr(SortedKeySet, "FILTER_FROM", filter_from)  # small: the bitmap is made and remade
    _check_remembers_every_key(SortedKeySet())


def test_pair_keys_are_one_per_pair_and_the_same_as_text_bytes_and_in_every_process() -> None:
    src, tgt = ["a", "b", "ab", "", "Straße", "a"], ["b", "a", "", "ab", "x", "b"]
    keys = pair_keys(src, tgt)
    assert keys.dtype == np.uint64 and len(set(keys[:5].tolist())) == 5 and keys[5] == keys[0]
    assert (pair_keys([s.encode() for s in src], [t.encode() for t in tgt]) == keys).all()
    assert len(pair_keys([], [])) == 0
    script = f"from mtcli.data.dedup import pair_keys; print(pair_keys({src!r}, {tgt!r}).tolist())"
    for seed in ("1", "2"):  # str hashing is salted per process; these keys must not be
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.strip() == str(keys.tolist())
