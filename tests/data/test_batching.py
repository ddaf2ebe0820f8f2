"""Token-budget batching, length filtering, collation and the resumable batch stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FakeArray

from mtcli.data.batching import (
    BatchStream,
    collate,
    collate_sources,
    filter_by_length,
    make_batches,
    padding_fraction,
    source_batch_tokens,
    source_batches,
)
from mtcli.device import to_device
from mtcli.errors import DataError


def random_corpus(n: int, seed: int = 0, max_len: int = 40) -> tuple[FakeArray, FakeArray]:
    rng = np.random.default_rng(seed)
    # Correlated lengths, as in real parallel text.
    src_len = rng.integers(1, max_len, n)
    tgt_len = np.clip(src_len + rng.integers(-3, 4, n), 1, max_len)
    src = [list(rng.integers(4, 50, k)) for k in src_len]
    tgt = [list(rng.integers(4, 50, k)) for k in tgt_len]
    return FakeArray(src), FakeArray(tgt)


def test_budget_respected_and_every_pair_once() -> None:
    src, tgt = random_corpus(500)
    idx = np.arange(500)
    batches = make_batches(src.lengths, tgt.lengths, idx, 200, seed=3, epoch=0)
    flat = np.sort(np.concatenate(batches))
    assert np.array_equal(flat, idx)
    for b in batches:
        width = max((src.lengths[b] + 1).max(), (tgt.lengths[b] + 1).max())
        assert len(b) * width <= 200


def test_oversized_pair_gets_its_own_batch() -> None:
    src = FakeArray([[5] * 3, [5] * 100, [5] * 4])
    tgt = FakeArray([[6] * 3, [6] * 2, [6] * 4])
    batches = make_batches(src.lengths, tgt.lengths, np.arange(3), 20, seed=1)
    assert sorted(map(len, batches)) == [1, 2]
    assert [1] in [list(b) for b in batches]


def test_deterministic_per_seed_and_epoch() -> None:
    src, tgt = random_corpus(300)
    idx = np.arange(300)
    a = make_batches(src.lengths, tgt.lengths, idx, 150, seed=7, epoch=2)
    b = make_batches(src.lengths, tgt.lengths, idx, 150, seed=7, epoch=2)
    c = make_batches(src.lengths, tgt.lengths, idx, 150, seed=7, epoch=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)) and len(a) == len(b)
    assert len(a) != len(c) or not all(np.array_equal(x, y) for x, y in zip(a, c, strict=False))


def test_sorted_pools_pad_less_than_random_batches() -> None:
    src, tgt = random_corpus(2000, max_len=60)
    idx = np.arange(2000)
    bucketed = make_batches(src.lengths, tgt.lengths, idx, 600, seed=1, pool_batches=50)
    # Same batch sizes, but random membership.
    rng = np.random.default_rng(0)
    perm = rng.permutation(idx)
    sizes = np.cumsum([len(b) for b in bucketed])[:-1]
    random_batches = np.split(perm, sizes)
    pad_sorted = padding_fraction(bucketed, src.lengths, tgt.lengths)
    pad_random = padding_fraction(random_batches, src.lengths, tgt.lengths)
    assert pad_sorted < pad_random / 2


def pair_widths(batch: np.ndarray, src: FakeArray, tgt: FakeArray) -> np.ndarray:
    """Each pair's width in a batch: the longer side, eos included."""
    return np.maximum(src.lengths[batch], tgt.lengths[batch]) + 1


def test_training_batches_come_in_shuffled_order() -> None:
    """Training sees the batches of an epoch in random order, not from the shortest to the
    longest: the widest pair of each batch is uncorrelated with the batch's position."""
    src, tgt = random_corpus(500)
    for seed in (3, 4, 5):
        batches = make_batches(src.lengths, tgt.lengths, np.arange(500), 200, seed=seed)
        widest = np.array([pair_widths(b, src, tgt).max() for b in batches])
        assert not (np.all(np.diff(widest) >= 0) or np.all(np.diff(widest) <= 0))
        rank = np.argsort(np.argsort(widest, kind="stable"))
        assert abs(np.corrcoef(np.arange(len(widest)), rank)[0, 1]) < 0.5, seed


