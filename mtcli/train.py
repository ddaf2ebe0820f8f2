"""``mtcli train``: the training loop, validation, checkpoints, exact resume and DDP.

One optimiser step, as in "Attention Is All You Need" (section 5):

1. take the step's group of ``update_freq * world_size`` token batches from the deterministic
   :class:`~mtcli.batching.BatchStream`; this rank runs every ``world_size``-th of them;
2. for each, forward (bf16 autocast if ``train.bf16``), label-smoothed loss summed over target
   tokens, and backward of ``loss * world_size / N`` where ``N`` is the target-token count of
   the whole group (known on every rank from the cached lengths). DDP averages gradients over
   ranks, so the gradient is d/dtheta [sum of losses / N]: the same as one process running the
   whole group with ``update_freq`` accumulation;
3. a non-finite loss or gradient norm skips the update (gradients zeroed, logged;
   ``max_nonfinite`` in a row raise :class:`TrainingError`); otherwise clip the gradient norm
   (``clip_norm`` > 0), Adam step, Noam schedule step.

Every ``valid_every`` steps and at the end, rank 0 validates (loss, NLL, perplexity, and BLEU of
greedy decoding when ``valid_bleu``) and writes ``checkpoint_<step>.pt`` once, with
``checkpoint_last.pt`` and ``checkpoint_best.pt`` (by BLEU, or loss without BLEU) as hard links to
it (copies where links fail), and ``checkpoints/index.json``.

A run directory with a checkpoint is resumed exactly: model, optimiser, schedule step, the RNG
states (python, numpy, torch, cuda), the data position ``(epoch, batch)``, best score, patience
counter and elapsed time all come back, so N steps straight and N/2 + N/2 give the same
parameters. SIGINT/SIGTERM finish the current step, write ``checkpoint_last.pt`` and raise
:class:`TrainingInterrupted` (exit code 128 + signal).

Under ``torchrun --nproc_per_node=N`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the model is
wrapped in DistributedDataParallel (NCCL on CUDA, gloo on CPU); only rank 0 writes files and
validates. Every rank's RNG states are gathered into the checkpoint (``rng_ranks``), so a resumed
multi-process run with dropout is exact on every rank when resumed with the same process count;
with another count, rank 0 takes the saved rank 0's states and the others reseed from
``(seed, rank, step)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import shutil
import signal
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mtcli.allocator import keep_freed_memory
from mtcli.batching import (
    BatchStream,
    StepGroup,
    collate,
    filter_by_length,
    make_batches,
)
from mtcli.config import Config, save_config
from mtcli.corpus import read_lines
from mtcli.device import device_has_bf16_units, resolve_device
from mtcli.epoch_pairs import output_vocabulary, training_resegmenter
from mtcli.errors import CheckpointError, DataError, TrainingError, TrainingInterrupted
from mtcli.fileio import atomic_write, sha256_file
from mtcli.logs import add_file_log, get_logger, progress, remove_log_handler
from mtcli.loss import LabelSmoothedLoss, perplexity, rdrop_loss
from mtcli.schedule import build_optimizer, build_schedule, cooldown_scale

STATE_FORMAT = 1


# --------------------------------------------------------------------------- results


@dataclass
class TrainSummary:
    """What a finished (or already finished) run reports."""

    run_dir: Path
    steps: int
    epochs: int
    stop_reason: str
    best_valid_bleu: float | None
    best_valid_loss: float | None
    last_valid: dict[str, Any] = field(default_factory=dict)
    elapsed_seconds: float = 0.0
    tokens_per_second: float = 0.0
    parameters: int = 0
    skipped_pairs: int = 0
    resumed_from: str | None = None
    rank: int = 0

    @property
    def is_main(self) -> bool:
        """The summary of rank 0 (the only process whose summary goes to the console)."""
        return self.rank == 0

    def summary(self) -> str:
        """A few lines for the terminal."""
        bleu = "n/a" if self.best_valid_bleu is None else f"{self.best_valid_bleu:.2f}"
        loss = "n/a" if self.best_valid_loss is None else f"{self.best_valid_loss:.4f}"
        lines = [
            f"run dir: {self.run_dir}",
            f"stopped: {self.stop_reason} after {self.steps} steps, {self.epochs} epochs, "
            f"{self.elapsed_seconds / 60:.1f} min of training",
            f"best valid BLEU: {bleu}   best valid loss: {loss}",
            f"parameters: {self.parameters:,}   skipped training pairs: {self.skipped_pairs}   "
            f"train tokens/s: {self.tokens_per_second:,.0f}",
        ]
        if self.resumed_from:
            lines.append(f"resumed from: {self.resumed_from}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- environment


@dataclass
class DistInfo:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs to TensorBoard and validates."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistInfo:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (as set by torchrun)."""
        try:
            return cls(
                rank=int(os.environ.get("RANK", "0")),
                world_size=int(os.environ.get("WORLD_SIZE", "1")),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            )
        except ValueError:
            raise TrainingError("RANK/WORLD_SIZE/LOCAL_RANK must be integers") from None


