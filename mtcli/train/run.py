"""``mtcli train``: train (or resume) the run a config describes, start to finish.

:func:`train` opens the prepared cache, takes the run directory's lock, resumes from its newest
intact checkpoint when there is one, writes the self-contained run directory
(:mod:`mtcli.rundir`), builds the :class:`~mtcli.train.trainer.Trainer` (wrapped in
DistributedDataParallel under ``torchrun``), trains until a stop rule fires, and returns a
:class:`TrainSummary`. SIGINT/SIGTERM finish the current step, write ``checkpoint_last.pt`` and
raise :class:`~mtcli.errors.TrainingInterrupted` (exit code 128 + signal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mtcli import started_by
from mtcli.config import Config, load_config, save_config
from mtcli.data.cache import PreparedCorpus
from mtcli.data.freshness import open_prepared
from mtcli.data.vocabmap import tokenizer_files
from mtcli.data.workers import end_with_parent
from mtcli.device import (
    available_bytes,
    device_has_bf16_units,
    is_out_of_memory,
    memory_text,
    peak_memory_mb,
    resolve_device,
)
from mtcli.errors import ConfigError, DeviceMemoryError, TrainingInterrupted, one_line
from mtcli.fileio import atomic_copy, atomic_write, check_directory, sha256_file
from mtcli.logs import (
    add_file_log,
    failures_appended,
    failures_logged,
    get_logger,
    remove_log_handler,
)
from mtcli.metrics import phrase_bleu_note
from mtcli.model import Transformer, count_parameters
from mtcli.plots import write_learning_curves
from mtcli.rundir import (
    CONFIG_NAME,
    LAST_NAME,
    MANIFEST_NAME,
    SPM_NAME,
    TEXT_DIR,
    checkpoint_dir,
    names,
    step_checkpoints,
)
from mtcli.runlock import RunLock
from mtcli.settings import usable_cores
from mtcli.train.distributed import (
    DistInfo,
    PeerStopped,
    agree_on_data,
    agree_on_resume,
    init_distributed,
    leave_distributed,
    peer_failures,
    sum_gradients,
)
from mtcli.train.parent import PARENT_NAME, check_parent_unchanged, load_parent, start_from
from mtcli.train.rdrop import without_dropout
from mtcli.train.resume import (
    check_same_config_file,
    find_resume_checkpoint,
    finish_interrupted_save,
    kept_model_sha256,
    remove_stale_temp_files,
)
from mtcli.train.scalars import Scalars
from mtcli.train.signals import StopSignals
from mtcli.train.trainer import Trainer
from mtcli.train.validation import METRIC_NAMES, check_decode_width, check_validation

#: The run's log: with ``checkpoints/``, what tells a run's directory from another
LOG_NAME = "train.log"


@dataclass
class TrainSummary:
    """What a finished (or already finished) run reports."""

    run_dir: Path
    steps: int
    epochs: int  # passes over the training data completed
    stop_reason: str
    best_valid_bleu: float | None
    best_valid_loss: float | None
    best_valid_chrf: float | None = None
    best_by: str | None = None  # the metric checkpoint_best was chosen by (train.valid_metric, or loss)
    last_valid: dict[str, Any] = field(default_factory=dict)
    elapsed_seconds: float = 0.0
    tokens_per_second: float = 0.0
    parameters: int = 0
    skipped_pairs: int = 0
    resumed_from: str | None = None
    rank: int = 0
    device: str = ""
    peak_memory_mb: float = 0.0  # PyTorch's allocations on a GPU, the process's resident set on a CPU
    trained: bool = True  # False: the run was finished already, and this call trained nothing

    @property
    def is_main(self) -> bool:
        """The summary of rank 0 (the only process whose summary goes to the console)."""
        return self.rank == 0

    def summary(self) -> str:
        """A few lines for the terminal."""
        bleu, chrf = ("n/a" if v is None else f"{v:.2f}" for v in (self.best_valid_bleu, self.best_valid_chrf))
        loss = "n/a" if self.best_valid_loss is None else f"{self.best_valid_loss:.4f}"
        stopped = (f"stopped: {self.stop_reason} after {self.steps} steps" if self.trained else
                   f"nothing trained now: the run was at step {self.steps} already ({self.stop_reason})")
        lines = [
            f"run dir: {self.run_dir}",
            f"{stopped} ({self.epochs} full epoch{'' if self.epochs == 1 else 's'}), "
            f"{self.elapsed_seconds / 60:.1f} min of training",
            f"best valid BLEU: {bleu}   chrF: {chrf}   loss: {loss}   (each at its own best step; "
            f"checkpoint_best is the best by {METRIC_NAMES[self.best_by or 'loss']})",
            f"parameters: {self.parameters:,}   training pairs too long (never trained on): {self.skipped_pairs}"
            + (f"   train tokens/s: {self.tokens_per_second:,.0f}   peak memory: {self.peak_memory_mb:,.0f} MiB "
               f"on {self.device}" if self.trained else ""),
        ]
        if self.resumed_from:
            lines.append(f"resumed from: {self.resumed_from}")
        return "\n".join(lines)


def check_run_directory(run_dir: Path) -> None:
    """Raise an ``OSError`` naming ``run_dir`` when a run cannot be written there: a file in its
    way, or a directory of other files. A run writes ``config.yaml`` and more into its
    directory, so ``train.run_dir: .`` would overwrite a config of that name; a run's own
    directory (``checkpoints/`` or ``train.log``, even of a run stopped at its start) is resumed."""
    check_directory(run_dir)
    if checkpoint_dir(run_dir).exists() and not checkpoint_dir(run_dir).is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory; a run keeps its checkpoints in a directory of "
                                 "this name", str(checkpoint_dir(run_dir)))
    if (run_dir.is_dir() and any(run_dir.iterdir()) and not checkpoint_dir(run_dir).is_dir()
            and not (run_dir / LOG_NAME).is_file()):
        raise FileExistsError(errno.EEXIST, f"a directory of other files, not a run (it has no checkpoints/ or "
                              f"{LOG_NAME}); give train.run_dir a new or empty directory", str(run_dir))


def setup_run_dir(config: Config, corpus: PreparedCorpus, run_dir: Path, spm_sha256: str) -> None:
    """Write config.yaml, spm.model, manifest.json and text/<split>.<lang> (the self-contained run).
    The run keeps its own spm.model when its checkpoints name another file of the same model
    (``spm_sha256``: :func:`~mtcli.train.resume.kept_model_sha256`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir(run_dir).mkdir(exist_ok=True)
    try:  # said now, not at the first checkpoint, a validation interval of training later
        tempfile.TemporaryFile(dir=checkpoint_dir(run_dir)).close()
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}: no checkpoint could be saved there",
                      str(checkpoint_dir(run_dir))) from None
    # the run's own config.yaml names no run directory: it trains the run it lies in, moved or copied
    save_config(dataclasses.replace(config, train=dataclasses.replace(config.train, run_dir=None)),
                run_dir / CONFIG_NAME)
    for file in tokenizer_files(corpus.spm_path):  # spm.model; or vocab.json, source.spm, target.spm
        if file.name != SPM_NAME or sha256_file(file) == spm_sha256:  # else the run's own: the same model
            atomic_copy(file, run_dir / file.name)
    atomic_copy(corpus.directory / MANIFEST_NAME, run_dir / MANIFEST_NAME)
    splits = [config.data.valid_split, *config.data.test_splits]
    for name in (name for split in dict.fromkeys(splits) for name in corpus.eval_copies(split)):
        for lang in corpus.split_langs[name]:
            atomic_copy(corpus.text_path(name, lang), run_dir / TEXT_DIR / f"{name}.{lang}")


