"""LabelSmoothedLoss against hand-computed values and the library formula."""

from __future__ import annotations

import math

import pytest
import torch

from mtcli.train.loss import LabelSmoothedLoss, perplexity, reference_loss


def test_hand_computed_value() -> None:
    # Two target positions over a vocabulary of 3; eps = 0.1.
    logits = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]])
    target = torch.tensor([[1, 2]])
    eps = 0.1
    out = LabelSmoothedLoss(eps, pad_id=99)(logits, target)
    # Position 1: log Z = log(e + e^2 + 1); the gold token is index 1.
    log_z = math.log(math.e + math.e**2 + 1.0)
    lp1 = [1.0 - log_z, 2.0 - log_z, 0.0 - log_z]
    lp2 = [-math.log(3.0)] * 3
    nll = -(lp1[1] + lp2[2])
    smooth = -(sum(lp1) + sum(lp2)) / 3
    expected = (1 - eps) * nll + eps * smooth
    assert out.tokens == 2
    assert out.nll.item() == pytest.approx(nll, rel=1e-6)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


def test_pad_positions_contribute_nothing() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    target = torch.tensor([[4, 5, 6, 0], [3, 0, 0, 0]])
    loss_fn = LabelSmoothedLoss(0.1, pad_id=0)
    out = loss_fn(logits, target)
    assert out.tokens == 4
    # Changing the logits at pad positions changes neither the loss nor their gradient share.
    changed = logits.detach().clone()
    changed[target == 0] = 100.0 * torch.randn_like(changed[target == 0])
    out2 = loss_fn(changed, target)
    assert out2.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    out.loss.backward()
    assert torch.all(logits.grad[target == 0] == 0)
    assert torch.any(logits.grad[target != 0] != 0)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_matches_library_cross_entropy(eps: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    target[0, -2:] = 0
    out = LabelSmoothedLoss(eps, pad_id=0)(logits, target)
    ref = reference_loss(logits, target, eps, pad_id=0)
    assert torch.allclose(out.loss, ref, rtol=1e-5, atol=1e-5)
    plain = reference_loss(logits, target, 0.0, pad_id=0)
    assert torch.allclose(out.nll, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_gradient_matches_autograd_through_the_library_formula(eps: float) -> None:
    # The closed-form backward (p - q') against autograd through F.cross_entropy, pads included.
    torch.manual_seed(2)
    logits = (3.0 * torch.randn(4, 6, 13)).requires_grad_()
    target = torch.randint(1, 13, (4, 6))
    target[1, 3:] = 0
    target[3, 1:] = 0
    out = LabelSmoothedLoss(eps, pad_id=0)(logits, target)
    (2.5 * out.loss).backward()
    ours = logits.grad.clone()
    logits.grad = None
    (2.5 * reference_loss(logits, target, eps, pad_id=0)).backward()
    assert torch.allclose(ours, logits.grad, rtol=1e-5, atol=1e-6)
    assert not out.nll.requires_grad


def test_pad_id_outside_the_vocabulary() -> None:
    # A pad id that is not a valid index (here 99 with V = 5) is never looked up.
    logits = torch.randn(1, 3, 5)
    target = torch.tensor([[1, 99, 2]])
    out = LabelSmoothedLoss(0.1, pad_id=99)(logits, target)
    kept = reference_loss(logits[:, [0, 2]], target[:, [0, 2]], 0.1, pad_id=99)
    assert out.tokens == 2
    assert torch.allclose(out.loss, kept, rtol=1e-5)


def test_bf16_logits_are_scored_in_float32() -> None:
    logits = torch.randn(2, 3, 9).to(torch.bfloat16)
    target = torch.tensor([[1, 2, 3], [4, 5, 0]])
    out = LabelSmoothedLoss(0.1)(logits, target)
    assert out.loss.dtype == torch.float32
    ref = reference_loss(logits.float(), target, 0.1)
    assert torch.allclose(out.loss, ref, rtol=1e-5)
    leaf = logits.clone().requires_grad_()
    LabelSmoothedLoss(0.1)(leaf, target).loss.backward()
    assert leaf.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_of_rows_give_the_same_loss_and_gradient(monkeypatch: pytest.MonkeyPatch,
                                                       dtype: torch.dtype) -> None:
    # 3 rows per block over 4 x 5 = 20 rows: six full blocks and a partial one, pads in several.
    from mtcli.train import loss as loss_module

    monkeypatch.setattr(loss_module, "BLOCK_BYTES", 3 * 4 * 17)
    torch.manual_seed(3)
    logits = (2.0 * torch.randn(4, 5, 17)).to(dtype).requires_grad_()
    target = torch.randint(1, 17, (4, 5))
    target[0, 4:] = 0
    target[2, 2:] = 0
    out = LabelSmoothedLoss(0.1, pad_id=0)(logits, target)
    (0.5 * out.loss).backward()
    ours = logits.grad.float()
    assert logits.grad.dtype == dtype
    leaf = logits.detach().float().requires_grad_()
    ref = reference_loss(leaf, target, 0.1, pad_id=0)
    (0.5 * ref).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the bf16 gradient is rounded once, at the end
    assert torch.allclose(out.loss, ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours, leaf.grad, rtol=tol, atol=tol * 0.1)
    assert torch.all(logits.grad[target == 0] == 0)


def test_without_gradient_only_the_sums_are_computed() -> None:
    # Validation runs under no_grad: the same loss and NLL, and no gradient buffer is kept.
    torch.manual_seed(4)
    logits = torch.randn(3, 4, 11)
    target = torch.randint(1, 11, (3, 4))
    with torch.no_grad():
        out = LabelSmoothedLoss(0.1)(logits, target)
    assert out.loss.grad_fn is None
    assert torch.allclose(out.loss, reference_loss(logits, target, 0.1), rtol=1e-5)


def test_perplexity() -> None:
    assert perplexity(2.0 * 10, 10) == pytest.approx(math.exp(2.0))
    assert perplexity(1.0, 0) == float("inf")
    assert math.isfinite(perplexity(1e9, 1))


def test_perplexity_of_an_untrained_model_is_not_capped_low() -> None:
    """A fresh model's NLL of about 9 nats a token (an 8000-piece vocabulary) reads as its
    perplexity, e^9 (about 8100): the cap only keeps exp() finite, far above any real loss."""
    assert perplexity(90.0, 10) == pytest.approx(math.exp(9.0))
    assert perplexity(600.0, 1) == pytest.approx(math.exp(600.0))


def test_rejects_bad_epsilon() -> None:
    with pytest.raises(ValueError):
        LabelSmoothedLoss(1.0)
