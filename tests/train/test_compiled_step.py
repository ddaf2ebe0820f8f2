"""``train.compile``: the forward and loss trace as one graph, and the traced loss is the eager one."""

from __future__ import annotations

import pytest
import torch

from mtcli.config import ModelConfig
from mtcli.model import Transformer
from mtcli.train.loss import LabelSmoothedLoss, reference_loss, smoothed_cross_entropy_traced
from mtcli.train.rdrop import RDropLoss
from mtcli.train.step import forward_loss


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_traced_loss_and_gradient_match_the_library_formula(eps: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 30, requires_grad=True)
    target = torch.randint(1, 30, (12,))
    target[[2, 7]] = 0  # pad rows
    keep = target.ne(0)
    loss, nll = smoothed_cross_entropy_traced(logits, target.masked_fill(~keep, 0), keep.float(), eps)
    expected = reference_loss(logits, target, eps)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert nll.item() == pytest.approx(reference_loss(logits, target, 0.0).item(), rel=1e-5)
    assert not nll.requires_grad
    (got,) = torch.autograd.grad(loss, logits)
    (want,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rdrop", [False, True], ids=["label-smoothed", "r-drop"])
def test_forward_and_loss_trace_as_one_graph_with_the_eager_result(rdrop: bool) -> None:
    """fullgraph: a graph break (a host sync, a CPU-only kernel) would fail here. The traced run
    must give the eager loss and gradients, and a second shape must not need a new trace (R-Drop's
    fused term looped over blocks sized from the batch: a new graph for every batch)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=2, encoder_layers=1, decoder_layers=1, d_ff=64,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Transformer(cfg, 50).train()
    criterion = RDropLoss(0.1, alpha=1.0) if rdrop else LabelSmoothedLoss(0.1)
    src = torch.randint(3, 50, (4, 7))
    src[0, 5:] = 0
    tgt_in, tgt_out = torch.randint(3, 50, (4, 6)), torch.randint(3, 50, (4, 6))
    tgt_out[1, 4:] = 0
    torch._dynamo.reset()
    traced = torch.compile(forward_loss, dynamic=True, fullgraph=True, backend="eager")

    def run(fn) -> tuple[list[float], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        objective, loss, nll = fn(model, criterion, model.output_targets, "fp32", src, tgt_in, tgt_out)
        objective.backward()
        return [objective.item(), loss.item(), nll.item()], [p.grad.clone() for p in model.parameters()]

    eager_values, eager_grads = run(forward_loss)
    traced_values, traced_grads = run(traced)
    assert traced_values == pytest.approx(eager_values, rel=1e-5)
    for got, want in zip(traced_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with torch._dynamo.config.patch(error_on_recompile=True):
        traced(model, criterion, model.output_targets, "fp32", torch.randint(3, 50, (3, 9)),
               torch.randint(3, 50, (3, 5)), torch.randint(3, 50, (3, 5)))


def test_padding_lengths_to_a_multiple_leaves_the_loss_unchanged() -> None:
    """What train.compile does to each batch (Batch.padded) changes no loss and no gradient."""
    from mtcli.data.batching import collate

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=2, encoder_layers=1, decoder_layers=1, d_ff=64,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Transformer(cfg, 50).train()
    criterion = LabelSmoothedLoss(0.1)
    src = [list(range(5, 5 + n)) for n in (3, 6, 9)]
    tgt = [list(range(7, 7 + n)) for n in (4, 2, 10)]
    batch = collate(src, tgt, [0, 1, 2])
    padded = batch.padded(8)
    assert [padded.src.size(1), padded.tgt_in.size(1)] == [16, 16]
    assert (padded.src_tokens, padded.tgt_tokens) == (batch.src_tokens, batch.tgt_tokens)

    def run(b) -> tuple[list[float], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        objective, loss, nll = forward_loss(model, criterion, model.output_targets, "fp32", b.src, b.tgt_in, b.tgt_out)
        objective.backward()
        return [objective.item(), nll.item()], [p.grad.clone() for p in model.parameters()]

    (values, grads), (padded_values, padded_grads) = run(batch), run(padded)
    assert padded_values == pytest.approx(values, rel=1e-5)
    for got, want in zip(padded_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("changes", "device", "world", "expected"), [
    ({}, "cuda", 1, True),
    ({"update_freq": 2}, "cuda", 1, False),  # an accumulated gradient would outlive its replay
    ({}, "cuda", 2, False),  # DDP's hooks under graphs: not tried
    ({}, "cpu", 1, False),
    ({"pack_length": 0}, "cuda", 1, False),  # token batches change shape every step
], ids=["packed-one-gpu", "accumulation", "ddp", "cpu", "token-batches"])
def test_cuda_graphs_only_where_no_gradient_outlives_a_replay(changes: dict, device: str, world: int,
                                                              expected: bool) -> None:
    from dataclasses import replace

    from mtcli.config import TrainConfig
    from mtcli.train.step import cuda_graphs

    cfg = replace(TrainConfig(), **{"pack_length": 128, "update_freq": 1, **changes})
    assert cuda_graphs(cfg, torch.device(device), world) is expected
