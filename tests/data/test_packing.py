"""Packed rows: every pair once, within the row length on both sides, and the model gives a
packed pair exactly what it gives the pair alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FakeArray

from mtcli.config import ModelConfig
from mtcli.data.batching import collate
from mtcli.data.packing import PackedBatch, collate_packed, pack_rows
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.model import Transformer
from mtcli.train.loss import LabelSmoothedLoss


def random_pairs(n: int, seed: int, vocab: int = 50, longest: int = 20) -> tuple[FakeArray, FakeArray]:
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, vocab, rng.integers(1, longest)).tolist() for _ in range(n)]
    tgt = [rng.integers(4, vocab, rng.integers(1, longest)).tolist() for _ in range(n)]
    return FakeArray(src), FakeArray(tgt)


def tiny_model(dropout: float = 0.0, **changes: object) -> Transformer:
    """A small seeded Transformer (50 ids, rows up to 64 slots) for the packed-batch tests."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{"d_model": 32, "n_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "d_ff": 64,
                         "dropout": dropout, "attention_dropout": 0.0, "max_positions": 64, **changes})
    return Transformer(cfg, 50)


def layout(batch: PackedBatch) -> tuple[torch.Tensor, ...]:
    """A packed batch's segments and positions, as :meth:`Transformer.forward_packed` takes them."""
    return batch.src_segments, batch.tgt_segments, batch.src_positions, batch.tgt_positions


def test_rows_hold_every_pair_once_within_the_length_and_pack_full() -> None:
    src, tgt = random_pairs(2000, seed=1, longest=40)
    order = np.random.default_rng(2).permutation(len(src))
    rows = pack_rows(src.lengths, tgt.lengths, order, 128)
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(src)))
    rank = np.argsort(order)  # a row's pairs keep the order they were taken in
    assert all((np.diff(rank[row]) > 0).all() for row in rows)
    used_src = [int((src.lengths[r] + 1).sum()) for r in rows]
    used_tgt = [int((tgt.lengths[r] + 1).sum()) for r in rows]
    assert max(used_src) <= 128 and max(used_tgt) <= 128
    fill = sum(max(a, b) for a, b in zip(used_src, used_tgt, strict=True)) / (128 * len(rows))
    assert fill > 0.9, fill
    with pytest.raises(ValueError, match="filter pairs longer than 9 pieces"):
        pack_rows(src.lengths, tgt.lengths, order, 10)


def test_collate_lays_pairs_end_to_end_with_segments_and_positions() -> None:
    src, tgt = FakeArray([[10, 11], [12], [13, 14, 15]]), FakeArray([[20], [21, 22], [23]])
    batch = collate_packed(src, tgt, [np.array([0, 1]), np.array([2])], n_rows=3, length=6)
    assert batch.src.tolist() == [[10, 11, EOS_ID, 12, EOS_ID, PAD_ID], [13, 14, 15, EOS_ID, 0, 0], [0] * 6]
    assert batch.tgt_in.tolist() == [[BOS_ID, 20, BOS_ID, 21, 22, 0], [BOS_ID, 23, 0, 0, 0, 0], [0] * 6]
    assert batch.tgt_out.tolist() == [[20, EOS_ID, 21, 22, EOS_ID, 0], [23, EOS_ID, 0, 0, 0, 0], [0] * 6]
    assert batch.src_segments.tolist()[0] == [1, 1, 1, 2, 2, 0]
    assert batch.tgt_positions.tolist()[0] == [0, 1, 0, 1, 2, 0]
    assert (batch.src_tokens, batch.tgt_tokens) == (9, 7)
    assert batch.padding == pytest.approx(1 - 16 / 36)
    with pytest.raises(ValueError, match="3 rows do not fit a batch of 2"):
        collate_packed(src, tgt, [np.array([0]), np.array([1]), np.array([2])], n_rows=2, length=6)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_a_packed_pair_gets_the_logits_and_loss_it_gets_alone(pre_norm: bool) -> None:
    model = tiny_model(n_heads=4, encoder_layers=2, decoder_layers=2, pre_norm=pre_norm).eval()
    src, tgt = random_pairs(12, seed=3, longest=12)
    rows = pack_rows(src.lengths, tgt.lengths, np.arange(12), 32)
    assert any(len(r) > 1 for r in rows)
    packed = collate_packed(src, tgt, rows, n_rows=len(rows) + 1, length=32)  # and one empty row
    with torch.no_grad():
        logits = model.forward_packed(packed.src, packed.tgt_in, *layout(packed))
        assert torch.isfinite(logits).all()  # padding, and a row of nothing but padding, included
        for r, row in enumerate(rows):
            for segment, pair in enumerate(row.tolist(), start=1):
                alone = collate(src, tgt, np.array([pair]))
                expected = model(alone.src, alone.tgt_in)[0]
                slots = packed.tgt_segments[r] == segment
                torch.testing.assert_close(logits[r, slots], expected, atol=1e-5, rtol=1e-5)
        criterion = LabelSmoothedLoss(0.1)
        whole = collate(src, tgt, np.arange(12))
        unpacked = criterion(model(whole.src, whole.tgt_in), whole.tgt_out)
        repacked = criterion(logits, packed.tgt_out)
    torch.testing.assert_close(repacked.loss, unpacked.loss, atol=1e-4, rtol=1e-5)
    assert int(repacked.count) == int(unpacked.count) == packed.tgt_tokens


