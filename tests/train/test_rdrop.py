"""R-Drop: the fused symmetric KL against autograd, and the loss the trainer minimises with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcli.train.loss import LabelSmoothedLoss, reference_loss
from mtcli.train.rdrop import RDropLoss, rdrop_loss, reference_symmetric_kl, symmetric_kl


def test_symmetric_kl_is_the_mean_of_both_kl_directions_over_kept_positions() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    log_p, log_q = a.log_softmax(-1), b.log_softmax(-1)
    kl_pq = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # KL(p || q)
    kl_qp = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    expected = (0.5 * (kl_pq + kl_qp))[keep].sum()
    assert symmetric_kl(a, b, keep) == pytest.approx(float(expected), rel=1e-5)
    assert float(symmetric_kl(a, a.clone(), keep)) == pytest.approx(0.0, abs=1e-6)
    b_pad = b.clone()
    b_pad[0, 3:] += 100.0  # padded positions do not count
    assert symmetric_kl(a, b_pad, keep) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_symmetric_kl_gradient_matches_autograd_in_blocks(monkeypatch: pytest.MonkeyPatch,
                                                          dtype: torch.dtype) -> None:
    # The closed-form gradient against autograd through log_softmax, over blocks of 1 row
    # (6 x 4 = 24 rows a side), with pads; the logits keep their dtype for the gradient.
    from mtcli.train import rdrop as rdrop_module

    monkeypatch.setattr(rdrop_module, "BLOCK_BYTES", 4 * 4 * 13)
    torch.manual_seed(5)
    a = (3.0 * torch.randn(6, 4, 13)).to(dtype).requires_grad_()
    b = (3.0 * torch.randn(6, 4, 13)).to(dtype).requires_grad_()
    keep = torch.rand(6, 4) > 0.3
    value = symmetric_kl(a, b, keep)
    (1.7 * value).backward()
    ref_a, ref_b = (x.detach().double().requires_grad_() for x in (a, b))
    ref = reference_symmetric_kl(ref_a, ref_b, keep)
    (1.7 * ref).backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert a.grad.dtype == b.grad.dtype == dtype
    assert value.detach().item() == pytest.approx(ref.detach().item(), rel=1e-5)
    assert torch.allclose(a.grad.double(), ref_a.grad, rtol=tol, atol=tol * 0.1)
    assert torch.allclose(b.grad.double(), ref_b.grad, rtol=tol, atol=tol * 0.1)
    assert torch.all(a.grad[~keep] == 0) and torch.all(b.grad[~keep] == 0)


def test_rdrop_loss_is_half_both_passes_cross_entropy_plus_alpha_kl() -> None:
    torch.manual_seed(6)
    logits = torch.randn(6, 5, 11, dtype=torch.float64, requires_grad=True)  # two halves of 3
    target = torch.randint(1, 11, (3, 5))
    target[1, 3:] = 0
    criterion = LabelSmoothedLoss(0.1, pad_id=0)
    loss, logged = rdrop_loss(criterion, logits, target, alpha=5.0)
    loss.backward()
    leaf = logits.detach().requires_grad_()
    first, second = leaf.chunk(2)
    ref = 0.5 * (reference_loss(first, target, 0.1) + reference_loss(second, target, 0.1)
                 + 5.0 * reference_symmetric_kl(first, second, target != 0))
    ref.backward()
    assert loss.detach().item() == pytest.approx(ref.detach().item(), rel=1e-6)
    assert torch.allclose(logits.grad, leaf.grad, rtol=1e-5, atol=1e-6)  # summed in float32
    assert int(logged.count) == int((target != 0).sum())


def test_symmetric_kl_without_gradient_keeps_no_buffer() -> None:
    torch.manual_seed(7)
    a, b = torch.randn(2, 3, 9), torch.randn(2, 3, 9)
    keep = torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        value = symmetric_kl(a, b, keep)
    assert value.grad_fn is None
    assert float(value) == pytest.approx(float(reference_symmetric_kl(a, b, keep)), rel=1e-5)


def test_peaked_logits_give_the_exact_losses_and_gradients() -> None:
    # Rows whose log-probabilities reach far below EXP_FLOOR (where exp is floored for speed):
    # the losses and gradients still match the autograd formulas.
    from mtcli.train.loss import EXP_FLOOR

    torch.manual_seed(8)
    logits = (60.0 * torch.randn(2, 4, 31)).requires_grad_()
    target = torch.randint(1, 31, (1, 4))
    assert float((logits - logits.amax(-1, keepdim=True)).min().detach()) < 2 * EXP_FLOOR
    loss, _ = rdrop_loss(LabelSmoothedLoss(0.1), logits, target, alpha=5.0)
    loss.backward()
    leaf = logits.detach().double().requires_grad_()
    first, second = leaf.chunk(2)
    ref = 0.5 * (reference_loss(first, target, 0.1) + reference_loss(second, target, 0.1)
                 + 5.0 * reference_symmetric_kl(first, second, target != 0))
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert torch.allclose(logits.grad.double(), leaf.grad, rtol=1e-5, atol=1e-6)


def test_rdrop_criterion_doubles_the_batch_and_minimises_rdrop_loss() -> None:
    """What the trainer sees: ``inputs`` stacks the batch on itself, ``objective`` is
    :func:`rdrop_loss`, and a plain call is the label-smoothed loss (validation)."""
    torch.manual_seed(9)
    criterion = RDropLoss(0.1, alpha=5.0)
    src, tgt_in = torch.randint(4, 11, (3, 6)), torch.randint(4, 11, (3, 5))
    two_src, two_tgt, two_segments = criterion.inputs(src, tgt_in, src.ne(0).long())  # a packed layout too
    assert torch.equal(two_src, torch.cat([src, src])) and torch.equal(two_tgt, torch.cat([tgt_in, tgt_in]))
    assert torch.equal(two_segments, torch.cat([src.ne(0).long()] * 2))
    logits = torch.randn(6, 5, 11)
    target = torch.randint(1, 11, (3, 5))
    loss, logged = criterion.objective(logits, target)
    ref_loss, ref_logged = rdrop_loss(LabelSmoothedLoss(0.1), logits, target, 5.0)
    assert float(loss.detach()) == float(ref_loss.detach()) and float(logged.loss.detach()) == float(ref_logged.loss.detach())
    assert float(criterion(logits[:3], target).loss.detach()) == float(
        LabelSmoothedLoss(0.1)(logits[:3], target).loss.detach())
    with pytest.raises(ValueError, match="alpha"):
        RDropLoss(0.1, alpha=0.0)