def test_pairs_are_sorted_by_length_only_within_their_pool() -> None:
    """pool_batches bounds how far the length sort reaches: with pools of about one batch's
    worth of pairs, a batch mixes lengths as the shuffle drew them (pairs 13 pieces apart on
    average); with one pool for the epoch (the default here: 100 batches' worth of pairs is more
    than 500) a batch holds pairs of one width or two."""
    src, tgt = random_corpus(500)
    idx = np.arange(500)

    def spread(batches: list[np.ndarray]) -> float:
        return float(np.mean([np.ptp(pair_widths(b, src, tgt)) for b in batches]))

    assert spread(make_batches(src.lengths, tgt.lengths, idx, 200, seed=3, pool_batches=1)) > 8
    assert spread(make_batches(src.lengths, tgt.lengths, idx, 200, seed=3, pool_batches=2)) > 5
    assert spread(make_batches(src.lengths, tgt.lengths, idx, 200, seed=3)) < 1


def test_padding_fraction_hand_value() -> None:
    # one batch: src sizes 2,4 (with eos), tgt sizes 3,3 -> real 12, padded 2*4 + 2*3 = 14
    frac = padding_fraction([np.array([0, 1])], np.array([1, 3]), np.array([2, 2]))
    assert frac == pytest.approx(1 - 12 / 14)


def test_filter_by_length_counts_skips() -> None:
    kept, skipped = filter_by_length(np.array([3, 10, 5, 2]), np.array([3, 2, 9, 2]), 5, 5)
    assert list(kept) == [0, 3] and skipped == 2
    with pytest.raises(DataError):
        filter_by_length(np.array([1, 2]), np.array([1]), 5, 5)


def test_filter_by_length_holds_each_side_to_its_own_limit() -> None:
    """max_source_length limits the sources and max_target_length the targets (a limit is
    inclusive), whichever is the larger."""
    src, tgt = np.array([4, 8, 4, 8, 9]), np.array([8, 4, 9, 8, 4])
    kept, skipped = filter_by_length(src, tgt, 4, 8)  # sources up to 4, targets up to 8
    assert list(kept) == [0] and skipped == 4
    kept, skipped = filter_by_length(src, tgt, 8, 4)  # sources up to 8, targets up to 4
    assert list(kept) == [1] and skipped == 4


def test_a_batch_that_exactly_fills_the_budget_stays_one_batch() -> None:
    """The budget is inclusive: four pairs of width 5 (4 pieces + eos) in max_tokens 20 are one
    batch; in 19, a batch of three and one of one."""
    src = FakeArray([[5] * 4] * 4)
    tgt = FakeArray([[6] * 3, [6] * 4, [6] * 2, [6] * 4])
    for seed in (1, 2):
        assert [len(b) for b in make_batches(src.lengths, tgt.lengths, np.arange(4), 20, seed=seed)] == [4]
        assert sorted(len(b) for b in make_batches(src.lengths, tgt.lengths, np.arange(4), 19, seed=seed)) == [1, 3]
    assert [len(b) for b in source_batches([4, 4, 4, 4], 20)] == [4]


def test_no_pair_within_the_limits_names_every_setting_that_sets_them() -> None:
    """The limits may be clipped by model.max_positions (the trainer's min): the message gives
    the limits in force and the three settings, not train.* values the config does not hold."""
    src, tgt = random_corpus(50, max_len=30)
    with pytest.raises(DataError, match=r"no training pair is within 0 source and 0 target pieces \(50 skipped; "
                                        r"the limits are train.max_source_length and train.max_target_length, "
                                        r"at most model.max_positions - 1\)"):
        BatchStream(src, tgt, max_tokens=100, max_source_length=0, max_target_length=0, seed=1)
    with pytest.raises(DataError, match=r"within 1 source and 1 target pieces \(50 skipped; the limits are "
                                        r".*, and train.pack_length - 1 \(1\)\)"):  # it named only the others
        BatchStream(FakeArray([[5, 6]] * 50), FakeArray([[7, 8]] * 50), max_tokens=100, max_source_length=200,
                    max_target_length=200, seed=1, pack_length=2)


