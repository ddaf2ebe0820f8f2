"""Label-smoothed cross entropy (Szegedy et al. 2016; "Attention Is All You Need", section 5.4).

With a vocabulary of size ``V``, a gold token ``y`` and smoothing ``eps``, the target
distribution is

    q'(k) = (1 - eps) * [k == y] + eps / V

and the loss of one target position is the cross entropy against it:

    L = -sum_k q'(k) log p(k) = (1 - eps) * NLL + eps * (1/V) * sum_k -log p(k)

where ``NLL = -log p(y)``. Padding positions (``target == pad``) contribute nothing. This is
exactly what ``torch.nn.functional.cross_entropy(..., label_smoothing=eps, ignore_index=pad)``
computes (the test checks it); we compute it from one ``log_softmax`` so that the unsmoothed NLL
we report comes for free instead of costing a second pass over the ``[tokens, V]`` logits.
Reported per token: ``loss / tokens``, ``nll / tokens`` and perplexity ``exp(nll / tokens)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        lprobs = F.log_softmax(logits.reshape(-1, vocab).float(), dim=-1)
        flat = target.reshape(-1)
        keep = flat != self.pad_id
        nll = F.nll_loss(lprobs, flat, ignore_index=self.pad_id, reduction="sum")
        if self.epsilon > 0.0:
            smooth = -(lprobs.sum(dim=-1) * keep).sum() / vocab
            loss = (1.0 - self.epsilon) * nll + self.epsilon * smooth
        else:
            loss = nll
        return LossOutput(loss=loss, nll=nll.detach(), count=keep.sum())


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
