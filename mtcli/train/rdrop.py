"""R-Drop (Liang et al. 2021): the same batch through two dropout masks, kept consistent.

Each batch runs twice in one forward (stacked on itself, so the halves draw different dropout
masks), and the loss adds ``alpha`` times the symmetric KL divergence between the two predicted
distributions to the two label-smoothed cross entropies:

    L = 1/2 [CE(p1) + CE(p2) + alpha * D(p1, p2)],   D = 1/2 [KL(p1 || p2) + KL(p2 || p1)]

per target token. The 1/2 keeps L on the scale of one pass's loss (fairseq's ``--reg-alpha`` has
the same meaning). A step costs about twice a plain one. On with ``train.rdrop_alpha`` > 0; the
trainer sees only :class:`RDropLoss`, a :class:`~mtcli.train.loss.LabelSmoothedLoss` whose
:meth:`~RDropLoss.inputs` double the batch and whose :meth:`~RDropLoss.objective` adds the KL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mtcli.config import ModelConfig
from mtcli.train.loss import BLOCK_BYTES, EXP_FLOOR, LabelSmoothedLoss, LossOutput


def _softmax_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(log_softmax, softmax)`` of the rows of a block, as new float32 tensors, from one ``exp``
    taken at :data:`EXP_FLOOR` or above (``torch.log_softmax`` slows down like ``exp`` on peaked
    rows)."""
    shifted = x.to(torch.float32, copy=True).sub_(x.amax(dim=1, keepdim=True))
    probs = shifted.clamp_min(EXP_FLOOR).exp_()
    total = probs.sum(dim=1, keepdim=True)
    return shifted.sub_(total.log()), probs.div_(total)


