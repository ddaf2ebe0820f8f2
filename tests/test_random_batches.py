"""bench/random_batches.py: token batches that are random samples of the corpus (the loss curves'
``random`` mode), against the length-sorted batches of mtcli.data.batching."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bench_script

from mtcli.data.batching import make_batches


@pytest.fixture(scope="module")
def random_batches():
    return bench_script("random_batches").random_batches


@pytest.fixture(scope="module")
def lengths() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, size=3000)
    return src, np.clip(src + rng.integers(-5, 6, size=3000), 1, None)


def test_every_pair_once_within_the_budget(random_batches, lengths) -> None:
    src, tgt = lengths
    indices = np.arange(5, 3000, dtype=np.int64)  # a filtered subset: batches hold these indices
    batches = random_batches(src, tgt, indices, 700, seed=3, epoch=1)
    assert sorted(np.concatenate(batches).tolist()) == indices.tolist()
    width = np.maximum(src, tgt) + 1
    assert all(width[b].sum() <= 700 for b in batches)
    # greedy: the next pair would not have fitted
    assert all(width[b].sum() + width[n[0]] > 700 for b, n in zip(batches, batches[1:], strict=False))


def test_seeded_by_seed_and_epoch(random_batches, lengths) -> None:
    src, tgt = lengths
    indices = np.arange(3000, dtype=np.int64)

    def listed(**kw):
        return [b.tolist() for b in random_batches(src, tgt, indices, 700, **kw)]

    assert listed(seed=1, epoch=0) == listed(seed=1, epoch=0)
    assert listed(seed=1, epoch=0) != listed(seed=1, epoch=1)
    assert listed(seed=1, epoch=0) != listed(seed=2, epoch=0)
    assert np.concatenate(random_batches(src, tgt, indices, 700, shuffle=False)).tolist() == indices.tolist()


def test_batches_mix_lengths_where_token_batches_slice_them(random_batches, lengths) -> None:
    """What the mode is for: a random batch's lengths spread as the corpus's do, a token batch's
    hardly at all, with about as many pairs a batch."""
    src, tgt = lengths
    indices = np.arange(3000, dtype=np.int64)
    mixed = random_batches(src, tgt, indices, 700, seed=1)
    sliced = make_batches(src, tgt, indices, 700, seed=1)
    spread_mixed = np.mean([tgt[b].std() for b in mixed if len(b) > 1])
    spread_sliced = np.mean([tgt[b].std() for b in sliced if len(b) > 1])
    assert spread_mixed > 0.8 * tgt.std() > 5 * spread_sliced
    assert 0.6 < len(mixed) / len(sliced) < 1.4
