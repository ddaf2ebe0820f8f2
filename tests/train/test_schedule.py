"""The learning-rate schedules and the optimiser against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from mtcli.config import ConfigError, TrainConfig, load_config
from mtcli.train.schedule import (
    LRSchedule,
    build_optimizer,
    build_schedule,
    cooldown_scale,
    noam_lr,
    peak_lr,
)


def test_noam_hand_values() -> None:
    d, w, f = 512, 4000, 1.0
    # step 1: 512^-0.5 * 1 * 4000^-1.5
    assert noam_lr(1, d, w, f) == pytest.approx(512**-0.5 * 4000**-1.5)
    # warm-up is linear
    assert noam_lr(2000, d, w, f) == pytest.approx(2000 * noam_lr(1, d, w, f))
    # peak at step == warmup: (d * w)^-0.5
    peak = (512 * 4000) ** -0.5
    assert noam_lr(4000, d, w, f) == pytest.approx(peak)
    assert noam_lr(3999, d, w, f) < peak and noam_lr(4001, d, w, f) < peak
    # decay: inverse square root
    assert noam_lr(16000, d, w, f) == pytest.approx(peak / 2)
    assert noam_lr(10, 256, 4, 2.0) == pytest.approx(2.0 * 256**-0.5 * 10**-0.5)


def test_schedule_drives_optimizer_and_round_trips() -> None:
    model = torch.nn.Linear(3, 2)
    cfg = TrainConfig(warmup_steps=4, lr_factor=2.0)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-9
    sched = build_schedule(opt, 16, cfg)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([noam_lr(k, 16, 4, 2.0) for k in range(1, 7)])
    assert max(range(6), key=lambda i: seen[i]) == 3  # the 4th update is the peak
    other = LRSchedule(torch.optim.Adam(model.parameters()), 16, 4, 2.0)
    other.load_state_dict(sched.state_dict())
    assert other.lr == pytest.approx(sched.lr)
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(noam_lr(7, 16, 4, 2.0))


def test_weight_decay_selects_adamw() -> None:
    opt = build_optimizer(torch.nn.Linear(2, 2), TrainConfig(weight_decay=0.01))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["weight_decay"] == 0.01


def test_weight_decay_shrinks_every_parameter() -> None:
    """With zero gradients AdamW's step is the decay alone: p <- p * (1 - lr * wd), LayerNorm
    gains and biases included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    cfg = TrainConfig(weight_decay=0.5)
    opt = build_optimizer(model, cfg)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for group in opt.param_groups:
        group["lr"] = 0.1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        assert torch.allclose(p, before[name] * (1 - 0.1 * 0.5)), name


def test_rejects_zero_warmup() -> None:
    with pytest.raises(ValueError):
        LRSchedule(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()), 8, 0)


def test_cooldown_scale_falls_linearly_to_zero() -> None:
    budget, cool = 600.0, 120.0
    assert cooldown_scale(0.0, budget, cool) == 1.0
    assert cooldown_scale(480.0, budget, cool) == 1.0  # the cool-down starts here
    assert cooldown_scale(540.0, budget, cool) == pytest.approx(0.5)
    assert cooldown_scale(594.0, budget, cool) == pytest.approx(0.05)
    assert cooldown_scale(700.0, budget, cool) == 0.0
    assert cooldown_scale(590.0, budget, 0.0) == 1.0  # off


def test_set_scale_multiplies_the_noam_rate() -> None:
    opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    sched = LRSchedule(opt, 16, 4, 2.0)
    sched.step()
    sched.set_scale(0.25)
    assert sched.lr == pytest.approx(0.25 * noam_lr(2, 16, 4, 2.0))
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.lr)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25 * noam_lr(3, 16, 4, 2.0))


def test_inverse_sqrt_and_constant_hand_values() -> None:
    peak, w = 5e-4, 4
    assert peak_lr(1, w, peak, decay=True) == pytest.approx(peak / 4)
    assert peak_lr(4, w, peak, decay=True) == pytest.approx(peak)
    assert peak_lr(16, w, peak, decay=True) == pytest.approx(peak / 2)
    assert peak_lr(2, w, peak, decay=False) == pytest.approx(peak / 2)
    assert peak_lr(1000, w, peak, decay=False) == pytest.approx(peak)
    # inverse_sqrt is Noam's shape with the peak given: equal when the peaks are equal
    noam_peak = noam_lr(w, 16, w, 2.0)
    for step in (1, 3, 4, 9, 100):
        assert peak_lr(step, w, noam_peak, decay=True) == pytest.approx(noam_lr(step, 16, w, 2.0))


@pytest.mark.parametrize("kind", ["inverse_sqrt", "constant"])
def test_build_schedule_follows_lr_schedule(kind: str) -> None:
    model = torch.nn.Linear(3, 2)
    cfg = TrainConfig(warmup_steps=2, lr_schedule=kind, lr=1e-3)
    opt = build_optimizer(model, cfg)
    sched = build_schedule(opt, 16, cfg)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    expected = [peak_lr(k, 2, 1e-3, decay=kind == "inverse_sqrt") for k in range(1, 9)]
    assert seen == pytest.approx(expected)
    assert max(seen) == pytest.approx(1e-3)
    assert sched.state_dict()["kind"] == kind


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.lr_schedule=constant"], "train.lr_schedule: constant needs train.lr > 0"),
    (["train.lr=0.001"], "train.lr sets the peak of lr_schedule inverse_sqrt or constant"),
    (["train.lr_schedule=inverse_sqrt", "train.lr=0.001", "train.lr_factor=2"],
     "with --set train.lr_schedule=inverse_sqrt train.lr_factor=2: train.lr_factor 2.0 scales Noam's rate only"),
    # the recipe's own lr_factor (toy.yaml: 0.5) is what to change, not the train.lr given
    (["train.lr_schedule=constant", "train.lr=0.001"],
     "with --set train.lr_schedule=constant: train.lr_factor 0.5 scales Noam's rate only; under "
     "train.lr_schedule constant set train.lr_factor=1.0"),
    (["train.lr_schedule=cosine"], "train.lr_schedule' must be 'noam' | 'inverse_sqrt' | 'constant'"),
])
def test_schedule_keys_are_checked(overrides: list[str], message: str) -> None:
    from conftest import TOY_CONFIG

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TOY_CONFIG, overrides)