def keep_decode_settings(run_dir: Path, config: Config) -> str:
    """Write ``config``'s decode settings into a finished run's config.yaml, which ``evaluate``,
    ``translate`` and ``serve`` decode with: nothing else of it changes, as nothing was trained.
    Returns what to add to the log line ("" when they are the same)."""
    path = run_dir / CONFIG_NAME
    saved = load_config(path, lenient=True)
    if saved.decode == config.decode:
        return ""
    save_config(dataclasses.replace(saved, decode=config.decode), path)
    return " but for its decode settings, taken into config.yaml"


def resolve_precision(config: Config, device: torch.device) -> tuple[Config, str]:
    """``config`` with ``train.precision: auto`` resolved for ``device`` (the run's config.yaml
    and checkpoints then say which), and the text the run's first log line shows. auto is bf16
    where the device multiplies bf16 natively, else fp16 on a GPU (V100, T4: with a gradient
    scaler), else fp32. Warns when bf16 is asked for on a CPU without bf16 units, where it runs
    many times slower than fp32, and says so when fp32 is asked for on a GPU that has them
    (fp32 matrix products there run at a fraction of bf16's rate)."""
    has_units = device_has_bf16_units(device)
    precision = config.train.precision
    text = precision
    if precision == "auto":
        precision = "bf16" if has_units else "fp16" if device.type == "cuda" else "fp32"
        text = f"{precision} (auto: the {device.type} has {'' if has_units else 'no '}bf16 units)"
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
    elif precision == "fp16" and device.type == "cpu":
        get_logger().warning("train.precision fp16 on a CPU: expect it to run many times slower than fp32 (a CPU "
                             "has no fp16 matrix units; --set train.precision=auto)")
    elif precision == "bf16" and not has_units:
        get_logger().warning("train.precision bf16 on a %s without bf16 matrix units: expect it to run many "
                             "times slower than fp32 (--set train.precision=auto)", device.type)
    elif precision == "fp32" and device.type == "cuda" and has_units:
        get_logger().info("train.precision fp32 on a GPU with bf16 units: --set train.precision=auto trains "
                          "in bf16, faster where the matrix products are large (2.3x at the WMT14 base shape on "
                          "an H100; a step as small as Multi30k's ran faster in fp32)")
    return config, text