def _init_distributed(info: DistInfo, device: torch.device) -> None:
    if not info.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size)
    info.initialized_here = True


def _all_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Element-wise sum over ranks (identity in one process)."""
    if not info.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def _gather_rng_states(info: DistInfo, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's :func:`get_rng_state`, in rank order, on every rank (one entry in one process)."""
    mine = get_rng_state(device)
    if not info.distributed:
        return [mine]
    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states


def _broadcast(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Rank 0's values on every rank (the other ranks wait here while rank 0 validates)."""
    if not info.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


class StopSignals:
    """Record SIGINT/SIGTERM instead of dying, so the loop can checkpoint and stop cleanly."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            get_logger().warning("received %s: finishing this step, then saving checkpoint_last",
                                 signal.Signals(signum).name)
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- RNG state


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) generator states as plain lists/tensors (weights-only safe)."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [int(version), list(internal), gauss],
        "numpy": [str(key), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`get_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    key, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((key, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- run directory


def _copy_file(src: Path, dst: Path) -> None:
    with atomic_write(dst, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out)


def setup_run_dir(config: Config, corpus: Any, run_dir: Path) -> None:
    """Write config.yaml, spm.model, manifest.json and text/<split>.<lang> (the self-contained run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    _copy_file(corpus.spm_path, run_dir / "spm.model")
    _copy_file(corpus.directory / "manifest.json", run_dir / "manifest.json")
    splits = [config.data.valid_split, *config.data.test_splits]
    for split in dict.fromkeys(splits):
        if split not in corpus.splits:
            continue
        for lang in (config.data.src_lang, config.data.tgt_lang):
            _copy_file(corpus.text_path(split, lang), run_dir / "text" / f"{split}.{lang}")


def _bleu_tools() -> tuple[Any, Any] | None:
    try:
        from mtcli.evaluate import score
        from mtcli.translate import translate_texts
    except ImportError as exc:
        get_logger().warning("validation BLEU is unavailable (%s)", exc)
        return None
    return translate_texts, score


def _finite(x: float) -> bool:
    return math.isfinite(x)


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Holds the model, optimiser, data stream and bookkeeping of one run; :meth:`run` trains."""

    def __init__(self, config: Config, info: DistInfo, device: torch.device, corpus: Any,
                 run_dir: Path) -> None:
        self.config = config
        self.cfg = config.train
        self.info = info
        self.device = device
        self.corpus = corpus
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.log = get_logger()
        self.spm_sha256 = sha256_file(corpus.spm_path)

        from mtcli.model import Transformer, count_parameters

        seed_everything(self.cfg.seed)  # identical initial weights on every rank
        output_ids = output_vocabulary(corpus, config)
        self.model = Transformer(config.model, corpus.vocab_size, output_ids=output_ids).to(device)
        self.parameters = count_parameters(self.model)
        if info.rank > 0:  # different dropout masks per rank
            torch.manual_seed(self.cfg.seed * 1_000_003 + info.rank * 10_007)
        self.ddp: nn.Module | None = None
        self.criterion = LabelSmoothedLoss(self.cfg.label_smoothing, pad_id=0)
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.schedule = build_schedule(self.optimizer, config.model.d_model, self.cfg)
        data = config.data
        self.stream = BatchStream(
            corpus.array(data.train_split, data.src_lang),
            corpus.array(data.train_split, data.tgt_lang),
            max_tokens=self.cfg.max_tokens,
            max_source_length=min(self.cfg.max_source_length, config.model.max_positions - 1),
            max_target_length=min(self.cfg.max_target_length, config.model.max_positions - 1),
            seed=self.cfg.seed,
            update_freq=self.cfg.update_freq,
            world_size=info.world_size,
            rank=info.rank,
            resegment=training_resegmenter(corpus, config),
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
        self.writer: Any = None
        self.signals = StopSignals()
        self._bleu = _bleu_tools() if (self.cfg.valid_bleu and info.is_main) else None
        self._tokens_done = 0
        self._train_seconds = 0.0
        self._clock = time.monotonic()
        # the last step's and the last validation's (with its save) wall time: a time limit stops
        # early enough for one more of each to fit, so the final validation ends within it
        self._step_seconds = 0.0
        self._valid_seconds = 0.0

    # ----------------------------------------------------------------- resume

    def resume(self, path: Path, state: dict[str, Any]) -> None:
        """Restore everything a checkpoint holds; refuses incompatible configs and vocabularies."""
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, expected {STATE_FORMAT}")
        from mtcli.checkpoint import check_resume_config

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
            raise CheckpointError(f"{path}: cannot restore model/optimizer ({str(exc).splitlines()[0]})") from None
        self.schedule.load_state_dict(state["scheduler"])
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
        """The checkpoint state (layout shared with mtcli.checkpoint; weights-only loadable).

        ``rng_ranks``: every rank's RNG states (:func:`_gather_rng_states`). ``rng`` is rank 0's;
        the whole list is saved under a multi-process run so that each rank resumes its own
        dropout masks."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "epoch": self.stream.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            "rng": rng_ranks[0],
            **({"rng_ranks": rng_ranks} if len(rng_ranks) > 1 else {}),
            "data_state": self.stream.state_dict(),
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.cfg.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def train_step(self, group: StepGroup) -> dict[str, float] | None:
        """Forward/backward this rank's batches of ``group`` and update; None if skipped."""
        model = self.ddp or self.model
        model.train()
        total_tokens = group.target_tokens(self.stream.tgt_lengths)
        scale = self.info.world_size / max(total_tokens, 1)
        mine = group.mine()
        loss_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        nll_acc = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = real = padded = 0
        rdrop = self.cfg.rdrop_alpha > 0
        for i, indices in enumerate(mine):
            batch = self.stream.collate(indices).to(self.device)
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            with sync:
                src, tgt_in = batch.src, batch.tgt_in
                if rdrop:  # the batch twice, as one: two dropout masks
                    src, tgt_in = torch.cat([src, src]), torch.cat([tgt_in, tgt_in])
                with self._autocast():
                    logits = model(src, tgt_in, shortlist=True)
                targets = self.model.output_targets(batch.tgt_out)
                if rdrop:
                    loss, out = rdrop_loss(self.criterion, logits, targets, self.cfg.rdrop_alpha)
                else:
                    out = self.criterion(logits, targets)
                    loss = out.loss
                (loss * scale).backward()
            loss_acc += out.loss.detach()
            nll_acc += out.nll
            tokens += batch.tgt_tokens
            real += batch.src_tokens + batch.tgt_tokens
            padded += batch.padded_tokens
        stop = 1.0 if self.signals.signum is not None else 0.0
        loss_sum, nll_sum, tokens_f, real_f, padded_f, stop_any = _all_sum(
            [float(loss_acc), float(nll_acc), float(tokens), float(real), float(padded), stop],
            self.info, self.device,
        )
        if stop_any > 0 and self.signals.signum is None:
            self.signals.signum = signal.SIGTERM  # another rank was signalled
        params = [p for p in self.model.parameters() if p.grad is not None]
        need_norm = self.cfg.clip_norm > 0 or (self.step + 1) % self.cfg.log_every == 0
        grad_norm = float("nan")
        if _finite(loss_sum) and need_norm:
            max_norm = self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not _finite(loss_sum) or (need_norm and not _finite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_row += 1
            self.log.warning("non-finite loss/gradient at step %d (epoch %d): update skipped (%d in a row)",
                             self.step + 1, group.epoch, self.nonfinite_in_row)
            if self.nonfinite_in_row >= self.cfg.max_nonfinite:
                raise TrainingError(
                    f"{self.nonfinite_in_row} non-finite losses in a row at step {self.step + 1} "
                    f"(train.max_nonfinite={self.cfg.max_nonfinite}); lower train.lr_factor, "
                    "set train.clip_norm, or check the data"
                )
            return None
        lr = self.schedule.lr
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

    # ----------------------------------------------------------------- validation

    @torch.no_grad()
    def valid_loss(self) -> tuple[float, float, int]:
        """Summed loss, NLL and target tokens on the validation split (pairs too long are skipped)."""
        data = self.config.data
        src = self.corpus.array(data.valid_split, data.src_lang)
        tgt = self.corpus.array(data.valid_split, data.tgt_lang)
        limit = self.config.model.max_positions - 1
        indices, skipped = filter_by_length(src.lengths, tgt.lengths, limit, limit)
        if self.cfg.valid_max_sentences > 0:
            indices = indices[indices < self.cfg.valid_max_sentences]
        if skipped:
            self.log.info("validation loss skips %d pairs longer than %d pieces", skipped, limit)
        loss = nll = 0.0
        tokens = 0
        self.model.eval()
        for batch_idx in make_batches(src.lengths, tgt.lengths, indices, self.cfg.max_tokens, shuffle=False):
            batch = collate(src, tgt, batch_idx).to(self.device)
            with self._autocast():
                logits = self.model(batch.src, batch.tgt_in, shortlist=True)
            out = self.criterion(logits, self.model.output_targets(batch.tgt_out))
            loss += float(out.loss)
            nll += float(out.nll)
            tokens += out.tokens
        return loss, nll, tokens

    def valid_bleu(self) -> float | None:
        """BLEU of greedy decoding on the validation split (None when decoding is unavailable)."""
        if self._bleu is None:
            return None
        translate_texts, score = self._bleu
        from mtcli.tokenizer import Tokenizer

        data = self.config.data
        sources = list(read_lines(self.corpus.text_path(data.valid_split, data.src_lang)))
        refs = list(read_lines(self.corpus.text_path(data.valid_split, data.tgt_lang)))
        if self.cfg.valid_max_sentences > 0:
            sources = sources[: self.cfg.valid_max_sentences]
            refs = refs[: self.cfg.valid_max_sentences]
        bundle = types.SimpleNamespace(model=self.model, tokenizer=Tokenizer(self.corpus.spm_path),
                                       config=self.config)
        greedy = dataclasses.replace(self.config.decode, beam_size=1, nbest=1, bf16=self.cfg.bf16)
        try:
            hyps = translate_texts(bundle, sources, greedy, self.device)
        except ImportError as exc:  # decoding not installed in this build
            self.log.warning("validation BLEU is unavailable (%s)", exc)
            self._bleu = None
            return None
        return float(score(hyps, refs)["bleu"])

    def validate(self) -> dict[str, Any]:
        """Rank 0 computes loss/NLL/ppl/BLEU (RNG untouched); every rank gets the numbers."""
        values = [float("nan")] * 3
        if self.info.is_main:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                loss, nll, tokens = self.valid_loss()
                bleu = self.valid_bleu()
            values = [loss / max(tokens, 1), nll / max(tokens, 1),
                      float("nan") if bleu is None else bleu]
        loss, nll, bleu = _broadcast(values, self.info, self.device)
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
        rng_ranks = _gather_rng_states(self.info, self.device)
        if not self.info.is_main:
            return
        from mtcli.checkpoint import (
            BEST_NAME,
            LAST_NAME,
            prune_checkpoints,
            save_checkpoint,
            step_checkpoint_name,
            update_index,
        )

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
        if cfg.max_epochs > 0 and self.stream.epoch >= cfg.max_epochs:
            return f"max_epochs={cfg.max_epochs}"
        if cfg.patience > 0 and self.bad_validations >= cfg.patience:
            return f"patience={cfg.patience} (no better validation {'BLEU' if self._uses_bleu() else 'loss'})"
        scale = 1.0
        if cfg.cooldown_steps > 0:  # the next update is step + 1; the last one (max_steps) gets 1/cooldown
            scale = cooldown_scale(self.step, cfg.max_steps, cfg.cooldown_steps)
        if cfg.max_minutes > 0:
            # rank 0's clock decides for every rank: the stop and the cool-down's rate. The run
            # stops if one more step and the final validation would end past the limit.
            spent, ahead = _broadcast([self.elapsed + (time.monotonic() - self._clock),
                                       self._step_seconds + self._valid_seconds], self.info, self.device)
            if spent + ahead > cfg.max_minutes * 60:
                return f"max_minutes={cfg.max_minutes:g}"
            if cfg.cooldown_minutes > 0:
                scale = min(scale, cooldown_scale(spent, cfg.max_minutes * 60, cfg.cooldown_minutes * 60))
        if cfg.cooldown_steps > 0 or cfg.cooldown_minutes > 0:
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
                group = self.stream.next_group()
                step_start = time.monotonic()
                stats = self.train_step(group)
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


# --------------------------------------------------------------------------- entry point


def open_corpus(config: Config) -> Any:
    """The prepared cache of ``config`` (checksums verified); DataError if it is missing or corrupt."""
    from mtcli.cache import PreparedCorpus

    path = config.data.prepared_path()
    if not path.is_dir():
        raise DataError(f"{path}: no prepared cache; run `mtcli prepare {config.path}` first")
    corpus = PreparedCorpus.open(path, verify=True)
    data = config.data
    for split in (data.train_split, data.valid_split):
        if split not in corpus.splits:
            raise DataError(f"{path}: the prepared cache has no split '{split}'; run `mtcli prepare "
                            f"{config.path} --force`")
    if (corpus.src_lang, corpus.tgt_lang) != (data.src_lang, data.tgt_lang):
        raise DataError(f"{path}: prepared for {corpus.src_lang}->{corpus.tgt_lang}, config says "
                        f"{data.src_lang}->{data.tgt_lang}")
    return corpus


def train(config: Config) -> TrainSummary:
    """Train (or resume) the run of ``config``; see the module docstring for the whole story."""
    log = get_logger()
    info = DistInfo.from_env()
    device = resolve_device(config.train.device, info.local_rank)
    if config.train.num_threads > 0:
        torch.set_num_threads(config.train.num_threads)
    keep_freed_memory()
    bf16_text = str(config.train.bf16)
    has_units = device_has_bf16_units(device)
    if config.train.bf16 == "auto":  # resolved here: the run's config.yaml and checkpoints say which
        bf16_text = f"{has_units} (auto: the {device.type} has {'' if has_units else 'no '}bf16 units)"
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, bf16=has_units))
    elif config.train.bf16 and device.type == "cpu" and not has_units:
        log.warning("train.bf16 on a CPU without bf16 matrix units (avx512_bf16/amx_bf16 in "
                    "/proc/cpuinfo): expect it to run many times slower than fp32 "
                    "(--set train.bf16=false, or auto)")
    if not info.is_main:  # one voice on the console: rank 0's
        log.setLevel(logging.WARNING)
    corpus = open_corpus(config)
    run_dir = config.run_path()
    _init_distributed(info, device)
    from mtcli.checkpoint import find_resume_checkpoint, remove_stale_temp_files
    from mtcli.runlock import RunLock

    with contextlib.ExitStack() as stack:
        if info.distributed and info.initialized_here:
            stack.callback(dist.destroy_process_group)
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            stack.enter_context(RunLock(run_dir))
            handler = add_file_log(run_dir / "train.log")
            stack.callback(remove_log_handler, handler)
            remove_stale_temp_files(run_dir)
        if info.distributed:
            dist.barrier()
        found = find_resume_checkpoint(run_dir)
        trainer = Trainer(config, info, device, corpus, run_dir)
        if found is not None:
            trainer.resume(*found)
        if info.is_main:
            setup_run_dir(config, corpus, run_dir)
            from torch.utils.tensorboard import SummaryWriter

            trainer.writer = SummaryWriter(str(run_dir / "tensorboard"),
                                           purge_step=trainer.step + 1 if found else None)
            stack.callback(trainer.writer.close)
        log.info("run dir %s | device %s | processes %d | bf16 %s | parameters %s", run_dir, device,
                 info.world_size, bf16_text, f"{trainer.parameters:,}")
        log.info("training pairs: %d kept, %d skipped (longer than %d/%d pieces) | epoch padding %.3f",
                 len(trainer.stream.indices), trainer.stream.skipped, config.train.max_source_length,
                 config.train.max_target_length, trainer.stream.padding_fraction())
        if trainer.model.output_ids is not None:
            log.info("output vocabulary: the %d of %d pieces the training targets use "
                     "(model.output_vocab: target)", trainer.model.output_ids.numel(), trainer.corpus.vocab_size)
        if config.train.subword_alpha > 0:
            log.info("subword regularisation: a sampled segmentation per epoch (alpha %g, %s; %d "
                     "target pieces in this epoch)", config.train.subword_alpha,
                     "both sides" if config.train.subword_sides == "both" else "source only",
                     int(trainer.stream.tgt_lengths[trainer.stream.indices].sum()))
        if config.train.bidirectional_epochs > 0:
            log.info("bidirectional training: epochs 1-%d read every pair in both directions "
                     "(%s<->%s), then %s->%s only", config.train.bidirectional_epochs,
                     config.data.src_lang, config.data.tgt_lang, config.data.src_lang,
                     config.data.tgt_lang)
        if info.distributed:
            trainer.ddp = nn.parallel.DistributedDataParallel(
                trainer.model, device_ids=[device.index] if device.type == "cuda" else None
            )
        with trainer.signals:
            reason = trainer.run()
        log.info("stopped at step %d: %s", trainer.step, reason)
        if trainer.writer is not None:
            from mtcli.plots import write_learning_curves

            trainer.writer.flush()
            picture = write_learning_curves(run_dir)
            if picture is not None:
                log.info("learning curves: %s", picture)
        return TrainSummary(
            run_dir=run_dir,
            steps=trainer.step,
            epochs=trainer.stream.epoch,
            stop_reason=reason,
            best_valid_bleu=trainer.best_bleu,
            best_valid_loss=trainer.best_loss,
            last_valid=dict(trainer.last_valid),
            elapsed_seconds=trainer.elapsed,
            tokens_per_second=trainer.tokens_per_second,
            parameters=trainer.parameters,
            skipped_pairs=trainer.stream.skipped,
            resumed_from=trainer.resumed_from,
            rank=info.rank,
        )


__all__ = ["DistInfo", "StopSignals", "TrainSummary", "Trainer", "train"]
