"""Label-smoothed cross entropy (Szegedy et al. 2016; "Attention Is All You Need", section 5.4).

With a vocabulary of size ``V``, a gold token ``y`` and smoothing ``eps``, the target
distribution is

    q'(k) = (1 - eps) * [k == y] + eps / V

and the loss of one target position is the cross entropy against it:

    L = -sum_k q'(k) log p(k) = (1 - eps) * NLL + eps * (1/V) * sum_k -log p(k)

where ``NLL = -log p(y)``. Padding positions (``target == pad``) contribute nothing. This is
exactly what ``torch.nn.functional.cross_entropy(..., label_smoothing=eps, ignore_index=pad)``
computes (the test checks it). Reported per token: ``loss / tokens``, ``nll / tokens`` and
perplexity ``exp(nll / tokens)``.

How it is computed. With logits ``x``, ``log p(k) = x_k - log Z`` and ``log Z = logsumexp(x)``, so

    NLL = log Z - x_y        sum_k -log p(k) / V = log Z - mean_k x_k

need only ``log Z`` and two reductions of the logits: no ``[tokens, V]`` log-probability tensor.
The gradient has the closed form ``dL/dx_k = p(k) - q'(k)``, which the backward writes into one
``[tokens, V]`` buffer in place. Autograd through ``log_softmax`` + ``nll_loss`` would instead
build a zero-filled one-hot gradient, add the smoothing gradient to it and run
``log_softmax``'s backward: several more passes over the largest activation of the model.
The unsmoothed NLL we report comes out of the same forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class LossOutput:
    """Sums over the non-pad target positions of one batch.

    ``loss`` keeps its graph (backpropagate it); ``nll`` is detached; ``count`` is the number
    of non-pad targets the sums run over, as a tensor on the logits' device (``tokens`` reads it
    as an int, which waits for the device; the trainer counts tokens on the host instead).
    """

    loss: Tensor
    nll: Tensor
    count: Tensor

    @property
    def tokens(self) -> int:
        """Non-pad target positions (a host sync on GPUs)."""
        return int(self.count.item())


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross entropy and NLL of ``[N, V]`` float logits, with a fused backward.

    Forward: ``loss = sum_i w_i [(1 - eps)(log Z_i - x_{i,y_i}) + eps (log Z_i - mean_k x_{i,k})]``
    with ``w_i = 1`` for kept (non-pad) rows; the NLL is the same sum with ``eps = 0``.
    Backward: ``dloss/dx_{i,k} = w_i (exp(x_{i,k} - log Z_i) - (1 - eps)[k == y_i] - eps / V)``.
    The NLL output is not differentiable (it is reported, never backpropagated).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, weight: Tensor,  # type: ignore[override]
                epsilon: float) -> tuple[Tensor, Tensor]:
        log_z = torch.logsumexp(logits, dim=-1)
        gold = logits.gather(1, target.unsqueeze(1)).squeeze(1)
        nll = ((log_z - gold) * weight).sum()
        if epsilon > 0.0:
            smooth = ((log_z - logits.mean(dim=-1)) * weight).sum()
            loss = (1.0 - epsilon) * nll + epsilon * smooth
        else:
            loss = nll.clone()
        ctx.save_for_backward(logits, target, weight, log_z)
        ctx.epsilon = epsilon
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor | None, None, None, None]:
        logits, target, weight, log_z = ctx.saved_tensors
        eps = ctx.epsilon
        grad = torch.sub(logits, log_z.unsqueeze(1)).exp_()  # p(k), written once
        if eps > 0.0:
            grad.sub_(eps / logits.size(1))
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, target] -= 1.0 - eps
        grad.mul_((weight * grad_loss).unsqueeze(1))
        return grad, None, None, None


class LabelSmoothedLoss(nn.Module):
    """Label-smoothed cross entropy summed over non-pad targets, plus the plain NLL sum.

    L = (1 - eps) * NLL + eps * mean_k(-log p(k)), see the module docstring.
    """

    def __init__(self, epsilon: float = 0.1, pad_id: int = 0) -> None:
        super().__init__()
        if not 0.0 <= epsilon < 1.0:
            raise ValueError(f"label smoothing must be in [0, 1), got {epsilon}")
        self.epsilon = float(epsilon)
        self.pad_id = int(pad_id)

    def forward(self, logits: Tensor, target: Tensor) -> LossOutput:
        """``logits`` [B, T, V] (any float dtype), ``target`` [B, T] int64 -> summed loss and NLL."""
        vocab = logits.size(-1)
        flat = target.reshape(-1)
        keep = flat != self.pad_id
        gold = flat.masked_fill(~keep, 0)  # any in-range index; the weight of pad rows is 0
        loss, nll = _SmoothedCrossEntropy.apply(logits.reshape(-1, vocab).float(), gold,
                                                keep.float(), self.epsilon)
        return LossOutput(loss=loss, nll=nll, count=keep.sum())


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(nll / tokens), capped to stay finite (inf only for an empty count)."""
    if tokens <= 0:
        return float("inf")
    return math.exp(min(nll_sum / tokens, 700.0))


def reference_loss(logits: Tensor, target: Tensor, epsilon: float, pad_id: int = 0) -> Tensor:
    """The library formula, ``F.cross_entropy(label_smoothing=eps, reduction='sum')`` (for tests)."""
    vocab = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(),
        target.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=epsilon,
        reduction="sum",
    )


__all__ = ["LabelSmoothedLoss", "LossOutput", "perplexity", "reference_loss"]
