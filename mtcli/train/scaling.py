"""fp16's loss scaling (``train.precision: fp16``, for GPUs without bf16: V100, T4).

fp16 holds numbers up to 65,504 and loses gradients below about 6e-8 to zero, so the loss is
multiplied by a scale before the backward pass and the gradients divided by it before the
update (PyTorch's :class:`torch.amp.GradScaler`, whose state every checkpoint saves). A step
whose gradients overflow at that scale is not applied: the scale is halved and the next batches
take the step again; after 2,000 steps without an overflow the scale doubles.

Around the scaler, what a run needs of it: each overflow is said (a run that drops many batches
to overflows says so), and a scale that falls below :data:`MIN_SCALE` stops the run with one
line, as fairseq's ``min_loss_scale`` does. Gradients that overflow at any scale are not large
but not finite (a bad batch, a learning rate too high); halving the scale further would only
shrink every later gradient to zero, a run that goes on without learning.
"""

from __future__ import annotations

import torch

from mtcli.errors import TrainingError
from mtcli.logs import get_logger

#: The loss scale below which a run stops (fairseq's default ``min_loss_scale``): from the start
#: at 65,536 that is 30 overflows more than clean steps have doubled it back.
MIN_SCALE = 1e-4


class LossScaler(torch.amp.GradScaler):
    """PyTorch's :class:`~torch.amp.GradScaler` (``scale``, ``unscale_``, ``state_dict`` as it
    has them) whose :meth:`checked_step` says each overflow and stops the run at :data:`MIN_SCALE`."""

    def checked_step(self, optimizer: torch.optim.Optimizer, number: int) -> bool:
        """The update through the scaler (step ``number``): True when applied; False when the
        gradients overflowed, which halves the scale (logged) and applies nothing. Raises
        :class:`TrainingError` when the scale falls below :data:`MIN_SCALE`."""
        before = self.get_scale()
        self.step(optimizer)
        self.update()
        after = self.get_scale()
        if after >= before:  # (it falls only on an overflow; it may double after a run of clean steps)
            return True
        get_logger().info("fp16 gradients overflowed at step %d: loss scale %g -> %g, the update skipped and the "
                          "step taken again with the next batches", number, before, after)
        if after < MIN_SCALE:
            raise TrainingError(
                f"fp16 loss scale {after:g} at step {number}, below {MIN_SCALE:g}: the gradients overflow at any "
                "scale, so they are not finite (a learning rate too high, or a bad batch); lower train.lr_factor, "
                "set train.clip_norm, or train in bf16 or fp32 (train.precision)")
        return False


__all__ = ["MIN_SCALE", "LossScaler"]