class _SymmetricKL(torch.autograd.Function):
    """R-Drop's summed consistency term over the two halves of stacked ``[2N, V]`` logits, with a
    fused backward (the rows ``i`` and ``N + i`` are the same position under two dropout masks).

    Forward: ``D = 1/2 sum_i w_i sum_k (p_ik - q_ik) r_ik`` with ``r = log p - log q``.
    Gradient, with ``p = softmax(a)``, ``q = softmax(b)`` and the two KLs ``KL(p||q) = sum_k p r``,
    ``KL(q||p) = -sum_k q r`` (the softmax Jacobian, and ``sum_k (p_k - q_k) = 0``):

        dD/da_k = w/2 [p_k (r_k - KL(p||q)) + p_k - q_k]
        dD/db_k = w/2 [-q_k (r_k + KL(q||p)) + q_k - p_k]

    As in :class:`_SmoothedCrossEntropy`, one sweep over cached blocks of rows in float32 computes
    the value and writes the gradient (in the logits' dtype); the backward only scales it. Autograd
    through two ``log_softmax`` and their ``exp`` would keep five ``[N, V]`` float32 tensors and
    pass over them about twenty times (docs/performance.md).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        n, vocab = logits.size(0) // 2, logits.size(1)
        need_grad = bool(ctx.needs_input_grad[0])
        grad = torch.empty_like(logits) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        # CPU: ~5 float32 blocks live at once stay in cache. Elsewhere one block: a GPU gains
        # nothing from cache-sized blocks and would pay ~20 kernel launches for each.
        rows = max(1, BLOCK_BYTES // (4 * 4 * vocab)) if logits.device.type == "cpu" else max(n, 1)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            w = weight[start:stop].unsqueeze(1)
            log_p, p = _softmax_rows(logits[start:stop])
            log_q, q = _softmax_rows(logits[n + start:n + stop])
            r = log_p.sub_(log_q)  # log p is not needed again: r in its place
            diff = p - q
            total += (w.squeeze(1) * torch.linalg.vecdot(diff, r, dim=1)).sum()
            if grad is not None:
                kl_pq = torch.linalg.vecdot(p, r, dim=1).unsqueeze(1)
                kl_qp = -torch.linalg.vecdot(q, r, dim=1).unsqueeze(1)
                half_w = 0.5 * w
                grad_a = (r - kl_pq).mul_(p).add_(diff).mul_(half_w)
                grad[start:stop].copy_(grad_a)
                grad_b = r.add_(kl_qp).mul_(q).add_(diff).neg_().mul_(half_w)
                grad[n + start:n + stop].copy_(grad_b)
        if grad is not None:
            ctx.save_for_backward(grad)
        return 0.5 * total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_out.to(grad.dtype)), None


def symmetric_kl(logits_a: Tensor, logits_b: Tensor, keep: Tensor) -> Tensor:
    """R-Drop's consistency term (Liang et al. 2021), summed over the kept positions.

    With ``p`` and ``q`` the softmaxes of two forward passes of the same batch under different
    dropout masks, per position

        D(p, q) = 1/2 [KL(p || q) + KL(q || p)] = 1/2 sum_k (p_k - q_k)(log p_k - log q_k)

    computed in float32. ``logits_a``/``logits_b`` are [..., V]; ``keep`` (same leading shape)
    is true for the non-pad targets. Gradients flow into both passes, as in the paper.
    """
    vocab = logits_a.size(-1)
    stacked = torch.cat([logits_a.reshape(-1, vocab), logits_b.reshape(-1, vocab)])
    return _SymmetricKL.apply(stacked, keep.reshape(-1).float())


def reference_symmetric_kl(logits_a: Tensor, logits_b: Tensor, keep: Tensor) -> Tensor:
    """:func:`symmetric_kl` written with autograd through ``log_softmax``: what ``torch.compile``
    traces (the fused form loops over blocks sized from the batch, which would compile the step
    again for every shape), and what tests compare the fused form with."""
    log_p = F.log_softmax(logits_a.float(), dim=-1)
    log_q = F.log_softmax(logits_b.float(), dim=-1)
    per_position = ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1)
    return 0.5 * (per_position * keep.to(per_position.dtype)).sum()


def rdrop_loss(criterion: LabelSmoothedLoss, logits: Tensor, targets: Tensor,
               alpha: float) -> tuple[Tensor, LossOutput]:
    """R-Drop (Liang et al. 2021) from ``logits`` of the batch stacked on itself ([2B, T, V]:
    one forward, so the two halves draw different dropout masks) and its ``targets`` [B, T]:

        L = 1/2 [CE(p1) + CE(p2) + alpha * D(p1, p2)]

    per target token, with CE the label-smoothed loss and D :func:`symmetric_kl`. The 1/2 keeps
    L on the scale of one pass's loss (fairseq's ``--reg-alpha`` has the same meaning). Returns
    L summed over the targets, and the two passes' CE/NLL sums averaged (what is logged).
    """
    both = criterion(logits, torch.cat([targets, targets]))
    keep = (targets != criterion.pad_id).reshape(-1).float()
    flat = logits.reshape(-1, logits.size(-1))  # rows b*T+t: halves in order
    if torch.compiler.is_compiling():  # traced: the fused form's blocks would follow the batch's shape
        kl = reference_symmetric_kl(flat[: flat.size(0) // 2], flat[flat.size(0) // 2:], keep)
    else:
        kl = _SymmetricKL.apply(flat, keep)
    logged = LossOutput(loss=0.5 * both.loss, nll=0.5 * both.nll, count=both.count // 2)
    return 0.5 * (both.loss + alpha * kl), logged


class RDropLoss(LabelSmoothedLoss):
    """The label-smoothed loss with R-Drop's consistency term (see the module docstring).

    Called directly it is the plain label-smoothed loss (validation runs each batch once)."""

    def __init__(self, epsilon: float, alpha: float, pad_id: int = 0) -> None:
        super().__init__(epsilon, pad_id)
        if alpha <= 0:
            raise ValueError(f"R-Drop's alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)

    def inputs(self, src: Tensor, tgt_in: Tensor, *layout: Tensor) -> tuple[Tensor, ...]:
        """The batch twice, as one: ``[2B, ...]``, so the halves draw two dropout masks (a
        packed batch's rows with their layout, row for row)."""
        return tuple(torch.cat([t, t]) for t in (src, tgt_in, *layout))

    def objective(self, logits: Tensor, target: Tensor) -> tuple[Tensor, LossOutput]:
        """:func:`rdrop_loss` of the doubled batch's logits and the batch's ``target``."""
        return rdrop_loss(self, logits, target, self.alpha)


def without_dropout(model: ModelConfig) -> bool:
    """Whether every dropout of ``model`` is 0: then R-Drop's two passes draw the same (no)
    mask, agree exactly, and R-Drop is the plain step at twice its cost."""
    return model.dropout == model.attention_dropout == model.activation_dropout == 0.0


__all__ = ["RDropLoss", "rdrop_loss", "reference_symmetric_kl", "symmetric_kl", "without_dropout"]
