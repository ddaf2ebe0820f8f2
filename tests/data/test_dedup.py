"""Tests of mtcli.data.dedup: pair keys are the same in every process, and both key sets (the
C hash table and the numpy runs) remember every key across their growth, merges and bitmaps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from mtcli.data import dedup
from mtcli.data.dedup import KeySet, SortedKeySet, key_set, pair_keys
from tests.native_cases import the_one_warning, without_compiler


def _check_remembers_every_key(keys: KeySet | SortedKeySet) -> None:
    """Batches of keys drawn with repeats, within and across, the key 0 and the largest among
    them: ``add_new`` marks exactly the first time each value is met."""
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
    assert len(keys) == len(seen)
    assert keys.add_new(np.array([2**64 - 1, 0, 12345, 12345], dtype=np.uint64)).tolist() == [
        False, False, 12345 not in seen, False]


@pytest.mark.parametrize("filter_from", [SortedKeySet.FILTER_FROM, 16, 1])
def test_sorted_key_set_remembers_every_key_across_merges(monkeypatch, filter_from: int) -> None:
    monkeypatch.setattr(SortedKeySet, "FILTER_FROM", filter_from)  # small: the bitmap is made and remade
    _check_remembers_every_key(SortedKeySet())


@pytest.mark.parametrize("first_bits", [KeySet.FIRST_BITS, 1])
def test_hash_key_set_remembers_every_key_across_growth(monkeypatch, first_bits: int) -> None:
    if not dedup.available():
        pytest.skip("no C compiler: the C dedup table cannot be built")
    monkeypatch.setattr(KeySet, "FIRST_BITS", first_bits)  # 2 slots: grown at the first batches
    _check_remembers_every_key(KeySet())


def test_hash_keys_that_share_a_home_slot_are_all_kept() -> None:
    """Keys whose home is the table's last slot probe past each other, across the table's end
    onto slots other keys call home, and stay apart."""
    if not dedup.available():
        pytest.skip("no C compiler: the C dedup table cannot be built")
    bits = KeySet.FIRST_BITS
    rng = np.random.default_rng(1)
    candidates = rng.integers(1, 2**64 - 1, size=400_000, dtype=np.uint64)
    homes = (candidates * np.uint64(0xD6E8FEB86659FD93)) >> np.uint64(64 - bits)  # as dedup.c
    last, first = candidates[homes == (1 << bits) - 1][:30], candidates[homes == 0][:30]
    assert len(last) == len(first) == 30
    keys = KeySet()
    batch = np.concatenate((last, first))
    assert keys.add_new(batch).all() and len(keys) == 60 and keys._bits == bits
    assert not keys.add_new(batch[::-1]).any() and not keys.add_new(first).any()


def test_without_a_compiler_the_numpy_key_set_is_used(monkeypatch, tmp_path, caplog) -> None:
    with without_compiler(monkeypatch, tmp_path, dedup._library), caplog.at_level(logging.WARNING, logger="mtcli"):
        assert isinstance(key_set(), SortedKeySet) and isinstance(key_set(), SortedKeySet)
        assert "dedup table unavailable" in the_one_warning(caplog)
        with pytest.raises(RuntimeError, match="not available"):
            KeySet()


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