def idle_gpus_hint(device: torch.device, processes: int, gpus: int, max_tokens: int) -> str | None:
    """What to run when a plain ``mtcli train`` (one process, one GPU) starts on a machine with
    more GPUs: torchrun, one process a GPU, each with a share of the batch so that an update
    stays the same size. None otherwise."""
    if device.type != "cuda" or processes > 1 or gpus < 2:
        return None
    return (f"{gpus} GPUs are visible and this process trains on one: torchrun --nproc-per-node {gpus} "
            f"-m mtcli.cli train ... --set train.max_tokens={max_tokens // gpus} trains on all of them "
            "with the same update size")


def resolve_compile(config: Config, device: torch.device) -> Config:
    """``config`` with ``train.compile`` off where torch.compile cannot pay or cannot run, with a
    warning: kept on a CPU, where it makes the step slower; turned off on a GPU older than
    compute capability 7.0 (a P100), for which Triton, the compiler's GPU backend, has no
    kernels (the run's config.yaml then says so)."""
    log = get_logger()
    if not config.train.compile:
        return config
    if device.type == "cpu":
        log.warning("train.compile on a CPU: the compiled step ran at 0.4x the eager one on the Multi30k "
                    "recipe's shape (docs/performance.md); it pays on a GPU (--set train.compile=false trains eager)")
        return config
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 7:
        return config
    log.warning("train.compile needs a GPU of compute capability 7.0 or newer (Triton's); %s is %d.%d: "
                "training uncompiled", torch.cuda.get_device_name(device), major, minor)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, compile=False))


def _warn_of_pairs_over_the_budget(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int) -> None:
    """Warn of training pairs wider than a batch's token budget: each is a batch of its own,
    over the budget (on a GPU, the batch that runs out of memory, unexplained)."""
    width = np.maximum(src_lengths, tgt_lengths) + 1  # (pieces and </s>, as make_batches counts a pair)
    over = int((width > max_tokens).sum())
    if over:
        get_logger().warning("%d of %d training pairs are longer than train.max_tokens=%d tokens (the longest: %d): "
                             "each is a batch of its own, over the budget; raise train.max_tokens to at least %d, or "
                             "lower train.max_source_length and train.max_target_length", over, len(width), max_tokens,
                             int(width.max()), int(width.max()))


