"""The trainer: one run's model, optimiser, data stream and bookkeeping, and its loop.

One optimiser step, as in "Attention Is All You Need" (section 5):

1. take the step's group of ``update_freq * world_size`` token batches from the deterministic
   :class:`~mtcli.data.batching.BatchStream`; this rank runs every ``world_size``-th of them;
2. for each, forward (autocast in ``train.precision``: bf16, or fp16 through a gradient scaler
   whose state is checkpointed), the loss summed over target tokens
   (label-smoothed cross entropy, or :class:`~mtcli.train.rdrop.RDropLoss`), and backward of ``loss * world_size / N`` where ``N`` is the target-token count of
   the whole group (known on every rank from the cached lengths). DDP averages gradients over
   ranks, so the gradient is d/dtheta [sum of losses / N]: the same as one process running the
   whole group with ``update_freq`` accumulation. While the device runs these, the host
   collates the next step's batches and starts their copy (a checkpoint keeps the position
   before them), and only then waits for the loss;
3. a non-finite loss or gradient norm skips the update (gradients zeroed, logged;
   ``max_nonfinite`` in a row raise :class:`TrainingError`); otherwise clip the gradient norm
   (``clip_norm`` > 0), Adam step, learning-rate schedule step.

Every ``valid_every`` steps and at the end, rank 0 validates (loss, NLL, perplexity, and BLEU of
greedy decoding when ``valid_bleu``) and writes ``checkpoint_<step>.pt`` once, with
``checkpoint_last.pt`` and ``checkpoint_best.pt`` (by BLEU, or loss without BLEU) as hard links to
it (copies where links fail), and ``checkpoints/index.json``.

A run directory with a checkpoint is resumed exactly: model, optimiser, schedule step, the RNG
states (python, numpy, torch, cuda), the data position ``(epoch, batch)``, best score, patience
counter and elapsed time all come back, so N steps straight and N/2 + N/2 give the same
parameters. SIGINT/SIGTERM finish the current step, write ``checkpoint_last.pt`` and raise
:class:`TrainingInterrupted` (exit code 128 + signal).

Under ``torchrun`` (:mod:`mtcli.train.distributed`) only rank 0 writes files and validates.
Every rank's RNG states are gathered into the checkpoint (``rng_ranks``), so a resumed
multi-process run with dropout is exact on every rank when resumed with the same process count;
with another count, rank 0 takes the saved rank 0's states and the others reseed from
``(seed, rank, step)``.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from mtcli.checkpoint import save_checkpoint
from mtcli.config import Config
from mtcli.data.batching import Batch, BatchStream, CorpusMix, StepGroup
from mtcli.data.cache import PreparedCorpus
from mtcli.data.packing import PackedBatch
from mtcli.data.sampling import subword_resegmenter
from mtcli.data.tokenizer import PAD_ID
from mtcli.errors import CheckpointError, TrainingError, TrainingInterrupted, one_line
from mtcli.fileio import sha256_file
from mtcli.logs import get_logger, progress
from mtcli.model import Transformer, count_parameters
from mtcli.rundir import (
    BEST_NAME,
    LAST_NAME,
    checkpoint_dir,
    prune_checkpoints,
    step_checkpoint_name,
    update_index,
)
from mtcli.train.distributed import DistInfo, all_sum, broadcast, gather_rng_states
from mtcli.train.loss import LabelSmoothedLoss, perplexity
from mtcli.train.rdrop import RDropLoss
from mtcli.train.resume import check_resume_config
from mtcli.train.rng import seed_everything, set_rng_state
from mtcli.train.schedule import build_optimizer, build_schedule, cooldown_scale
from mtcli.train.signals import StopSignals
from mtcli.train.step import (
    COMPILE_LENGTH_MULTIPLE,
    compile_forward_loss,
    cuda_graphs,
    forward_loss,
)
from mtcli.train.validation import validation_bleu, validation_loss

STATE_FORMAT = 1


class Trainer:
    """Holds the model, optimiser, data stream and bookkeeping of one run; :meth:`run` trains."""

    def __init__(self, config: Config, info: DistInfo, device: torch.device,
                 corpus: PreparedCorpus, run_dir: Path) -> None:
        self.config = config
        self.cfg = config.train
        self.info = info
        self.device = device
        self.corpus = corpus
        self.run_dir = run_dir
        self.ckpt_dir = checkpoint_dir(run_dir)
        self.log = get_logger()
        self.spm_sha256 = sha256_file(corpus.spm_path)
        seed_everything(self.cfg.seed)  # identical initial weights on every rank
        output_ids = corpus.target_vocabulary() if config.model.output_vocab == "target" else None
        self.model = Transformer(config.model, corpus.vocab_size, output_ids=output_ids).to(device)
        self.parameters = count_parameters(self.model)
        if info.rank > 0:  # different dropout masks per rank
            torch.manual_seed(self.cfg.seed * 1_000_003 + info.rank * 10_007)
        self.ddp: nn.Module | None = None
        self.criterion = (RDropLoss(self.cfg.label_smoothing, self.cfg.rdrop_alpha, PAD_ID)
                          if self.cfg.rdrop_alpha > 0 else LabelSmoothedLoss(self.cfg.label_smoothing, PAD_ID))
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.schedule = build_schedule(self.optimizer, config.model.d_model, self.cfg)
        # one graph with symbolic batch and length sizes: token batches change shape every time;
        # packed batches have one shape, so on a GPU their graph is also replayed as a CUDA graph
        self.graphs = self.cfg.compile and cuda_graphs(self.cfg, device, info.world_size)
        self.forward_loss = (compile_forward_loss(one_shape=self.cfg.pack_length > 0, graphs=self.graphs)
                             if self.cfg.compile else forward_loss)
        # fp16's narrow range needs the loss scaled up and the gradients checked for overflow
        self.scaler = torch.amp.GradScaler(device.type) if self.cfg.precision == "fp16" else None
        weights = [c.weight for c in config.data.corpora()]
        self.stream = BatchStream(
            *corpus.train_pairs(),
            max_tokens=self.cfg.max_tokens,
            max_source_length=min(self.cfg.max_source_length, config.model.max_positions - 1),
            max_target_length=min(self.cfg.max_target_length, config.model.max_positions - 1),
            seed=self.cfg.seed,
            update_freq=self.cfg.update_freq,
            world_size=info.world_size,
            rank=info.rank,
            pack_length=self.cfg.pack_length,
            resegment=subword_resegmenter(corpus, config) if self.cfg.subword_alpha > 0 else None,
            mix=CorpusMix(corpus.corpus_sizes(), weights, self.cfg.seed) if config.data.sources else None,
        )
        self.step = 0
        self.best: float | None = None
        self.best_bleu: float | None = None
        self.best_loss: float | None = None
        self.bad_validations = 0
        self.nonfinite_in_row = 0
        self.elapsed = 0.0
        self.last_valid: dict[str, Any] = {"loss": None, "nll": None, "ppl": None, "bleu": None}
        self.last_valid_step = -1
        # Sums over the steps since the last training-loss log line, so each line reports the
        # mean over its window rather than one noisy step (saved with the state: resume is exact).
        self.log_window = {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "real": 0.0, "padded": 0.0}
        self.resumed_from: str | None = None
        self.writer: SummaryWriter | None = None
        self.signals = StopSignals()
        self._tokens_done = 0
        self._train_seconds = 0.0
        self._clock = time.monotonic()
        # the last step's and the last validation's (with its save) wall time: a time limit stops
        # early enough for one more of each to fit, so the final validation ends within it
        self._step_seconds = 0.0
        self._valid_seconds = 0.0
        # the next step's batches, drawn and on their way to the device while this step runs:
        # (the stream's position before them, their group, the batches)
        self._ahead: tuple[dict[str, Any], StepGroup, list[Batch | PackedBatch]] | None = None

    # ----------------------------------------------------------------- resume

    def resume(self, path: Path, state: dict[str, Any]) -> None:
        """Restore everything a checkpoint holds; refuses incompatible configs and vocabularies."""
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, expected {STATE_FORMAT}")
        for change in check_resume_config(state.get("config") or {}, self.config.to_dict(), str(path)):
            self.log.info("config change on resume: %s", change)
        vocab = state.get("vocab") or {}
        if vocab.get("spm_sha256") not in (None, self.spm_sha256) or \
                int(vocab.get("size", self.corpus.vocab_size)) != self.corpus.vocab_size:
            raise CheckpointError(
                f"{path}: the checkpoint's SentencePiece model differs from {self.corpus.spm_path} "
                "(the cache was re-prepared); use a new run directory"
            )
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot restore model/optimizer ({one_line(exc)})") from None
        self.schedule.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.stream.load_state_dict(state["data_state"])
        self.step = int(state["step"])
        ts = state.get("train_state") or {}
        self.best = ts.get("best")
        self.best_bleu = ts.get("best_bleu")
        self.best_loss = ts.get("best_loss")
        self.bad_validations = int(ts.get("bad_validations", 0))
        self.nonfinite_in_row = int(ts.get("nonfinite_in_row", 0))
        self.elapsed = float(ts.get("elapsed_seconds", 0.0))
        self.last_valid_step = int(ts.get("last_valid_step", -1))
        self._tokens_done = int(ts.get("tokens_done", 0))
        self._train_seconds = float(ts.get("train_seconds", 0.0))
        self.log_window.update({k: float(v) for k, v in (ts.get("log_window") or {}).items()
                                if k in self.log_window})
        self.last_valid = dict(state.get("valid") or self.last_valid)
        ranks = state.get("rng_ranks") or []
        if len(ranks) == self.info.world_size:  # the same process count: every rank's own states
            set_rng_state(ranks[self.info.rank], self.device)
        elif self.info.is_main:
            set_rng_state(state["rng"], self.device)
        else:
            torch.manual_seed(self.cfg.seed * 1_000_003 + self.info.rank * 10_007 + self.step)
        self.resumed_from = f"{path.name} (step {self.step})"
        self.log.info("resumed from %s at step %d, epoch %d, batch %d", path, self.step,
                      self.stream.epoch, self.stream.batch)

    def state_dict(self, rng_ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint state (plain data and tensors: :func:`mtcli.checkpoint.load_checkpoint`
        reads it weights-only).

        ``rng_ranks``: every rank's RNG states (:func:`~mtcli.train.distributed.gather_rng_states`). ``rng`` is rank 0's;
        the whole list is saved under a multi-process run so that each rank resumes its own
        dropout masks."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "epoch": self.position["epoch"],
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
            "rng": rng_ranks[0],
            **({"rng_ranks": rng_ranks} if len(rng_ranks) > 1 else {}),
            "data_state": self.position,
            "train_state": {
                "best": self.best,
                "best_bleu": self.best_bleu,
                "best_loss": self.best_loss,
                "bad_validations": self.bad_validations,
                "nonfinite_in_row": self.nonfinite_in_row,
                "elapsed_seconds": self.elapsed,
                "last_valid_step": self.last_valid_step,
                "log_window": dict(self.log_window),
                "tokens_done": self._tokens_done,
                "train_seconds": self._train_seconds,
            },
            "config": self.config.to_dict(),
            "vocab": {"size": int(self.corpus.vocab_size), "spm_sha256": self.spm_sha256},
            "valid": {k: self.last_valid.get(k) for k in ("loss", "nll", "ppl", "bleu")},
        }

    # ----------------------------------------------------------------- one step

    @property
    def position(self) -> dict[str, Any]:
        """The stream's position of the next step to train (:meth:`BatchStream.state_dict`): the
        position before the batches already prefetched, which no step has trained yet."""
        return self._ahead[0] if self._ahead is not None else self.stream.state_dict()

    def next_step_batches(self) -> tuple[StepGroup, list[Batch | PackedBatch]]:
        """The next step's group and this rank's batches on the device: those prefetched during
        the last step, else drawn and collated now."""
        if self._ahead is not None:
            _, group, batches = self._ahead
            self._ahead = None
            return group, batches
        group = self.stream.next_group()
        return group, self._collate(group)

    def _collate(self, group: StepGroup) -> list[Batch | PackedBatch]:
        """This rank's batches of ``group``, collated and sent to the device (without waiting)."""
        batches = []
        for indices in group.mine():
            batch = self.stream.collate(indices)
            if self.cfg.compile and isinstance(batch, Batch):  # one compiled graph for every length
                batch = batch.padded(COMPILE_LENGTH_MULTIPLE)
            batches.append(batch.to(self.device))
        return batches

    def _prefetch(self) -> None:
        """Draw and collate the next step's batches while the device still runs this step's
        kernels. The host waits for them right after (for the loss); collating after that wait
        would leave a GPU idle for as long as collating takes. Collating reads no random state,
        and a checkpoint saves the position before these batches, so training and resume are
        the same as without it."""
        if self.step + 1 < self.cfg.max_steps:  # not after the last step
            position = self.stream.state_dict()
            group = self.stream.next_group()
            self._ahead = (position, group, self._collate(group))

    def train_step(self, group: StepGroup, batches: list[Batch | PackedBatch] | None = None) -> dict[str, float] | None:
        """Forward/backward this rank's ``batches`` of ``group`` (collated here if not given) and
        update; None if skipped."""
        model = self.ddp or self.model
        model.train()
        total_tokens = group.target_tokens(self.stream.tgt_lengths)
        scale = self.info.world_size / max(total_tokens, 1)
        mine = self._collate(group) if batches is None else batches
        loss_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        nll_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = real = padded = 0
        for i, batch in enumerate(mine):
            layout = (() if isinstance(batch, Batch) else
                      (batch.src_segments, batch.tgt_segments, batch.src_positions, batch.tgt_positions))
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            with sync:
                loss, logged, nll = self.forward_loss(model, self.criterion, self.model.output_targets,
                                                      self.cfg.precision, batch.src, batch.tgt_in, batch.tgt_out,
                                                      *layout)
                scaled = loss * scale
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            loss_acc += logged
            nll_acc += nll
            tokens += batch.tgt_tokens
            real += batch.src_tokens + batch.tgt_tokens
            padded += batch.padded_tokens
        self._prefetch()  # before the host waits for the device
        stop = 1.0 if self.signals.signum is not None else 0.0
        loss_sum, nll_sum, tokens_f, real_f, padded_f, stop_any = all_sum(
            [float(loss_acc), float(nll_acc), float(tokens), float(real), float(padded), stop],
            self.info, self.device,
        )
        if stop_any > 0 and self.signals.signum is None:
            self.signals.signum = signal.SIGTERM  # another rank was signalled
        if self.scaler is not None and math.isfinite(loss_sum):
            self.scaler.unscale_(self.optimizer)
        need_norm = self.cfg.clip_norm > 0 or (self.step + 1) % self.cfg.log_every == 0
        grad_norm = self._clip_gradients() if math.isfinite(loss_sum) and need_norm else float("nan")
        if self.scaler is not None and math.isfinite(loss_sum) and not self._scaled_step():
            return None  # fp16 gradients overflowed: the scale is lowered and the step taken again later
        if not math.isfinite(loss_sum) or (need_norm and not math.isfinite(grad_norm)):
            self._skip_update(group.epoch)
            return None
        lr = self.schedule.lr
        if self.scaler is None:
            self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_row = 0
        self.step += 1
        return {
            "loss": loss_sum / max(tokens_f, 1.0),
            "nll": nll_sum / max(tokens_f, 1.0),
            "ppl": perplexity(nll_sum, int(tokens_f)),
            "tokens": tokens_f,
            "real": real_f,
            "padded": padded_f,
            "lr": lr,
            "grad_norm": grad_norm,
        }

    def _scaled_step(self) -> bool:
        """The fp16 optimiser step through the gradient scaler: False (gradients dropped, nothing
        counted) when they overflowed, and the scaler lowered its scale."""
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:
            self.optimizer.zero_grad(set_to_none=True)
            self.log.debug("fp16 gradients overflowed at step %d: loss scale %g -> %g", self.step + 1, before,
                           self.scaler.get_scale())
            return False
        return True

    def _clip_gradients(self) -> float:
        """The gradient norm, clipped to ``train.clip_norm`` when that is > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _skip_update(self, epoch: int) -> None:
        """Drop this step's gradients after a non-finite loss or gradient norm; raise
        :class:`TrainingError` after ``max_nonfinite`` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_row += 1
        self.log.warning("non-finite loss/gradient at step %d (epoch %d): update skipped (%d in a row)",
                         self.step + 1, epoch, self.nonfinite_in_row)
        if self.nonfinite_in_row >= self.cfg.max_nonfinite:
            raise TrainingError(
                f"{self.nonfinite_in_row} non-finite losses in a row at step {self.step + 1} "
                f"(train.max_nonfinite={self.cfg.max_nonfinite}); lower train.lr_factor, "
                "set train.clip_norm, or check the data"
            )

    # ----------------------------------------------------------------- validation

    def validate(self) -> dict[str, Any]:
        """Rank 0 computes loss/NLL/ppl/BLEU (RNG untouched); every rank gets the numbers."""
        values = [float("nan")] * 3
        if self.info.is_main:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                loss, nll, tokens = validation_loss(self.model, self.criterion, self.corpus,
                                                    self.config, self.device)
                bleu = (validation_bleu(self.model, self.corpus, self.config, self.device)
                        if self.cfg.valid_bleu else None)
            values = [loss / max(tokens, 1), nll / max(tokens, 1),
                      float("nan") if bleu is None else bleu]
        loss, nll, bleu = broadcast(values, self.info, self.device)
        result = {"loss": loss, "nll": nll, "ppl": math.exp(min(nll, 700.0)),
                  "bleu": None if math.isnan(bleu) else bleu}
        self.last_valid = result
        self.last_valid_step = self.step
        use_bleu = self.cfg.valid_bleu and result["bleu"] is not None
        metric = result["bleu"] if use_bleu else -loss
        improved = self.best is None or metric > self.best
        if improved:
            self.best = metric
            self.bad_validations = 0
        else:
            self.bad_validations += 1
        if result["bleu"] is not None and (self.best_bleu is None or result["bleu"] > self.best_bleu):
            self.best_bleu = result["bleu"]
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss = loss
        result["improved"] = improved
        bleu_text = "n/a" if result["bleu"] is None else f"{result['bleu']:.2f}"
        self.log.info("valid step %d | loss %.4f | nll %.4f | ppl %.2f | bleu %s%s", self.step, loss,
                      nll, result["ppl"], bleu_text, " | best" if improved else "")
        if self.writer is not None:
            for key in ("loss", "nll", "ppl", "bleu"):
                if result[key] is not None:
                    self.writer.add_scalar(f"valid/{key}", result[key], self.step)
            self.writer.flush()
        return result

    # ----------------------------------------------------------------- checkpoints

    def save(self, *, validated: bool, improved: bool = False) -> None:
        """Rank 0 writes checkpoint_last (and, after a validation, the step/best files and index).

        Every rank calls this at the same step (the stop rules and signals are agreed on across
        ranks), since the ranks' RNG states are gathered first."""
        rng_ranks = gather_rng_states(self.info, self.device)
        if not self.info.is_main:
            return
        self.elapsed += self._consume_time()
        state = self.state_dict(rng_ranks)
        last = self.ckpt_dir / LAST_NAME
        if not validated:
            save_checkpoint(last, state)
            return
        # the index first (an entry whose file is missing is ignored, and rewritten on resume);
        # the state is written once: last (and best) become further names of the step file
        update_index(self.run_dir, self.step, state["valid"])
        also = [self.ckpt_dir / BEST_NAME, last] if improved else [last]
        save_checkpoint(self.ckpt_dir / step_checkpoint_name(self.step), state, also=also)
        prune_checkpoints(self.run_dir, self.cfg.keep_last, self.cfg.keep_best)

    def _consume_time(self) -> float:
        now = time.monotonic()
        spent = now - self._clock
        self._clock = now
        return spent

    # ----------------------------------------------------------------- the loop

    def stop_reason(self) -> str | None:
        """Why training should stop now, or None (the same answer on every rank)."""
        cfg = self.cfg
        if self.step >= cfg.max_steps:
            return f"max_steps={cfg.max_steps}"
        if cfg.max_epochs > 0 and self.position["epoch"] >= cfg.max_epochs:
            return f"max_epochs={cfg.max_epochs}"
        if cfg.patience > 0 and self.bad_validations >= cfg.patience:
            return f"patience={cfg.patience} (no better validation {'BLEU' if self._uses_bleu() else 'loss'})"
        scale = 1.0
        if cfg.cooldown_steps > 0:  # the next update is step + 1; the last one (max_steps) gets 1/cooldown
            scale = cooldown_scale(self.step, cfg.max_steps, cfg.cooldown_steps)
        if cfg.max_minutes > 0:
            # rank 0's clock decides for every rank. The run stops if one more step and the
            # final validation would end past the limit (a safety cap: a recipe budgets steps).
            spent, ahead = broadcast([self.elapsed + (time.monotonic() - self._clock),
                                       self._step_seconds + self._valid_seconds], self.info, self.device)
            if spent + ahead > cfg.max_minutes * 60:
                return f"max_minutes={cfg.max_minutes:g}"
        if cfg.cooldown_steps > 0:
            self.schedule.set_scale(scale)
        return None

    def _uses_bleu(self) -> bool:
        return self.cfg.valid_bleu and self.last_valid.get("bleu") is not None

    def _interrupt(self) -> None:
        signum = int(self.signals.signum or signal.SIGTERM)
        self.save(validated=False)
        name = signal.Signals(signum).name
        raise TrainingInterrupted(
            f"training interrupted by {name} at step {self.step}; checkpoint_last saved in "
            f"{self.ckpt_dir} (run the same command again to resume)", signum
        )

    def _add_to_log_window(self, stats: dict[str, float]) -> None:
        window = self.log_window
        window["loss"] += stats["loss"] * stats["tokens"]
        window["nll"] += stats["nll"] * stats["tokens"]
        for key in ("tokens", "real", "padded"):
            window[key] += stats[key]

    def _take_log_window(self) -> dict[str, float]:
        """Token-weighted means of loss/NLL, perplexity and padding since the last log line; resets."""
        w = self.log_window
        tokens = max(w["tokens"], 1.0)
        mean = {"loss": w["loss"] / tokens, "nll": w["nll"] / tokens,
                "ppl": perplexity(w["nll"], int(w["tokens"])),
                "padding": 1.0 - w["real"] / max(w["padded"], 1.0)}
        self.log_window = dict.fromkeys(w, 0.0)
        return mean

    def run(self) -> str:
        """Train until a stop rule fires; returns the stop reason."""
        cfg = self.cfg
        self._clock = time.monotonic()
        # Under a wall-clock limit, max_steps is usually a far ceiling: a step total would show
        # a meaningless ETA, so the bar then counts steps and rate only.
        total = None if cfg.max_minutes > 0 else cfg.max_steps
        bar = progress(total=total, initial=self.step, enabled=cfg.progress and self.info.is_main,
                       terminal_only=True, desc="train", unit="step")  # train.log has the rest
        window_tokens = 0.0
        window_start = time.monotonic()
        try:
            while True:
                reason = self.stop_reason()
                if reason is not None:
                    break
                if self.signals.signum is not None and not self.info.distributed:
                    self._interrupt()
                step_start = time.monotonic()
                group, batches = self.next_step_batches()
                stats = self.train_step(group, batches)
                self._step_seconds = time.monotonic() - step_start
                self._train_seconds += self._step_seconds
                if stats is not None:
                    self._add_to_log_window(stats)  # before a signal's save: it is part of the state
                if self.signals.signum is not None:
                    self._interrupt()
                if stats is None:
                    continue
                window_tokens += stats["tokens"]
                self._tokens_done += int(stats["tokens"])
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}", refresh=False)
                if self.step % cfg.log_every == 0:
                    seconds = max(time.monotonic() - window_start, 1e-9)
                    tps = window_tokens / seconds
                    mean = self._take_log_window()
                    mean.update(lr=stats["lr"], grad_norm=stats["grad_norm"])
                    bar.set_postfix(loss=f"{mean['loss']:.3f}", lr=f"{mean['lr']:.2e}", tok_s=f"{tps:.0f}")
                    self.log.info(
                        "step %d | epoch %d | loss %.4f | nll %.4f | ppl %.2f | lr %.3e | gnorm %.3f "
                        "| tok/s %.0f | pad %.3f", self.step, group.epoch, mean["loss"], mean["nll"],
                        mean["ppl"], mean["lr"], mean["grad_norm"], tps, mean["padding"])
                    if self.writer is not None:
                        for key in ("loss", "nll", "ppl", "lr", "grad_norm", "padding"):
                            self.writer.add_scalar(f"train/{key}", mean[key], self.step)
                        self.writer.add_scalar("train/tokens_per_s", tps, self.step)
                    window_tokens = 0.0
                    window_start = time.monotonic()
                if self.step % cfg.valid_every == 0:
                    self._validate_and_save()
                    window_start = time.monotonic()
            if self.last_valid_step != self.step:
                self._validate_and_save()
            else:
                self.save(validated=False)
            return reason
        finally:
            bar.close()

    def _validate_and_save(self) -> None:
        """Validate, write the step's checkpoint, and time both (a time limit keeps room for them)."""
        start = time.monotonic()
        result = self.validate()
        self.save(validated=True, improved=result["improved"])
        self._valid_seconds = time.monotonic() - start

    @property
    def tokens_per_second(self) -> float:
        """Mean target tokens/s over the run's training steps (validation excluded), counting
        the processes before a resume too (their totals are saved in the checkpoint)."""
        return self._tokens_done / self._train_seconds if self._train_seconds > 0 else 0.0
