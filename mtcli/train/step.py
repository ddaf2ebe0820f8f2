"""One training step's forward and loss, as the trainer runs it: eagerly, or compiled with
``torch.compile`` (``train.compile``), and on a GPU replayed as a CUDA graph where the batches
have one shape (``train.pack_length``); what a step reports, the window of steps a log line
averages, and the log line itself with the time left."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mtcli.config import TrainConfig
from mtcli.data.batching import BatchStream
from mtcli.device import autocast
from mtcli.logs import duration_text
from mtcli.train.loss import LabelSmoothedLoss, perplexity
from mtcli.train.rdrop import RDropLoss

#: Lengths a compiled step pads its batches to a multiple of (Batch.padded).
COMPILE_LENGTH_MULTIPLE = 8


def forward_loss(model: nn.Module, criterion: LabelSmoothedLoss | RDropLoss,
                 output_targets: Callable[[Tensor], Tensor], precision: str,
                 src: Tensor, tgt_in: Tensor, tgt_out: Tensor, *layout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One batch's forward (autocast in ``precision``) and loss: ``(objective, loss, nll)``, the
    objective to backpropagate and the detached sums to log. A packed batch also passes its
    ``layout`` (segments and positions, :meth:`Transformer.forward_packed`). ``train.compile``
    runs this through ``torch.compile`` as one graph (a test checks that nothing breaks it)."""
    src, tgt_in, *layout = criterion.inputs(src, tgt_in, *layout)
    with autocast(src.device, precision):
        logits = model(src, tgt_in, *layout)  # through DDP's forward, whose hooks reduce the gradients
    objective, out = criterion.objective(logits, output_targets(tgt_out))
    return objective, out.loss.detach(), out.nll


def mark_sizes_dynamic(*batches: Tensor) -> None:
    """Tell ``torch.compile`` that these ``[B, L]`` tensors' batch size and length vary."""
    for tensor in batches:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(tensor, 1)