def test_collate_adds_bos_eos_pad() -> None:
    src = FakeArray([[10, 11], [12]])
    tgt = FakeArray([[20], [21, 22, 23]])
    batch = collate(src, tgt, np.array([0, 1]))
    assert batch.src.dtype == torch.int64
    assert batch.src.tolist() == [[10, 11, 3], [12, 3, 0]]
    assert batch.tgt_in.tolist() == [[2, 20, 0, 0], [2, 21, 22, 23]]
    assert batch.tgt_out.tolist() == [[20, 3, 0, 0], [21, 22, 23, 3]]
    assert batch.src_tokens == 5 and batch.tgt_tokens == 6
    assert batch.padding == pytest.approx(1 - 11 / 14)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_batch_moves_to_the_device_unchanged(device: str) -> None:
    batch = collate(FakeArray([[10, 11], [12]]), FakeArray([[20], [21, 22, 23]]), np.array([0, 1]))
    moved = batch.to(device)
    for name in ("src", "tgt_in", "tgt_out"):
        assert getattr(moved, name).device.type == device
        assert torch.equal(getattr(moved, name).cpu(), getattr(batch, name))
    assert (moved.src_tokens, moved.tgt_tokens) == (batch.src_tokens, batch.tgt_tokens)
    if device == "cpu":  # nothing is pinned for the CPU (a CPU-only build cannot pin)
        assert to_device(batch.src, device).is_pinned() is False


def test_an_update_freq_past_an_epochs_batches_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """No step spans two epochs: update_freq 100 on 16 batches an epoch made steps of 16, while
    the log said 100."""
    src, tgt = random_corpus(200, max_len=30)
    stream = BatchStream(src, tgt, max_tokens=400, max_source_length=30, max_target_length=30, seed=5,
                         update_freq=100)
    batches = len(stream.epoch_batches(0))
    assert batches < 100 and len(stream.next_group().batches) == batches
    assert (f"an epoch makes {batches} batches a process, so a step takes those {batches}, not "
            "train.update_freq=100") in caplog.text
    caplog.clear()
    BatchStream(src, tgt, max_tokens=400, max_source_length=30, max_target_length=30, seed=5, update_freq=batches)
    assert "update_freq" not in caplog.text


def test_stream_skips_long_pairs_and_resumes_exactly() -> None:
    src, tgt = random_corpus(400, max_len=30)
    kwargs = dict(max_tokens=120, max_source_length=25, max_target_length=25, seed=5, update_freq=2)
    stream = BatchStream(src, tgt, **kwargs)
    assert stream.skipped == int(((src.lengths > 25) | (tgt.lengths > 25)).sum()) > 0
    groups = [stream.next_group() for _ in range(40)]
    assert any(g.epoch == 1 for g in groups)  # crossed an epoch
    # every kept pair appears exactly once in epoch 0
    epoch0 = np.sort(np.concatenate([b for g in groups if g.epoch == 0 for b in g.batches]))
    assert np.array_equal(epoch0, stream.indices)
    # restart from a saved position reproduces the rest
    replay = BatchStream(src, tgt, **kwargs)
    for _ in range(17):
        replay.next_group()
    state = replay.state_dict()
    resumed = BatchStream(src, tgt, **kwargs)
    resumed.load_state_dict(state)
    for g in groups[17:]:
        r = resumed.next_group()
        assert (r.epoch, r.start) == (g.epoch, g.start)
        assert all(np.array_equal(x, y) for x, y in zip(r.batches, g.batches, strict=True))


def _pairs_of(batches: list, pack_length: int) -> np.ndarray:
    return np.concatenate([np.concatenate(b) if pack_length else b for b in batches])