def _log_start(trainer: Trainer, config: Config, device: torch.device, precision_text: str) -> None:
    """The run's first log lines: where, on what, and what the training stream reads."""
    log, stream, train = get_logger(), trainer.stream, config.train
    log.info("run dir %s | device %s | processes %d | precision %s | parameters %s", trainer.run_dir,
             memory_text(device), trainer.info.world_size, precision_text, f"{trainer.parameters:,}")
    idle = idle_gpus_hint(device, trainer.info.world_size, torch.cuda.device_count(), train.max_tokens)
    if idle:
        log.warning(idle)
    log.info("training pairs: %d kept, %d skipped (longer than %d/%d pieces) | epoch padding %.3f",
             len(stream.indices), stream.skipped, stream.max_source_length, stream.max_target_length,
             stream.padding_fraction())
    if trainer.info.is_main and stream.skipped > 0.1 * (stream.skipped + len(stream.indices)):
        log.warning("%d of %d training pairs are longer than the limits and never trained on (%s)", stream.skipped,
                    stream.skipped + len(stream.indices), "train.pack_length" if stream.pack_length else
                    "train.max_source_length, train.max_target_length, model.max_positions")
    if trainer.info.is_main and stream.left_out:  # (the epoch's batches, made for its padding just above)
        log.info("this epoch's last %d batch(es), fewer than the %d processes, are left out of it (each epoch "
                 "shuffles anew)", stream.left_out, stream.world_size)
    if trainer.info.is_main and not stream.pack_length:
        _warn_of_pairs_over_the_budget(stream.src_lengths[stream.indices], stream.tgt_lengths[stream.indices],
                                       train.max_tokens)
    if stream.pack_length:
        compiled = (" (compiled for that shape, replayed as a CUDA graph)" if trainer.graphs else
                    " (compiled for that shape)" if train.compile else "")
        log.info("packed batches: %d rows of %d slots, pairs laid end to end%s", stream.pack_rows,
                 stream.pack_length, compiled)
    if stream.mix is not None:
        shares = stream.mix.shares(stream.indices)
        log.info("corpora drawn by weight: %s of an epoch's pairs", ", ".join(
            f"{c.source} {'->'.join(c.langs or ())}{' ' + c.tag if c.tag else ''} {100 * share:.3g}%"
            for c, share in zip(config.data.corpora(), shares, strict=True)))
    if trainer.info.is_main and (tagged := _only_tagged(config)):
        log.warning("%s: every corpus of it carries a tag; translate and evaluate give no tag, so they decode "
                    "input unlike any it trains on (leave one corpus of each direction untagged)", tagged)
    if trainer.info.is_main and train.rdrop_alpha > 0 and without_dropout(config.model):
        log.warning("train.rdrop_alpha %g with every model dropout at 0: R-Drop's two passes agree, so it only "
                    "doubles the step's cost (set model.dropout, or train.rdrop_alpha=0)", train.rdrop_alpha)
    note = phrase_bleu_note(config.data.tgt_lang) if train.valid_bleu and train.valid_metric == "bleu" else None
    if trainer.info.is_main and note:
        log.warning("%s; train.valid_metric: chrf picks checkpoint_best by it instead", note)
    rate = f"factor {train.lr_factor:g}" if train.lr_schedule == "noam" else f"peak {train.lr:g}"
    log.info("update: %d batch(es) of %d tokens a step a process | lr %s (%s, warmup %d%s) | label smoothing %g%s",
             train.update_freq, train.max_tokens, train.lr_schedule, rate, train.warmup_steps,
             f", cool-down {train.cooldown_steps}" if train.cooldown_steps else "", train.label_smoothing,
             f" | R-Drop alpha {train.rdrop_alpha:g} (two passes a batch)" if train.rdrop_alpha > 0 else "")
    ends = [f"train.{key}" for key in ("max_minutes", "max_epochs", "patience") if getattr(train, key) > 0]
    if trainer.info.is_main and train.cooldown_steps > 0 and ends:
        log.warning("train.cooldown_steps %d counts back from train.max_steps (%d): a run that %s ends first is not "
                    "cooled down", train.cooldown_steps, train.max_steps, " or ".join(ends))
    if trainer.info.is_main and train.warmup_steps > train.max_steps:  # every schedule warms up linearly
        log.warning("train.warmup_steps %d is past train.max_steps %d: the rate never reaches its peak, and ends "
                    "at %.0f%% of it", train.warmup_steps, train.max_steps, 100 * train.max_steps / train.warmup_steps)
    if trainer.info.is_main and train.lr_schedule == "noam" and train.lr_factor == 0:
        log.warning("train.lr_factor 0: the learning rate is 0 at every step, so the weights never change "
                    "(set train.lr_factor > 0 to train; the recipes use 1.0)")
    if trainer.model.output_ids is not None:
        log.info("output vocabulary: the %d of %d pieces the training targets use "
                 "(model.output_vocab: target)", trainer.model.output_ids.numel(), trainer.corpus.vocab_size)
    if train.subword_alpha > 0:
        log.info("subword regularisation: a sampled segmentation per epoch (alpha %g, %s; %d "
                 "target pieces in this epoch)", train.subword_alpha,
                 "both sides" if train.subword_sides == "both" else "source only",
                 int(stream.tgt_lengths[stream.indices].sum()))