def compile_forward_loss(one_shape: bool = False, graphs: bool = False) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """:func:`forward_loss` under ``torch.compile``: one graph whose batch size and lengths are
    symbolic, so token batches of any shape reuse it. The sizes are marked dynamic on every
    call: otherwise a first batch whose source and target lengths happen to be equal would
    tie them together in the graph, and the next batch would compile it again.

    ``one_shape`` (packed batches): compiled for their one shape instead; ``graphs``: and replayed
    as CUDA graphs (torch.compile's ``reduce-overhead``), so the host launches a step's kernels
    as one graph."""
    compiled = torch.compile(forward_loss, dynamic=not one_shape, mode="reduce-overhead" if graphs else None)

    def run(model: nn.Module, criterion: LabelSmoothedLoss | RDropLoss, output_targets: Callable[[Tensor], Tensor],
            precision: str, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, *layout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if graphs:  # a new call: the last one's outputs are never read again
            torch.compiler.cudagraph_mark_step_begin()
        elif not one_shape:
            mark_sizes_dynamic(src, tgt_in, tgt_out)
        return compiled(model, criterion, output_targets, precision, src, tgt_in, tgt_out, *layout)

    return run


def cuda_graphs(cfg: TrainConfig, device: torch.device, world_size: int) -> bool:
    """Whether the compiled step is replayed as a CUDA graph: packed batches (one shape) on a
    GPU, one batch an update, one process. A replay overwrites the last replay's outputs, the
    gradients among them, so a gradient accumulated over ``update_freq`` batches would be read
    after it was overwritten (PyTorch refuses it); DDP's gradient hooks have not been tried under
    graphs. Those runs compile without graphs."""
    return cfg.pack_length > 0 and device.type == "cuda" and cfg.update_freq == 1 and world_size == 1


class HostValues:
    """Scalars copied from the device to the host without waiting for the device. The copy is
    queued behind the kernels that computed them, and :meth:`read` waits for that copy alone;
    a ``float()`` of a device tensor would also wait for every kernel queued after them."""

    def __init__(self, values: Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        self._host = values
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(values.device))  # the copy's stream, on its device

    def read(self) -> list[float]:
        """The values (waiting for their copy if it is still under way)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


def step_stats(loss_sum: float, nll_sum: float, tokens: float, real: float, padded: float, lr: float,
               grad_norm: float) -> dict[str, float]:
    """What a counted step reports: per-token loss and NLL, perplexity, the token counts, the
    learning rate its update used and the gradient norm (NaN where it was not computed)."""
    return {"loss": loss_sum / max(tokens, 1.0), "nll": nll_sum / max(tokens, 1.0),
            "ppl": perplexity(nll_sum, int(tokens)), "tokens": tokens, "real": real, "padded": padded,
            "lr": lr, "grad_norm": grad_norm}


class LogWindow:
    """Sums over the steps since the last training-loss log line, so that each line reports the
    mean over its window rather than one noisy step (saved with the state: resume is exact)."""

    def __init__(self) -> None:
        self.sums = {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "real": 0.0, "padded": 0.0}

    def add(self, stats: dict[str, float]) -> None:
        """Add a counted step's :func:`step_stats`."""
        self.sums["loss"] += stats["loss"] * stats["tokens"]
        self.sums["nll"] += stats["nll"] * stats["tokens"]
        for key in ("tokens", "real", "padded"):
            self.sums[key] += stats[key]

    def take(self) -> dict[str, float]:
        """Token-weighted means of loss/NLL, perplexity and padding since the last log line; resets."""
        w = self.sums
        tokens = max(w["tokens"], 1.0)
        mean = {"loss": w["loss"] / tokens, "nll": w["nll"] / tokens,
                "ppl": perplexity(w["nll"], int(w["tokens"])),
                "padding": 1.0 - w["real"] / max(w["padded"], 1.0)}
        self.sums = dict.fromkeys(w, 0.0)
        return mean

    def state_dict(self) -> dict[str, float]:
        """The sums, for a checkpoint."""
        return dict(self.sums)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sums a checkpoint saved (keys it does not know are ignored)."""
        self.sums.update({k: float(v) for k, v in state.items() if k in self.sums})


def eta_step_seconds(window_seconds: float, steps: int, warmup_seconds: float = 0.0) -> float:
    """Seconds a step, for the ETA, of a log window of ``steps`` steps that took
    ``window_seconds``. ``warmup_seconds``: the time of the process's first step, when inside
    the window: compiling and the first allocations are not a step's time, and would put the
    first ETA off many times over (a minute's compile against steps of a tenth of a second)."""
    if steps > 1 and 0.0 < warmup_seconds < window_seconds:
        return (window_seconds - warmup_seconds) / (steps - 1)
    return window_seconds / steps


def seconds_left(cfg: TrainConfig, step: int, stream: BatchStream, step_seconds: float, valid_seconds: float,
                 elapsed: float) -> float:
    """The time to the end of training after ``step``: ``step_seconds`` a step and
    ``valid_seconds`` every ``valid_every`` steps up to ``max_steps``, or to the end of
    ``max_epochs`` of ``stream``, or what is left of ``max_minutes`` (``elapsed`` seconds spent),
    whichever comes first."""
    steps = cfg.max_steps - step
    if cfg.max_epochs > 0:
        steps = min(steps, stream.steps_until_epoch(cfg.max_epochs))
    left = steps * (step_seconds + valid_seconds / cfg.valid_every)
    return min(left, cfg.max_minutes * 60 - elapsed) if cfg.max_minutes > 0 else left


def ppl_text(ppl: float) -> str:
    """A perplexity for a log line: two decimals, or three digits and an exponent when it is huge
    (a diverging run's reached exp(700), 300 digits)."""
    return f"{ppl:.2f}" if ppl < 1e6 else f"{ppl:.3g}"


def log_step(log: logging.Logger, writer: Any, step: int, epoch: int, mean: dict[str, float],
             tokens_per_s: float, seconds_left: float) -> None:
    """The step line of ``train.log`` (the window's means, its tokens/s, the peak memory and
    ``eta``: :func:`seconds_left`) and its TensorBoard scalars (``writer``: a
    :class:`~mtcli.train.scalars.Scalars`, or None)."""
    log.info("step %d | epoch %d | loss %.4f | nll %.4f | ppl %s | lr %.3e | gnorm %.3f | tok/s %.0f "
             "| pad %.3f | peak mem %.0fM | eta %s", step, epoch, mean["loss"], mean["nll"], ppl_text(mean["ppl"]),
             mean["lr"], mean["grad_norm"], tokens_per_s, mean["padding"], mean["peak_mem_mb"],
             duration_text(seconds_left))
    if writer is not None:
        for key in ("loss", "nll", "ppl", "lr", "grad_norm", "padding", "peak_mem_mb"):
            writer.add_scalar(f"train/{key}", mean[key], step)
        writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
