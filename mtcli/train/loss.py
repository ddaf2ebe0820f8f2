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
The gradient has the closed form ``dL/dx_k = p(k) - q'(k)``, which the forward writes into one
``[tokens, V]`` buffer, block by block of rows while they are in cache. Autograd through
``log_softmax`` + ``nll_loss`` would instead
build a zero-filled one-hot gradient, add the smoothing gradient to it and run
``log_softmax``'s backward: several more passes over the largest activation of the model.
The unsmoothed NLL we report comes out of the same forward.

Under ``torch.compile`` (``train.compile``) the same sums are written as plain tensor
operations instead (:func:`smoothed_cross_entropy_traced`): the compiler fuses the reductions
and their backward into a few kernels of its own, which the hand-written sweep would only hide
from it.
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


#: Rows of logits processed together: about 4 MiB of float32, so each block's passes (max, exp,
#: sum, scale) run on cached data rather than streaming the whole [N, V] tensor once per pass,
#: while blocks stay large enough that per-op overhead is small (docs/performance.md).
BLOCK_BYTES = 1 << 22

#: The same on a GPU, where a block's passes are kernel launches and the cache argument does not
#: hold: 4 MiB would be 28 rows of a 37k vocabulary, over a thousand launches for one batch's
#: loss. Up to 2 GiB of float32 rows go at once, which is every row of any usual batch.
GPU_BLOCK_BYTES = 1 << 31

#: Floor for the argument of every ``exp`` here. torch's float32 ``exp`` on a CPU leaves its
#: vectorised path for arguments below about -87 (where ``exp`` leaves float32's normal range)
#: and runs many times slower on them. Without label smoothing a trained model's shifted logits
#: reach there for much of the vocabulary; with smoothing 0.1 they stay above about -20.
#: ``exp(-80) = 1.8e-35``: a probability floored there changes a sum over 10^4 pieces by less
#: than 10^-30.
EXP_FLOOR = -80.0


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross entropy and NLL of ``[N, V]`` logits, with a fused backward.

    Forward: ``loss = sum_i w_i [(1 - eps)(log Z_i - x_{i,y_i}) + eps (log Z_i - mean_k x_{i,k})]``
    with ``w_i = 1`` for kept (non-pad) rows; the NLL is the same sum with ``eps = 0``.
    Gradient: ``dloss/dx_{i,k} = w_i (p_{i,k} - (1 - eps)[k == y_i] - eps / V)``.

    Both are computed in one sweep over blocks of rows in the forward, in float32 whatever the
    logits' dtype: while a block is in cache, ``p = exp(x - max) / sum`` is written straight into
    the gradient buffer (in the logits' dtype), so the logits themselves are not kept for the
    backward, which only scales that buffer by the incoming gradient, in place (the graph can be
    backpropagated once). The NLL output is not differentiable (it is reported, never
    backpropagated). Without a gradient to compute (validation), only ``log Z`` is.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, weight: Tensor,  # type: ignore[override]
                epsilon: float) -> tuple[Tensor, Tensor]:
        n, vocab = logits.shape
        need_grad = bool(ctx.needs_input_grad[0])
        log_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean = torch.empty(n, dtype=torch.float32, device=logits.device) if epsilon > 0 else None
        grad = torch.empty_like(logits) if need_grad else None
        in_place = grad is not None and grad.dtype == torch.float32  # p is built in grad itself
        rows = max(1, (GPU_BLOCK_BYTES if logits.is_cuda else BLOCK_BYTES) // (4 * vocab))
        local = torch.arange(min(rows, n), device=logits.device)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            x = logits[start:stop].float()  # a view for float32 logits, a cached copy otherwise
            top = x.amax(dim=1, keepdim=True)
            if mean is not None:
                mean[start:stop] = x.mean(dim=1)
            if in_place:
                p = torch.sub(x, top, out=grad[start:stop])
            else:
                p = x - top
            p.clamp_min_(EXP_FLOOR).exp_()
            total = p.sum(dim=1, keepdim=True)
            log_z[start:stop] = (top + total.log()).squeeze(1)
            if grad is not None:
                w = weight[start:stop].unsqueeze(1)
                p.mul_(w / total)  # w p
                if epsilon > 0:
                    p.sub_(w * (epsilon / vocab))
                p[local[: stop - start], target[start:stop]] -= weight[start:stop] * (1.0 - epsilon)
                if not in_place:
                    grad[start:stop].copy_(p)
        gold = logits.gather(1, target.unsqueeze(1)).squeeze(1).float()
        nll = ((log_z - gold) * weight).sum()
        if mean is not None:
            smooth = ((log_z - mean) * weight).sum()
            loss = (1.0 - epsilon) * nll + epsilon * smooth
        else:
            loss = nll.clone()
        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor | None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss.to(grad.dtype)), None, None, None


def smoothed_cross_entropy_traced(logits: Tensor, target: Tensor, weight: Tensor,
                                  epsilon: float) -> tuple[Tensor, Tensor]:
    """The summed label-smoothed loss and the NLL of ``[N, V]`` logits, in tensor operations that
    ``torch.compile`` fuses (its backward comes from autograd): ``log Z = logsumexp(x)``,
    ``loss = sum_i w_i [(1 - eps)(log Z_i - x_{i,y_i}) + eps (log Z_i - mean_k x_{i,k})]``.
    The NLL is detached, as the eager form's.

    The gold logit ``x_{i,y_i}`` is a masked sum over the row (``k == y_i``), not a gather: a
    gather's gradient is a scatter into a zero-filled ``[N, V]`` float32 tensor, written and read
    once more, while the mask is an index comparison the compiler folds into the one backward
    kernel that writes ``dL/dx`` (and into the forward's one pass over the row)."""
    x = logits.float()
    log_z = torch.logsumexp(x, dim=1)
    hit = torch.arange(x.size(1), device=x.device) == target.unsqueeze(1)
    nll_rows = (log_z - torch.where(hit, x, 0.0).sum(dim=1)) * weight
    loss_rows = (1.0 - epsilon) * nll_rows
    if epsilon > 0:
        loss_rows = loss_rows + epsilon * (log_z - x.mean(dim=1)) * weight
    return loss_rows.sum(), nll_rows.detach().sum()


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
        flat_logits, weight = logits.reshape(-1, vocab), keep.float()
        if torch.compiler.is_compiling():
            loss, nll = smoothed_cross_entropy_traced(flat_logits, gold, weight, self.epsilon)
        else:
            loss, nll = _SmoothedCrossEntropy.apply(flat_logits, gold, weight, self.epsilon)
        return LossOutput(loss=loss, nll=nll, count=keep.sum())

    def inputs(self, src: Tensor, tgt_in: Tensor, *layout: Tensor) -> tuple[Tensor, ...]:
        """The batch the model runs for this loss, with a packed batch's ``layout``: the batch
        itself (see :class:`~mtcli.train.rdrop.RDropLoss`)."""
        return (src, tgt_in, *layout)

    def objective(self, logits: Tensor, target: Tensor) -> tuple[Tensor, LossOutput]:
        """What training minimises (summed over the targets) and what it logs: both the
        label-smoothed loss here."""
        out = self(logits, target)
        return out.loss, out


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


__all__ = ["EXP_FLOOR", "LabelSmoothedLoss", "LossOutput", "perplexity", "reference_loss",
           "smoothed_cross_entropy_traced"]
