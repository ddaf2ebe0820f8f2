"""The trainer: one run's model, optimiser, data stream and bookkeeping, and its loop.

One optimiser step, as in "Attention Is All You Need" (section 5):

1. take the step's group of ``update_freq * world_size`` token batches from the deterministic
   :class:`~mtcli.data.batching.BatchStream`; this rank runs every ``world_size``-th of them;
2. for each, forward (autocast in ``train.precision``: bf16, or fp16 through a gradient scaler
   whose state is checkpointed), the loss summed over target tokens
   (label-smoothed cross entropy, or :class:`~mtcli.train.rdrop.RDropLoss`), and backward of
   ``loss / N`` where ``N`` is the target-token count of the whole group (known on every rank
   from the cached lengths). DDP sums the gradients over the ranks
   (:func:`~mtcli.train.distributed.sum_gradients`), so the gradient is
   d/dtheta [sum of losses / N]: the same as one process running the whole group with
   ``update_freq`` accumulation, up to the order the sums are taken in (bit for bit for two
   processes of one batch each, in fp32, bf16 and fp16 alike). Meanwhile the host collates the next step's
   batches (:mod:`mtcli.train.feed`);
3. a non-finite loss or gradient norm skips the update (logged; ``max_nonfinite`` in a row
   raise :class:`TrainingError`); otherwise clip the gradient norm (``clip_norm`` > 0), Adam
   step, learning-rate schedule step. With fused Adam (no fp16 scaler) the device skips a
   non-finite update itself, under DDP after summing the step's loss over the ranks there, and
   the host counts each step one step later, so it never waits for the device between steps
   (:meth:`Trainer.settle`).

Every ``valid_every`` steps and at the end, rank 0 validates (loss, NLL, perplexity, and BLEU and
chrF of greedy decoding when ``valid_bleu``) and writes ``checkpoint_<step>.pt`` once, with
``checkpoint_last.pt`` and ``checkpoint_best.pt`` (by ``valid_metric``, or loss without decoding) as hard links to
it (copies where links fail), and ``checkpoints/index.json``.

A run directory with a checkpoint is resumed exactly: model, optimiser, schedule step, the RNG
states (python, numpy, torch, cuda), the data position ``(epoch, batch)``, best score, patience
counter and elapsed time all come back, so N steps straight and N/2 + N/2 give the same
parameters. SIGINT/SIGTERM finish the current step, write ``checkpoint_last.pt`` and raise
:class:`TrainingInterrupted` (exit code 128 + signal); under DDP a signal to any rank stops every
rank at the same step, a step or two later, once the ranks' summed stop flag has been read.

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
from torch import Tensor, nn

from mtcli.checkpoint import save_checkpoint
from mtcli.config import Config
from mtcli.data.batching import Batch, BatchStream, CorpusMix, StepGroup
from mtcli.data.cache import PreparedCorpus
from mtcli.data.packing import PackedBatch
from mtcli.data.sampling import subword_resegmenter
from mtcli.data.tokenizer import PAD_ID
from mtcli.device import peak_memory_mb, to_device
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
from mtcli.train.distributed import DistInfo, all_sum, all_sum_queued, broadcast, gather_rng_states
from mtcli.train.feed import BatchFeed
from mtcli.train.loss import LabelSmoothedLoss
from mtcli.train.rdrop import RDropLoss
from mtcli.train.resume import (
    INEXACT,
    check_resume_data,
    hardware,
    kept_model_sha256,
    resume_changes,
)
from mtcli.train.rng import seed_everything, set_rng_state
from mtcli.train.scalars import Scalars
from mtcli.train.scaling import LossScaler
from mtcli.train.schedule import build_optimizer, build_schedule, cooldown_scale, restore_adam
from mtcli.train.signals import StopSignals, ValidationCut
from mtcli.train.step import (
    COMPILE_LENGTH_MULTIPLE,
    HostValues,
    LogWindow,
    compile_forward_loss,
    cuda_graphs,
    eta_step_seconds,
    forward_loss,
    log_step,
    ppl_text,
    seconds_left,
    step_stats,
)
from mtcli.train.validation import METRIC_NAMES, Bests, validation_loss, validation_scores

STATE_FORMAT = 1
#: A validation's numbers, as a checkpoint records them (``by``: the one that decided, see Bests).
VALID_KEYS = ("loss", "nll", "ppl", "bleu", "chrf", "by", "basis")


class Trainer:
    """Holds the model, optimiser, data stream and bookkeeping of one run; :meth:`run` trains."""

    def __init__(self, config: Config, info: DistInfo, device: torch.device,
                 corpus: PreparedCorpus, run_dir: Path, signals: StopSignals | None = None) -> None:
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
        self.scaler = LossScaler(device.type) if self.cfg.precision == "fp16" else None
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
        self.feed = BatchFeed(self.stream, device, COMPILE_LENGTH_MULTIPLE if self.cfg.compile else 0)
        self.step = 0
        self.bests = Bests.of(config)
        self.nonfinite_in_row = 0
        self.elapsed = 0.0
        self.last_valid: dict[str, Any] = dict.fromkeys(VALID_KEYS)
        self.last_valid_step = -1
        self.log_window = LogWindow()
        self.resumed_from: str | None = None
        self.writer: Scalars | None = None
        self.signals = signals or StopSignals()  # train() keeps them past the loop (run.py)
        self._tokens_done = 0
        self._train_seconds = 0.0
        self._clock = time.monotonic()
        # the last step's and the last validation's (with its save) wall time: a time limit stops
        # early enough for one more of each to fit, so the final validation ends within it
        self._step_seconds = 0.0
        self._valid_seconds = 0.0
        # a step queued on the device, not yet counted: (its sums, lr, norm?, epoch)
        self._pending: tuple[HostValues, float, bool, int] | None = None
        # the fused Adam kernel can skip a non-finite step on the device (found_inf)
        self._skips_on_device = bool(self.optimizer.defaults.get("fused")) and self.scaler is None

    # ----------------------------------------------------------------- resume

    def resume(self, path: Path, state: dict[str, Any], parent_checked: bool = False) -> None:
        """Restore everything a checkpoint holds; refuses incompatible configs and vocabularies
        (``parent_checked``: :func:`~mtcli.train.resume.check_resume_config`)."""
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, expected {STATE_FORMAT}")
        for change in resume_changes(state, self.config.to_dict(), self.info.world_size, str(path),
                                     hardware(self.device), parent_checked, self.run_dir):
            # a resume that is no longer exact is warned of: the run will not match an unbroken one
            (self.log.warning if INEXACT in change else self.log.info)("config change on resume: %s", change)
        vocab = state.get("vocab") or {}
        if vocab.get("spm_sha256") not in (None, self.spm_sha256):
            self.spm_sha256 = kept_model_sha256(self.run_dir, vocab["spm_sha256"], self.corpus.spm_path) or self.spm_sha256
        if vocab.get("spm_sha256") not in (None, self.spm_sha256) or \
                int(vocab.get("size", self.corpus.vocab_size)) != self.corpus.vocab_size:
            raise CheckpointError(f"{path}: the checkpoint's SentencePiece model differs from {self.corpus.spm_path} "
                                  "(the cache was re-prepared); use a new run directory")
        check_resume_data(state.get("data") or {}, self.corpus.content_sha256(), str(path), self.corpus.directory)
        try:
            self.model.load_state_dict(state["model"])
            restore_adam(self.optimizer, state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot restore model/optimizer ({one_line(exc)}): it was trained with other "
                                  "settings, or by another mtcli; a new run directory can start from its weights "
                                  f"(--init-from {self.run_dir})") from None
        self.schedule.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.stream.load_state_dict(state["data_state"])
        self.step = int(state["step"])
        if self.step > 0:  # the rate as the last update left it (the scale is not saved)
            self._cool_down(self.step - 1)
        ts = state.get("train_state") or {}
        for note in self.bests.load_state_dict(ts, (state.get("config") or {}).get("train") or {}):
            self.log.info("%s", note)
        self.nonfinite_in_row = int(ts.get("nonfinite_in_row", 0))
        self.elapsed = float(ts.get("elapsed_seconds", 0.0))
        self.last_valid_step = int(ts.get("last_valid_step", -1))
        self._tokens_done = int(ts.get("tokens_done", 0))
        self._train_seconds = float(ts.get("train_seconds", 0.0))
        self._step_seconds = float(ts.get("step_seconds", 0.0))
        self._valid_seconds = float(ts.get("valid_seconds", 0.0))
        self.log_window.load_state_dict(ts.get("log_window") or {})
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
        reads it weights-only). ``rng_ranks``: every rank's RNG states
        (:func:`~mtcli.train.distributed.gather_rng_states`). ``rng`` is rank 0's; the whole list
        is saved under a multi-process run so that each rank resumes its own dropout masks."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "epoch": self.feed.position["epoch"],
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
            "rng": rng_ranks[0],
            **({"rng_ranks": rng_ranks} if len(rng_ranks) > 1 else {}),
            "data_state": self.feed.position,
            "world_size": self.info.world_size,
            "hardware": hardware(self.device),
            "train_state": {
                **self.bests.state_dict(),
                "nonfinite_in_row": self.nonfinite_in_row,
                "elapsed_seconds": self.elapsed,
                "last_valid_step": self.last_valid_step,
                "log_window": self.log_window.state_dict(),
                "tokens_done": self._tokens_done,
                "train_seconds": self._train_seconds,
                # what a time limit looks ahead by: a resume stops at once when they do not fit
                "step_seconds": self._step_seconds,
                "valid_seconds": self._valid_seconds,
            },
            "config": self.config.to_dict(),
            "config_file": str(Path(self.config.path).absolute()) if self.config.path != "<config>" else None,
            "vocab": {"size": int(self.corpus.vocab_size), "spm_sha256": self.spm_sha256},
            "data": self.corpus.content_sha256(),
            "valid": {k: self.last_valid.get(k) for k in VALID_KEYS},
        }

    # ----------------------------------------------------------------- one step

    def train_step(self, group: StepGroup,
                   batches: list[Batch | PackedBatch] | None = None) -> list[dict[str, float] | None]:
        """Forward/backward this rank's ``batches`` of ``group`` (collated here if not given) and
        update. Returns the steps this call counted, oldest first (None for a skipped one): this
        one, or the one before it, or both (:meth:`_update_on_device`); :meth:`settle` counts a
        step still pending."""
        model = self.ddp or self.model
        model.train()
        total_tokens = group.target_tokens(self.stream.tgt_lengths)
        scale = 1.0 / max(total_tokens, 1)  # the ranks' gradients are summed
        mine = self.feed.collate(group) if batches is None else batches
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
            loss_acc += logged + 0.0 * loss.detach()  # nan when what was backpropagated is not finite
            nll_acc += nll
            tokens += batch.tgt_tokens
            real += batch.src_tokens + batch.tgt_tokens
            padded += batch.padded_tokens
        if self.step + 1 < self.cfg.max_steps:  # the next step's batches, before the host waits for the device
            self.feed.prefetch()
        if self._skips_on_device:
            return self._update_on_device(loss_acc, nll_acc, float(tokens), float(real), float(padded), group.epoch)
        return [self._update(loss_acc, nll_acc, tokens, real, padded, group.epoch)]

    def _update(self, loss_acc: Tensor, nll_acc: Tensor, tokens: int, real: int, padded: int,
                epoch: int) -> dict[str, float] | None:
        """The update after waiting for the step's sums (summed over the ranks under DDP; fp16's
        gradient scaler): skipped on the host when they are not finite."""
        stop = self.signals.flag()
        loss_sum, nll_sum, tokens_f, real_f, padded_f, stop_any = all_sum(
            [float(loss_acc), float(nll_acc), float(tokens), float(real), float(padded), stop],
            self.info, self.device,
        )
        self.signals.agree(stop_any)
        if self.scaler is not None and math.isfinite(loss_sum):
            self.scaler.unscale_(self.optimizer)
        shown = self.cfg.clip_norm > 0 or (self.step + 1) % self.cfg.log_every == 0
        # measured at every step: a non-finite gradient skips the update, clip_norm 0 or not
        grad_norm = float(self._grad_norm()) if math.isfinite(loss_sum) else float("nan")
        self._cool_down()  # this update's rate, before the scaler's step takes it
        lr = self.schedule.lr
        if self.scaler is not None and math.isfinite(loss_sum) and not self.scaler.checked_step(self.optimizer,
                                                                                                 self.step + 1):
            self.optimizer.zero_grad(set_to_none=True)  # an overflow: the step taken again with the next batches
            return None
        if not math.isfinite(loss_sum) or not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self._skip_update(epoch)
            return None
        if self.scaler is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._count(step_stats(loss_sum, nll_sum, tokens_f, real_f, padded_f, lr,
                                      grad_norm if shown else float("nan")))

    def _update_on_device(self, loss_acc: Tensor, nll_acc: Tensor, tokens: float, real: float, padded: float,
                          epoch: int) -> list[dict[str, float] | None]:
        """The update without waiting for the device: a non-finite loss or gradient norm makes
        the fused Adam kernel skip it there (``found_inf``), and the host reads the step's sums
        a step later, once the next step's kernels are queued, so the device is not left idle
        between steps. Under DDP the sums and the stop flag are summed over the ranks on the
        device too. The last step is counted before this update is queued, so its number and
        learning rate are exact. A step that logs, validates or ends the run is counted at once."""
        counted = [self.settle()] if self._pending is not None else []
        number = self.step + 1
        shown = self.cfg.clip_norm > 0 or number % self.cfg.log_every == 0
        stop = self.signals.flag()
        counts = to_device(torch.tensor([tokens, real, padded, stop], dtype=torch.float64), self.device)
        sums = all_sum_queued(torch.cat([torch.stack([loss_acc, nll_acc]), counts]), self.info)
        norm = self._grad_norm()  # at every step: a non-finite gradient skips the update, clip_norm 0 or not
        finite = torch.isfinite(sums[0]) & torch.isfinite(norm)
        self._cool_down()
        lr = self.schedule.lr
        self.optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = (HostValues(torch.cat([sums, norm.double().view(1)])), lr, shown, epoch)
        if number % self.cfg.log_every == 0 or number % self.cfg.valid_every == 0 or number >= self.cfg.max_steps:
            counted.append(self.settle())
        return counted

    def settle(self) -> dict[str, float] | None:
        """Count the step whose update is queued on the device (:meth:`_update_on_device`), or
        its skip; its stats (None: skipped, or none pending)."""
        if self._pending is None:
            return None
        sums, lr, shown, epoch = self._pending
        self._pending = None
        loss_sum, nll_sum, tokens, real, padded, stop_any, grad_norm = sums.read()
        self.signals.agree(stop_any)
        if not math.isfinite(loss_sum) or not math.isfinite(grad_norm):
            self._skip_update(epoch)  # the device skipped the update already
            return None
        return self._count(step_stats(loss_sum, nll_sum, tokens, real, padded, lr,
                                      grad_norm if shown else float("nan")))

    def _count(self, stats: dict[str, float]) -> dict[str, float]:
        """Count an update: the step number, the schedule, the log window and the token total."""
        self.schedule.step()
        self.nonfinite_in_row = 0
        self.step += 1
        self.log_window.add(stats)
        self._tokens_done += int(stats["tokens"])
        return stats

    def _cool_down(self, done: int | None = None) -> None:
        """``train.cooldown_steps``: scale the next update's rate down (the update is step + 1,
        or ``done`` + 1; the last one, max_steps, gets 1/cooldown)."""
        if self.cfg.cooldown_steps > 0:
            self.schedule.set_scale(cooldown_scale(self.step if done is None else done, self.cfg.max_steps,
                                                   self.cfg.cooldown_steps))

    def _grad_norm(self) -> Tensor:
        """The gradient norm (on the device), the gradients clipped to ``train.clip_norm`` when
        that is > 0 (the norm measured alone: ``clip_grad_norm_`` also multiplies every gradient by
        1 when nothing clips, ten times the norm's cost on a CPU; docs/performance.md)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if self.cfg.clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.clip_norm, norm)
        return norm

    def _skip_update(self, epoch: int) -> None:
        """Count a step skipped for a non-finite loss or gradient norm; raise
        :class:`TrainingError` after ``max_nonfinite`` in a row."""
        self.nonfinite_in_row += 1
        self.log.warning("non-finite loss/gradient at step %d (epoch %d): update skipped (%d in a row)",
                         self.step + 1, epoch, self.nonfinite_in_row)
        if self.nonfinite_in_row >= self.cfg.max_nonfinite:
            raise TrainingError(
                f"{self.nonfinite_in_row} non-finite losses or gradients in a row at step {self.step + 1} "
                f"(train.max_nonfinite={self.cfg.max_nonfinite}); lower "
                + (f"train.lr_factor (now {self.cfg.lr_factor:g})" if self.cfg.lr_schedule == "noam"
                   else f"train.lr (now {self.cfg.lr:g})")
                + (", set train.clip_norm" if self.cfg.clip_norm <= 0 else "") + ", or check the data"
            )

    # ----------------------------------------------------------------- validation

    def validate(self) -> dict[str, Any]:
        """Rank 0 computes loss/NLL/ppl/BLEU/chrF (RNG untouched); every rank gets the numbers."""
        values = [float("nan")] * 4
        if self.info.is_main:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), self.signals.cutting(not self.info.distributed):
                loss, nll, tokens = validation_loss(self.model, self.criterion, self.corpus,
                                                    self.config, self.device)
                scores = (validation_scores(self.model, self.corpus, self.config, self.device)
                          if self.cfg.valid_bleu else {})
            values = [loss / max(tokens, 1), nll / max(tokens, 1), scores.get("bleu", math.nan),
                      scores.get("chrf", math.nan)]
        loss, nll, bleu, chrf = broadcast(values, self.info, self.device)
        result = {"loss": loss, "nll": nll, "ppl": math.exp(min(nll, 700.0)),
                  "bleu": None if math.isnan(bleu) else bleu, "chrf": None if math.isnan(chrf) else chrf}
        result["by"], result["basis"] = self.bests.deciding(result), self.bests.basis
        self.last_valid, self.last_valid_step = result, self.step
        result["improved"] = improved = self.bests.update(result)
        decoded = "n/a" if result["bleu"] is None else f"{bleu:.2f} | chrf {chrf:.2f}"
        self.log.info("valid step %d | loss %.4f | nll %.4f | ppl %s | bleu %s%s", self.step, loss,
                      nll, ppl_text(result["ppl"]), decoded, " | best" if improved else "")
        if self.writer is not None:
            for key in ("loss", "nll", "ppl", "bleu", "chrf"):
                if result[key] is not None:
                    self.writer.add_scalar(f"valid/{key}", result[key], self.step)
            self.writer.flush()
        return result

    # ----------------------------------------------------------------- checkpoints

    def save(self, *, validated: bool, improved: bool = False) -> None:
        """Rank 0 writes checkpoint_last (and, after a validation, the step/best files and index).

        Every rank calls this at the same step (the stop rules and signals are agreed on across
        ranks), since the ranks' RNG states are gathered first."""
        self.settle()  # a step still pending is part of the state
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
        if cfg.max_epochs > 0 and self.feed.position["epoch"] >= cfg.max_epochs:
            return f"max_epochs={cfg.max_epochs}"
        if cfg.patience > 0 and self.bests.bad_validations >= cfg.patience:
            return f"patience={cfg.patience} (no better validation {METRIC_NAMES[self.bests.best_by or 'loss']})"
        if cfg.max_minutes > 0:
            # rank 0's clock decides for every rank. The run stops if one more step and the
            # final validation would end past the limit (a safety cap: a recipe budgets steps).
            spent, ahead = broadcast([self.elapsed + (time.monotonic() - self._clock),
                                       self._step_seconds + self._valid_seconds], self.info, self.device)
            if spent + ahead > cfg.max_minutes * 60:
                return f"max_minutes={cfg.max_minutes:g}"
        return None

    def finished(self) -> str | None:
        """The stop reason of a resumed run with nothing left to do (its last step validated
        and saved: a finished run given again, with other settings or not), else None."""
        reason = self.stop_reason()
        return reason if reason is not None and self.last_valid_step == self.step else None

    def _interrupt(self) -> None:
        signum = int(self.signals.signum or signal.SIGTERM)
        self.save(validated=False)
        name = signal.Signals(signum).name
        raise TrainingInterrupted(f"training interrupted by {name} at step {self.step}; checkpoint_last saved in "
                                  f"{self.ckpt_dir} (run the same command again to resume)", signum)

    def run(self) -> str:
        """Train until a stop rule fires; returns the stop reason."""
        cfg = self.cfg
        self._clock = time.monotonic()
        # under a wall-clock limit max_steps is a far ceiling: the bar counts steps, no ETA
        total = None if cfg.max_minutes > 0 else cfg.max_steps
        bar = progress(total=total, initial=self.step, enabled=cfg.progress and self.info.is_main,
                       terminal_only=True, desc="train", unit="step")  # train.log has the rest
        window_tokens = 0.0
        window_start = time.monotonic()
        warmup: float | None = None  # the first step of this process, in the first window only
        try:
            if self.step > 0 and self.step % cfg.valid_every == 0 and self.last_valid_step != self.step:
                self._validate_and_save()  # a stop signal came at this step, before its validation
            while True:
                reason = self.stop_reason()
                if reason is not None:
                    break
                if self.signals.signum is not None and not self.info.distributed:
                    self._interrupt()
                step_start = time.monotonic()
                group, batches = self.feed.next()
                counted = self.train_step(group, batches)  # the steps counted by now, or none yet
                self._step_seconds = time.monotonic() - step_start
                self._train_seconds += self._step_seconds
                warmup = self._step_seconds if warmup is None else warmup
                for stats in filter(None, counted):
                    window_tokens += stats["tokens"]
                    bar.update(1)
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}", refresh=False)
                stats = counted[-1] if counted else None  # a step that logs or validates is counted last
                if stats is not None and self.step % cfg.log_every == 0:
                    seconds = max(time.monotonic() - window_start, 1e-9)
                    tps = window_tokens / seconds
                    mean = self.log_window.take()
                    mean.update(lr=stats["lr"], grad_norm=stats["grad_norm"], peak_mem_mb=peak_memory_mb(self.device))
                    bar.set_postfix(loss=f"{mean['loss']:.3f}", lr=f"{mean['lr']:.2e}", tok_s=f"{tps:.0f}")
                    left = seconds_left(cfg, self.step, self.stream, eta_step_seconds(seconds, cfg.log_every, warmup or 0.0),
                                        self._valid_seconds, self.elapsed + time.monotonic() - self._clock)
                    log_step(self.log, self.writer, self.step, group.epoch, mean, tps, left)
                    window_tokens, window_start, warmup = 0.0, time.monotonic(), 0.0
                if self.signals.stop_now(self.info.distributed):  # after the step's log line; its validation runs on resuming
                    self._interrupt()
                if stats is not None and self.step % cfg.valid_every == 0:
                    self._validate_and_save()
                    window_start += self._valid_seconds  # a window's time is its steps': its tokens stay
                    warmup = 0.0
            self.settle()
            if self.last_valid_step != self.step:  # else this step's file, and last and best with it, is saved
                self._validate_and_save()
            return reason
        finally:
            bar.close()

    def _validate_and_save(self) -> None:
        """Validate, write the step's checkpoint, and time both (a time limit keeps room for them)."""
        start = time.monotonic()
        try:
            result = self.validate()
        except ValidationCut:  # a stop signal during it: checkpoint_last, and the resume validates this step
            self._interrupt()
        self.save(validated=True, improved=result["improved"])
        self._valid_seconds = time.monotonic() - start

    @property
    def tokens_per_second(self) -> float:
        """Mean target tokens/s over the run's training steps (validation excluded), counting
        the processes before a resume too (their totals are saved in the checkpoint)."""
        return self._tokens_done / self._train_seconds if self._train_seconds > 0 else 0.0
