"""The optimiser and the learning-rate schedule of "Attention Is All You Need" (section 5.3).

Noam schedule, with ``step`` counted from 1 (the first update uses step 1):

    lr(step) = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

It rises linearly for ``warmup`` steps, peaks at ``step == warmup`` with
``factor * (d_model * warmup)^-0.5`` and then decays with the inverse square root of the step.

Optional cool-down (``train.cooldown_steps``, an extension, not in the paper): over the last
``cooldown`` of ``max_steps`` updates the rate is also multiplied by the share of the cool-down
left, lr = noam_lr(step) * min(1, (max_steps - step + 1) / cooldown) for the update numbered
``step``, so it falls linearly to 1/cooldown of Noam's at the last update. The last checkpoints,
which ``make reproduce`` averages, then sit at a low rate instead of mid-decay.
The optimiser is Adam(beta1=0.9, beta2=0.98, eps=1e-9) as in the paper (values from the config),
or AdamW when ``train.weight_decay > 0`` (decoupled weight decay:
    theta <- theta - lr * (adam_update + weight_decay * theta)),
applied to every parameter, LayerNorm gains and biases included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mtcli.config import TrainConfig


def cooldown_scale(done: float, budget: float, cooldown: float) -> float:
    """min(1, (budget - done) / cooldown), clamped to [0, 1]; 1 when ``cooldown <= 0``: the
    factor of ``train.cooldown_steps`` after ``done`` of ``budget = max_steps`` updates."""
    if cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (budget - done) / cooldown))


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); ``step`` counts from 1."""
    step = max(int(step), 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


class NoamSchedule:
    """Sets the optimiser's learning rate from the number of updates done (``step``).

    After ``k`` calls of :meth:`step` the next update (number ``k + 1``) runs with
    ``noam_lr(k + 1)``. The state is only the update count, so resuming with a different
    ``factor`` or ``warmup`` applies the new values from the restored step on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, d_model: int, warmup: int,
                 factor: float = 1.0) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        self.optimizer = optimizer
        self.d_model = int(d_model)
        self.warmup = int(warmup)
        self.factor = float(factor)
        self.step_num = 0
        self.scale = 1.0
        self._apply()

    @property
    def lr(self) -> float:
        """Learning rate of the next update (times the cool-down :attr:`scale`)."""
        return noam_lr(self.step_num + 1, self.d_model, self.warmup, self.factor) * self.scale

    def set_scale(self, scale: float) -> None:
        """Multiply the rate by ``scale`` from the next update on (the cool-down; not saved:
        it is recomputed from the step, which the checkpoint keeps)."""
        self.scale = float(scale)
        self._apply()

    def _apply(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Count one optimiser update and set the rate for the next one."""
        self.step_num += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only (loads with ``torch.load(weights_only=True)``)."""
        return {"step": self.step_num, "d_model": self.d_model, "warmup": self.warmup,
                "factor": self.factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the update count (the constructor's factor and warmup stay in force)."""
        self.step_num = int(state["step"])
        self._apply()


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam(betas, eps) from the config, or AdamW when ``weight_decay > 0``; lr set by the schedule.

    The fused implementation (one kernel over all parameters) on CPU and CUDA: on a 2-core CPU
    it steps 7.6M parameters in ~5 ms instead of ~15 ms for the per-tensor loop.
    """
    betas = (float(cfg.adam_betas[0]), float(cfg.adam_betas[1]))
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    if cfg.weight_decay > 0:
        return torch.optim.AdamW([{"params": params}], lr=0.0, betas=betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, fused=fused or None)
    return torch.optim.Adam(params, lr=0.0, betas=betas, eps=cfg.adam_eps, fused=fused or None)


def build_schedule(optimizer: torch.optim.Optimizer, d_model: int, cfg: TrainConfig) -> NoamSchedule:
    """The Noam schedule with ``train.warmup_steps`` and ``train.lr_factor``."""
    return NoamSchedule(optimizer, d_model=d_model, warmup=cfg.warmup_steps, factor=cfg.lr_factor)


__all__ = ["NoamSchedule", "build_optimizer", "build_schedule", "cooldown_scale", "noam_lr"]