def _rest_of_epoch(stream: BatchStream) -> list:
    epoch, rest = stream.epoch, []
    while stream.epoch == epoch:
        rest.extend(stream.next_group().batches)
    return rest


@pytest.mark.parametrize("pack_length", [0, 32])
def test_a_resume_under_new_max_tokens_sees_each_pair_of_the_epoch_once(pack_length: int) -> None:
    """Saved with 240 tokens a batch, resumed with 120 (or 480): the epoch keeps its 7 groups
    done and batches the pairs it has not seen under the new budget, so no pair is seen twice
    and none is left out but for the last batches trimmed to a multiple of the ranks. A second
    change later in the epoch does the same, from the segments the state carries."""
    src, tgt = random_corpus(600, max_len=30)
    common = dict(max_source_length=30, max_target_length=30, seed=5, world_size=2, pack_length=pack_length)
    saved = BatchStream(src, tgt, max_tokens=240, **common)
    done = [b for _ in range(7) for b in saved.next_group().batches]
    state = saved.state_dict()
    assert (state["max_tokens"], state["epoch"], state["batch"], state["segments"]) == (240, 0, len(done), [])
    per_batch = max(len(_pairs_of([b], pack_length)) for b in saved.epoch_batches(0))
    for max_tokens in (120, 480):
        resumed = BatchStream(src, tgt, max_tokens=max_tokens, **common)
        resumed.load_state_dict(state)
        assert resumed.batch == len(done) and resumed.segments == [(240, len(done))]
        assert all(np.array_equal(_pairs_of([x], pack_length), _pairs_of([y], pack_length))
                   for x, y in zip(resumed.epoch_batches(0)[: len(done)], done, strict=True))
        for _ in range(3):
            resumed.next_group()
        again = resumed.state_dict()
        assert again["segments"] == [[240, len(done)]] and again["max_tokens"] == max_tokens
        rest = _rest_of_epoch(resumed)
        continued = BatchStream(src, tgt, max_tokens=max_tokens, **common)
        continued.load_state_dict(again)  # the same budget: the same epoch, rebuilt from the segments
        assert [_pairs_of([x], pack_length).tolist() for x in _rest_of_epoch(continued)] == [
            _pairs_of([x], pack_length).tolist() for x in rest]
        changed = BatchStream(src, tgt, max_tokens=360, **common)
        changed.load_state_dict(again)  # a second change: three budgets in one epoch
        assert changed.segments == [(240, len(done)), (max_tokens, again["batch"])]
        ends = changed.epoch_batches(0)
        seen = _pairs_of(ends[: again["batch"]] + _rest_of_epoch(changed), pack_length)
        assert len(np.unique(seen)) == len(seen)  # no pair twice
        assert set(seen.tolist()) <= set(saved.indices.tolist())
        assert len(saved.indices) - len(seen) < 2 * per_batch  # left out: the trimmed last batches
    same = BatchStream(src, tgt, max_tokens=240, **common)
    same.load_state_dict(state)
    assert same.batch == state["batch"] and same.segments == []  # the same budget: nothing rebatched


def test_two_budget_changes_in_an_epoch_of_a_mix_keep_each_draw_of_a_pair() -> None:
    """A mix that draws every pair twice an epoch: after two changes of budget, each pair is
    still seen twice (one process: no batch is trimmed). Each segment takes away its own
    batches' pairs from those not seen yet, not the earlier segments' again."""
    from mtcli.data.batching import CorpusMix

    src, tgt = random_corpus(300, max_len=30)
    common = dict(max_source_length=30, max_target_length=30, seed=5)
    stream = BatchStream(src, tgt, max_tokens=240, mix=CorpusMix([300], [2.0], seed=5), **common)
    for _ in range(5):
        stream.next_group()
    for max_tokens in (120, 360):
        state = stream.state_dict()
        stream = BatchStream(src, tgt, max_tokens=max_tokens, mix=CorpusMix([300], [2.0], seed=5), **common)
        stream.load_state_dict(state)
        for _ in range(5):
            stream.next_group()
    assert [tokens for tokens, _ in stream.segments] == [240, 120]
    seen = np.bincount(np.concatenate(stream.epoch_batches(0)), minlength=300)
    assert seen.min() == seen.max() == 2