def _draw_learning_curves(run_dir: Path) -> None:
    """``learning_curves.png`` of a finished training, or a warning: a picture that cannot be
    drawn (a full disk, the run's TensorBoard files gone) does not fail a training whose
    checkpoints are saved."""
    try:
        picture = write_learning_curves(run_dir)
    except Exception as exc:  # noqa: BLE001 - TensorBoard's readers raise their own kinds
        get_logger().warning("learning curves not drawn (%s); the training is saved",
                             getattr(exc, "strerror", None) or one_line(exc))
        return
    except BaseException:  # a Ctrl-C or SIGTERM while drawing: said, and the stop goes on
        get_logger().warning("learning curves not drawn (stopped); the training is complete and saved, and the "
                             "same command draws them")
        raise
    if picture is not None:
        get_logger().info("learning curves: %s", picture)


def _only_tagged(config: Config) -> str:
    """The directions whose every corpus carries a tag (``data.sources[i].tag``), e.g.
    ``en->cs``; "" when none."""
    corpora = config.data.corpora()
    directions = dict.fromkeys(tuple(c.langs or ()) for c in corpora)
    return ", ".join("->".join(d) for d in directions
                     if all(c.tag is not None for c in corpora if tuple(c.langs or ()) == d))


def _summary(trainer: Trainer, reason: str) -> TrainSummary:
    return TrainSummary(
        run_dir=trainer.run_dir,
        steps=trainer.step,
        epochs=trainer.feed.position["epoch"],
        stop_reason=reason,
        best_valid_bleu=trainer.bests.bleu,
        best_valid_loss=trainer.bests.loss,
        best_valid_chrf=trainer.bests.chrf,
        best_by=trainer.bests.best_by,
        last_valid=dict(trainer.last_valid),
        elapsed_seconds=trainer.elapsed,
        tokens_per_second=trainer.tokens_per_second,
        parameters=trainer.parameters,
        skipped_pairs=trainer.stream.skipped,
        resumed_from=trainer.resumed_from,
        rank=trainer.info.rank,
        device=str(trainer.device),
        peak_memory_mb=peak_memory_mb(trainer.device),
    )


def out_of_memory_error(config: Config, device: torch.device, trainer: Trainer, start: int) -> DeviceMemoryError:
    """What to do when a training step ran out of memory, after ``trainer.step`` steps (``start``
    of them before this process): smaller batches, and more of them a step to keep the update
    size; a resume may take them (the pairs the epoch has not seen are batched anew). A failure
    after steps that fitted is likelier the allocator's fragmentation, which a fresh process may
    not meet."""
    cfg = config.train
    where = f"out of memory on {memory_text(device)} after step {trainer.step}"
    smaller = (f"--set train.max_tokens={cfg.max_tokens // 2} --set train.update_freq={cfg.update_freq * 2}, "
               "the same update size")
    saved = any(checkpoint_dir(trainer.run_dir).glob("*.pt"))
    if not saved or trainer.step == start:
        return DeviceMemoryError(f"{where}: batches of train.max_tokens={cfg.max_tokens} do not fit; "
                                 f"{'resume' if saved else 'run again'} with smaller ones ({smaller})")
    allocator = " with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" if device.type == "cuda" else ""
    return DeviceMemoryError(f"{where}: run the same command{allocator} to resume from the last checkpoint; "
                             f"if it fails again, resume with smaller batches ({smaller})")