def test_the_packed_forward_traces_as_one_graph() -> None:
    """fullgraph: what a compiled, CUDA-graphed packed step needs (no host sync, no break)."""
    model = tiny_model(dropout=0.1).train()
    src, tgt = random_pairs(8, seed=4, longest=10)
    batch = collate_packed(src, tgt, pack_rows(src.lengths, tgt.lengths, np.arange(8), 24), n_rows=6, length=24)
    criterion = LabelSmoothedLoss(0.1)

    def step(*tensors: torch.Tensor) -> torch.Tensor:
        logits = model.forward_packed(tensors[0], tensors[1], *tensors[3:])
        return criterion(logits, tensors[2]).loss

    torch._dynamo.reset()
    traced = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    loss = traced(batch.src, batch.tgt_in, batch.tgt_out, *layout(batch))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_packed_stream_reads_every_pair_once_an_epoch_in_one_shape() -> None:
    from mtcli.data.batching import BatchStream

    src, tgt = random_pairs(300, seed=5, longest=40)
    stream = BatchStream(src, tgt, max_tokens=256, max_source_length=100, max_target_length=100, seed=1,
                         pack_length=32, update_freq=2)
    kept = np.flatnonzero(np.maximum(src.lengths, tgt.lengths) <= 31)
    assert stream.skipped == 300 - len(kept) > 0  # longer than a row
    batches = stream.epoch_batches(0)
    assert sorted(np.concatenate([np.concatenate(b) for b in batches]).tolist()) == kept.tolist()
    group = stream.next_group()
    assert len(group.batches) == 2
    shapes = {tuple(stream.collate(b).src.shape) for b in batches}
    assert shapes == {(8, 32)}
    assert group.target_tokens(stream.tgt_lengths) == sum(stream.collate(b).tgt_tokens for b in group.batches)
    assert 0 < stream.padding_fraction(0) < 0.3
    again = BatchStream(src, tgt, max_tokens=256, max_source_length=100, max_target_length=100, seed=1,
                        pack_length=32, update_freq=2)
    assert [np.concatenate(b).tolist() for b in again.epoch_batches(1)] == \
        [np.concatenate(b).tolist() for b in stream.epoch_batches(1)]
    assert [np.concatenate(b).tolist() for b in stream.epoch_batches(1)] != \
        [np.concatenate(b).tolist() for b in batches]


def test_rdrop_on_a_packed_batch_is_rdrop_on_its_pairs() -> None:
    """R-Drop stacks a packed batch on itself with its layout; without dropout the two halves
    agree, and the loss is the token batch's."""
    from mtcli.train.rdrop import RDropLoss
    from mtcli.train.step import forward_loss

    model = tiny_model().train()
    src, tgt = random_pairs(10, seed=5, longest=10)
    packed = collate_packed(src, tgt, pack_rows(src.lengths, tgt.lengths, np.arange(10), 32), n_rows=5, length=32)
    whole = collate(src, tgt, np.arange(10))
    criterion = RDropLoss(0.1, alpha=5.0)
    got = forward_loss(model, criterion, model.output_targets, "fp32", packed.src, packed.tgt_in, packed.tgt_out,
                       *layout(packed))
    want = forward_loss(model, criterion, model.output_targets, "fp32", whole.src, whole.tgt_in, whole.tgt_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-4, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_masks_keep_packed_pairs_apart_as_the_mask_tensors_do() -> None:
    """FlexAttention's block masks (the GPU experiment) give the logits of the mask tensors;
    a CPU has no FlexAttention backward, so this checks the forward."""
    model = tiny_model(n_heads=4, encoder_layers=2, decoder_layers=2).eval()
    src, tgt = random_pairs(12, seed=6, longest=12)
    packed = collate_packed(src, tgt, pack_rows(src.lengths, tgt.lengths, np.arange(12), 32), n_rows=8, length=32)
    args = (packed.src, packed.tgt_in, *layout(packed))
    with torch.no_grad():
        expected = model.forward_packed(*args)
        model.flex_packed = True
        got = model.forward_packed(*args)
    real = packed.tgt_segments > 0  # padding slots are never scored
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replayed_cuda_graphs_draw_fresh_dropout_masks() -> None:
    """The WMT14 recipe's step (packed, compiled, replayed as a CUDA graph) must drop out anew at
    every replay, as the eager step does: a mask frozen into the graph would train a model that
    fits its training data faster and generalises worse. The same batch through the replayed
    step gives a different loss each time, with the spread of eager's (numerical noise alone
    would spread far less)."""
    from mtcli.train.step import compile_forward_loss, forward_loss

    src, tgt = random_pairs(64, seed=7, longest=20)
    batch = collate_packed(src, tgt, pack_rows(src.lengths, tgt.lengths, np.arange(64), 64), n_rows=32, length=64)
    tensors = [t.cuda() for t in (batch.src, batch.tgt_in, batch.tgt_out, *layout(batch))]
    criterion = LabelSmoothedLoss(0.1)

    def losses(step, model: Transformer, n: int = 8) -> list[float]:
        out = []
        for _ in range(n):
            objective, loss, _ = step(model, criterion, model.output_targets, "bf16", *tensors)
            objective.backward()  # as the trainer runs it: the backward is part of the graph
            out.append(loss.item())
            # as the trainer's update ends: the next replay overwrites these gradients, and a
            # backward adding to them would read what it overwrote (PyTorch refuses it)
            model.zero_grad(set_to_none=True)
        return out

    model = tiny_model(dropout=0.3).cuda().train()
    torch._dynamo.reset()
    replayed = losses(compile_forward_loss(one_shape=True, graphs=True), model)
    eager = losses(forward_loss, model)
    assert len(set(replayed)) == len(replayed), replayed
    assert np.std(replayed) > 0.25 * np.std(eager) > 0, (replayed, eager)
    assert abs(np.mean(replayed) - np.mean(eager)) < 4 * np.std(eager) + 0.02, (replayed, eager)