def test_without_takes_away_as_many_copies_as_were_taken() -> None:
    from mtcli.data.batching import _without

    indices = np.array([5, 3, 5, 1, 3, 5, 7], dtype=np.int64)
    assert _without(indices, np.array([5, 3, 9], dtype=np.int64)).tolist() == [5, 1, 3, 5, 7]
    assert _without(indices, np.array([], dtype=np.int64)).tolist() == indices.tolist()


def test_stream_shards_batches_across_ranks() -> None:
    src, tgt = random_corpus(300)
    kwargs = dict(max_tokens=100, max_source_length=64, max_target_length=64, seed=2)
    streams = [BatchStream(src, tgt, world_size=2, rank=r, **kwargs) for r in range(2)]
    assert len(streams[0].epoch_batches(0)) % 2 == 0
    whole = len(BatchStream(src, tgt, **kwargs).epoch_batches(0))  # one process: none left out
    assert streams[0].left_out == whole - len(streams[0].epoch_batches(0)) == whole % 2  # (train logs it)
    g0, g1 = streams[0].next_group(), streams[1].next_group()
    assert len(g0.batches) == 2
    assert np.array_equal(g0.mine()[0], g0.batches[0])
    assert np.array_equal(g1.mine()[0], g0.batches[1])
    total = g0.target_tokens(tgt.lengths)
    assert total == sum(int(tgt.lengths[b].sum()) + len(b) for b in g0.batches)


def test_stream_refuses_when_everything_is_too_long() -> None:
    src, tgt = random_corpus(10)
    with pytest.raises(DataError, match="max_source_length"):
        BatchStream(src, tgt, max_tokens=100, max_source_length=0, max_target_length=0, seed=1)


def test_stream_resegments_every_epoch_and_resumes_exactly() -> None:
    """With ``resegment``, each epoch batches that epoch's pairs (new lengths, new filter)."""
    calls: list[int] = []

    def resegment(epoch: int) -> tuple[FakeArray, FakeArray]:
        calls.append(epoch)
        return random_corpus(200, seed=100 + epoch, max_len=30)

    kwargs = dict(max_tokens=150, max_source_length=25, max_target_length=25, seed=3,
                  resegment=resegment)
    base = random_corpus(200, seed=0, max_len=30)
    stream = BatchStream(*base, **kwargs)
    groups = []
    while stream.epoch < 3:
        group = stream.next_group()
        # the collated pairs are the group's own epoch's segmentation
        batch = stream.collate(group.batches[0])
        expected_src, _ = random_corpus(200, seed=100 + group.epoch, max_len=30)
        assert batch.src[0, : expected_src.lengths[group.batches[0][0]]].tolist() == \
            expected_src[int(group.batches[0][0])].tolist()
        groups.append(group)
    for epoch in range(3):
        src, tgt = random_corpus(200, seed=100 + epoch, max_len=30)
        kept, _ = filter_by_length(src.lengths, tgt.lengths, 25, 25)
        seen = np.sort(np.concatenate([b for g in groups if g.epoch == epoch for b in g.batches]))
        assert np.array_equal(seen, kept)  # every pair kept under this epoch's lengths, once
    assert sorted(set(calls)) == [0, 1, 2]

    cut = next(i for i, g in enumerate(groups) if g.epoch == 1) + 2
    replay = BatchStream(*base, **kwargs)
    for _ in range(cut):
        replay.next_group()
    resumed = BatchStream(*base, **kwargs)
    resumed.load_state_dict(replay.state_dict())
    for g in groups[cut:]:
        r = resumed.next_group()
        assert (r.epoch, r.start) == (g.epoch, g.start)
        assert all(np.array_equal(x, y) for x, y in zip(r.batches, g.batches, strict=True))


# ----------------------------------------------------------------- decoding batches