#: The bytes a parameter holds while it trains: its fp32 weight and gradient and Adam's two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def check_model(config: Config, corpus: PreparedCorpus, device: torch.device, processes: int = 1) -> None:
    """Refuse (:class:`ConfigError`), before the run directory is made, what the model's shape
    rules out: a ``decode.beam_size`` wider than its output vocabulary allows
    (:func:`check_decode_width`), and parameters that alone cannot train in the memory ``device``
    has free (``processes`` of them sharing one host's memory): a ``model.d_model`` of 65536 ran
    out of memory allocating 48 GiB, naming no key, and a huge ``model.d_ff`` after a first step,
    with advice to shrink the batches. The model is built on PyTorch's ``meta`` device, which
    allocates nothing."""
    output_ids = corpus.target_vocabulary() if config.model.output_vocab == "target" else None
    check_decode_width(config, corpus.vocab_size if output_ids is None else len(output_ids))
    with torch.device("meta"):  # (the output list is a buffer: the parameters are the same without it)
        model = Transformer(config.model, corpus.vocab_size)
    free, parameters = available_bytes(device), count_parameters(model)
    need = parameters * TRAINING_BYTES_PER_PARAMETER * (processes if device.type == "cpu" else 1)
    if free is not None and need > free:
        m = config.model
        shape = (f"model.d_model={m.d_model}, model.d_ff={m.d_ff}, {m.encoder_layers}+{m.decoder_layers} layers, "
                 f"a vocabulary of {corpus.vocab_size:,}")
        on = f"{processes} processes' " if processes > 1 and device.type == "cpu" else ""
        raise ConfigError(f"{config.path}: the model's {parameters / 1e6:,.1f}M parameters ({shape}) need "
                          f"{need / 2**30:,.1f} GiB to train ({on}weights, gradients and Adam's two moments, "
                          f"{TRAINING_BYTES_PER_PARAMETER} bytes a parameter), more than the {free / 2**30:,.1f} GiB "
                          f"free on {memory_text(device)}: make the model smaller")


def _join(config: Config, info: DistInfo, device: torch.device) -> PreparedCorpus:
    """Join the run's process group (under torchrun) and open the prepared cache, every rank
    agreeing on it: a rank that fails here stops the others with one line each (they waited
    30 s for it to join, or printed a traceback), and ranks of other caches are refused. A
    rank ends with its launcher (a torchrun killed by SIGKILL left its ranks training on): at
    once while it starts (nothing to save, and the wait to join ignores SIGTERM), then by
    SIGTERM, which saves ``checkpoint_last``."""
    launcher = started_by()
    if info.distributed:
        end_with_parent(launcher, signal.SIGKILL)
    with peer_failures(info):
        init_distributed(info, device)
        if info.distributed:
            end_with_parent(launcher)
        run_dir = config.run_path()
        begun = bool(step_checkpoints(run_dir)) or (checkpoint_dir(run_dir) / LAST_NAME).exists()
        corpus = open_prepared(config, check_inputs=info.is_main, resuming=begun)  # (one process reads its files)
        manifest = corpus.manifest
        agree_on_data((str(manifest.get("build_key")), str((manifest.get("spm") or {}).get("sha256"))), info)
    return corpus


def _keep_log(stack: contextlib.ExitStack, info: DistInfo, run_dir: Path) -> None:
    """Rank 0 locks the run and keeps its ``train.log``, which says why the run stopped; another
    rank appends why it stopped to that log (a stop that all ranks share is rank 0's to say)."""
    if not info.is_main:
        stack.enter_context(failures_appended(run_dir / LOG_NAME, f"rank {info.rank}",
                                              unless=(PeerStopped, TrainingInterrupted)))
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    stack.enter_context(RunLock(run_dir))
    handler = add_file_log(run_dir / LOG_NAME)
    stack.callback(remove_log_handler, handler)
    stack.enter_context(failures_logged(handler))
    remove_stale_temp_files(run_dir)