@pytest.mark.parametrize("beam", [1, 3])
def test_source_batches_cover_all_and_respect_the_budget(beam: int) -> None:
    lengths = [5, 1, 30, 7, 7, 2, 90, 3, 12, 4] * 7
    budget = 200
    batches = source_batches(lengths, budget, beam)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for batch in batches:
        width = max(lengths[i] for i in batch) + 1
        assert source_batch_tokens([lengths[i] for i in batch], beam) == width * len(batch) * beam
        assert len(batch) == 1 or width * len(batch) * beam <= budget
    # Longest first, so batches are length-homogeneous.
    firsts = [max(lengths[i] for i in b) for b in batches]
    assert firsts == sorted(firsts, reverse=True)


def test_collate_sources_appends_eos_and_pads() -> None:
    batch = collate_sources([[5, 6, 7], [9]], "cpu")
    assert batch.tolist() == [[5, 6, 7, 3], [9, 3, 0, 0]]


def test_a_one_process_position_resumed_on_two_gives_each_rank_a_batch_of_every_group() -> None:
    """Saved by one process after an odd number of batches, resumed by two: the rest of the
    epoch is batched anew in an even count, so no group leaves a rank without a batch (which
    would hang the ranks in different collectives), and no pair of the epoch is seen twice."""
    src, tgt = random_corpus(400, max_len=30)
    common = dict(max_tokens=200, max_source_length=30, max_target_length=30, seed=4)
    alone = BatchStream(src, tgt, **common)
    done = [b for _ in range(3) for b in alone.next_group().batches]
    state = alone.state_dict()
    assert state["batch"] == 3
    ranks = [BatchStream(src, tgt, world_size=2, rank=r, **common) for r in range(2)]
    for stream in ranks:
        stream.load_state_dict(state)
    rest = []
    while ranks[0].epoch == 0:
        groups = [stream.next_group() for stream in ranks]
        assert all(len(group.mine()) >= 1 for group in groups)
        rest += groups[0].batches
    assert ranks[1].epoch == 1
    seen = np.concatenate(done + rest)
    assert len(np.unique(seen)) == len(seen)


def test_positions_moved_across_one_two_and_three_processes_stay_shared_and_exact() -> None:
    """1 -> 2 -> 3 processes: each resume's batches are counted from where the epoch was last
    batched anew, so every rank still gets a batch of every group; and a resume with nothing
    changed after that goes on exactly as the run would have."""
    src, tgt = random_corpus(600, max_len=30)
    common = dict(max_tokens=200, max_source_length=30, max_target_length=30, seed=4)
    stream = BatchStream(src, tgt, **common)
    for _ in range(5):
        stream.next_group()
    state = stream.state_dict()
    for world, groups in ((2, 2), (3, None)):
        ranks = [BatchStream(src, tgt, world_size=world, rank=r, **common) for r in range(world)]
        for rank in ranks:
            rank.load_state_dict(state)
        while ranks[0].epoch == 0 and (groups is None or groups > 0):
            assert all(len(rank.next_group().mine()) >= 1 for rank in ranks)
            groups = None if groups is None else groups - 1
        state = ranks[0].state_dict()
        if groups is None:
            break
        resumed = BatchStream(src, tgt, world_size=world, rank=0, **common)
        resumed.load_state_dict(state)  # the same processes and budget: exact
        assert resumed.segments == ranks[0].segments
        assert [list(b) for b in resumed.epoch_batches(0)] == [list(b) for b in ranks[0].epoch_batches(0)]


def test_corpus_weights_that_draw_no_pair_name_the_weights() -> None:
    """Weights of 0.0001 drew no pair: the error said to lower train.max_tokens, which cannot help."""
    from mtcli.data.batching import CorpusMix

    src, tgt = random_corpus(300, max_len=30)
    with pytest.raises(DataError, match=r"corpus weights \(data.sources\[\].weight\) draw no training pair"):
        BatchStream(src, tgt, max_tokens=240, max_source_length=30, max_target_length=30, seed=5,
                    mix=CorpusMix([300], [0.0001], seed=5))