def _set_threads(config: Config, info: DistInfo) -> None:
    """``train.num_threads`` (0: PyTorch's own choice), warned of when this machine's processes
    would run more threads than the cores they may use: they take turns, slower than fewer."""
    threads = config.train.num_threads
    if threads <= 0:
        return
    torch.set_num_threads(threads)
    cores = usable_cores(limit=1 << 16)
    if threads * info.local_world_size > cores:
        each = f" in each of {info.local_world_size} processes" if info.local_world_size > 1 else ""
        get_logger().warning("%s: train.num_threads=%d%s is more threads than the %d cores this machine lets the run "
                             "use; they take turns, which is slower than %d", config.path,
                             threads, each, cores, max(1, cores // info.local_world_size))


def _device(config: Config, info: DistInfo) -> torch.device:
    """This process's device, from ``train.device``; :class:`ConfigError` naming the file (or
    ``--set``) that asked for a device this machine lacks."""
    try:
        return resolve_device(config.train.device, info.local_rank, local_processes=info.local_world_size)
    except ConfigError as exc:
        raise ConfigError(f"{config.source_of('train.device')}: {exc}") from None


def train(config: Config) -> TrainSummary:
    """Train (or resume) the run of ``config``; see the module docstring."""
    log = get_logger()
    info = DistInfo.from_env()
    if info.local_rank > 0:  # one voice on each machine's console: its first process's (they warn alike)
        log.setLevel(logging.ERROR)
    device = _device(config, info)
    _set_threads(config, info)
    check_validation(config)  # now, not at the first validation
    run_dir = config.run_path()
    check_run_directory(run_dir)  # said now, not after the corpus is checked
    signals = StopSignals()
    with contextlib.ExitStack() as stack:
        stack.callback(signals.restore)  # last: a signal after a stop waits for the shutdown
        stack.callback(leave_distributed, info)
        corpus = _join(config, info, device)
        check_model(config, corpus, device, info.local_world_size)
        _keep_log(stack, info, run_dir)
        stack.enter_context(peer_failures(info))  # inside train.log's: it gets the one line
        config, precision_text = resolve_precision(config, device)  # (their warnings in train.log too)
        config = resolve_compile(config, device)
        if info.distributed:
            dist.barrier()
        found = find_resume_checkpoint(run_dir)
        agree_on_resume(None if found is None else int(found[1].get("step", 0)), info)
        trainer = Trainer(config, info, device, corpus, run_dir, signals)
        parent = None
        if found is not None:
            check_same_config_file(found[1], config.path, run_dir)  # (in every process: each stops)
            checked = check_parent_unchanged(run_dir, config.train.init_from, config.train.init_average)
            trainer.resume(*found, parent_checked=checked)
            if info.is_main:
                finish_interrupted_save(run_dir, *found)
            finished = trainer.finished()
            if finished is not None:  # a finished run given again: its files stay as they are
                decode = keep_decode_settings(run_dir, config) if info.is_main else ""
                log.info("nothing to train: %s at step %d (raise it to train further); %s is unchanged%s",
                         finished, trainer.step, run_dir, decode)
                if info.is_main and not (run_dir / "learning_curves.png").exists():
                    _draw_learning_curves(run_dir)  # (a stop while they were drawn)
                return dataclasses.replace(_summary(trainer, finished), trained=False)
        elif config.train.init_from:
            parent = load_parent(config.train.init_from, config.train.init_average)
            run = parent.checkpoints[-1].parent.parent  # (a file outside a run: no spm.model there)
            same = kept_model_sha256(run, parent.vocab.get("spm_sha256"), corpus.spm_path)
            start_from(trainer.model, parent, config, same or trainer.spm_sha256)
            log.info("starting from the weights of %s: %s (train.init_from)", parent.source,
                     names(parent.checkpoints))
        if info.is_main:
            setup_run_dir(config, corpus, run_dir, trainer.spm_sha256)
            if parent is not None:
                with atomic_write(run_dir / PARENT_NAME) as handle:
                    handle.write(json.dumps(parent.record(), indent=2) + "\n")
            # TensorBoard drops the events past the resume point; on a fresh start (step 0), those a
            # killed run left before its first checkpoint
            trainer.writer = Scalars(run_dir / "tensorboard", purge_step=trainer.step + 1)
            stack.callback(trainer.writer.close)
        _log_start(trainer, config, device, precision_text)
        if info.distributed:
            trainer.ddp = nn.parallel.DistributedDataParallel(
                trainer.model, device_ids=[device.index] if device.type == "cuda" else None
            )
            trainer.ddp.register_comm_hook(None, sum_gradients)
            stack.callback(setattr, trainer, "ddp", None)  # the reducer goes before the group
        start = trainer.step
        with trainer.signals:
            try:
                reason = trainer.run()
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                if not is_out_of_memory(exc):
                    raise
                raise out_of_memory_error(config, device, trainer, start) from exc
        log.info("stopped at step %d: %s", trainer.step, reason)
        if trainer.writer is not None:
            trainer.writer.flush()
            _draw_learning_curves(run_dir)
        if info.distributed:
            dist.barrier()  # no rank tears down its connections while another still writes
        return _summary(trainer, reason)
