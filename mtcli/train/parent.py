"""Start a run from a trained model: ``train.init_from`` (fine-tuning, domain adaptation).

A new run whose config names ``train.init_from: RUN_DIR | CHECKPOINT`` starts from that model's
weights instead of random ones: the checkpoint's, or the average of the run's last
``train.init_average`` step checkpoints (:func:`mtcli.infer.averaging.average_checkpoints`).
Everything else starts fresh: the optimiser's moments, the schedule's step count, the data
order (``train.seed``), the best score and the patience counter. Only the weights cross over.

The child must have the parent's network shape and the parent's SentencePiece model (prepare
the new corpus with ``data.spm_model: PARENT_RUN_DIR``); otherwise the run is refused with one
line naming every mismatch. A run ``mtcli import-hf`` made is a parent like any other (its
``model.activation``/``model.output_bias`` are part of the shape); with separate source and target
SentencePiece models, ``data.spm_model: RUN`` has ``prepare`` encode with both. The output vocabulary (``model.output_vocab: target``) is the
child's own: the pieces its new training targets use, taken from the parent's tied embedding.

Files are read as every checkpoint is (:func:`mtcli.checkpoint.load_checkpoint`): checksum
first, then weights only, so a crafted file never runs code. The child's run directory records
its parent in ``parent.json``; once the child has a checkpoint, running the same command again
resumes the child exactly, and ``init_from`` is not read again, but checked: when the weights
it names are no longer the ones ``parent.json`` records (the parent trained further, say), the
resume is refused, since the child would no longer be an adaptation of that parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtcli.checkpoint import architecture_mismatches, load_checkpoint
from mtcli.config import Config
from mtcli.errors import CheckpointError, ConfigError
from mtcli.fileio import sha256_file
from mtcli.infer.averaging import average_checkpoints
from mtcli.model import Transformer
from mtcli.rundir import checkpoint_dir, select_checkpoints

PARENT_NAME = "parent.json"
# Buffers that belong to the child, not the parent: the output vocabulary is its own corpus's.
_OWN_BUFFERS = ("output_ids",)


@dataclass
class Parent:
    """The model a run starts from: its weights and what identifies them."""

    source: Path
    checkpoints: list[Path]
    model: dict[str, torch.Tensor]
    config: dict[str, Any]
    vocab: dict[str, Any]
    step: int | None

    def record(self) -> dict[str, Any]:
        """What ``parent.json`` keeps: the path given, each checkpoint file with its step and
        sha256, and the parent's SentencePiece sha256."""
        return {
            "init_from": str(self.source.resolve()),
            "checkpoints": [{"file": str(p.resolve()), "sha256": sha256_file(p)} for p in self.checkpoints],
            "average": len(self.checkpoints),
            "step": self.step,
            "spm_sha256": self.vocab.get("spm_sha256"),
        }


def parent_checkpoints(init_from: str, average: int) -> list[Path]:
    """The checkpoint files ``train.init_from`` names: a checkpoint file, or the last
    ``average`` step checkpoints of a run directory (oldest first)."""
    path = Path(init_from)
    if path.is_dir():
        if not checkpoint_dir(path).is_dir():
            raise ConfigError(f"train.init_from: {init_from}: not a run directory (no checkpoints/)")
        try:
            return select_checkpoints(path, last=average)
        except CheckpointError as exc:
            raise ConfigError(f"train.init_from: {exc}") from None
    if not path.is_file():
        raise ConfigError(f"train.init_from: {init_from}: no such run directory or checkpoint")
    if average != 1:
        raise ConfigError(f"train.init_average: {average} needs train.init_from to be a run "
                          f"directory; {init_from} is one checkpoint file")
    return [path]


def load_parent(init_from: str, average: int = 1) -> Parent:
    """Read the parent's weights (verified, weights only; averaged when ``average > 1``)."""
    paths = parent_checkpoints(init_from, average)
    state = average_checkpoints(paths) if len(paths) > 1 else load_checkpoint(paths[0])
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"{paths[-1]}: checkpoint has no model parameters")
    return Parent(source=Path(init_from), checkpoints=paths, model=model,
                  config=state.get("config") or {}, vocab=state.get("vocab") or {},
                  step=state.get("step"))


def mismatches(parent: Parent, config: Config, model: Transformer, spm_sha256: str) -> list[str]:
    """Every way the child (``config``, its built ``model``, its SentencePiece sha256) cannot take
    the parent's weights, one phrase each; empty when it can."""
    problems: list[str] = []
    for key, theirs, mine in architecture_mismatches(parent.config.get("model"), config.model):
        problems.append(f"model.{key} {theirs} (parent) vs {mine} (this run)")
    theirs = parent.vocab.get("spm_sha256")
    if theirs != spm_sha256 or int(parent.vocab.get("size", model.vocab_size)) != model.vocab_size:
        problems.append(f"SentencePiece model sha256 {theirs} (parent, {parent.vocab.get('size')} "
                        f"pieces) vs {spm_sha256} (this run, {model.vocab_size} pieces): prepare "
                        f"with data.spm_model: {parent.source}")
    if not problems:  # same config: compare the tensors themselves
        own = {k: v for k, v in model.state_dict().items() if k not in _OWN_BUFFERS}
        given = {k: v for k, v in parent.model.items() if k not in _OWN_BUFFERS}
        for key in sorted(set(own) | set(given)):
            if key not in given or key not in own:
                problems.append(f"parameter {key} only in the {'parent' if key in given else 'child'}")
            elif tuple(given[key].shape) != tuple(own[key].shape):
                problems.append(f"{key} shape {tuple(given[key].shape)} (parent) vs {tuple(own[key].shape)}")
    return problems


def start_from(model: Transformer, parent: Parent, config: Config, spm_sha256: str) -> None:
    """Copy the parent's weights into ``model``; :class:`ConfigError` (one line, every mismatch)
    when the shape or the vocabulary differs."""
    problems = mismatches(parent, config, model, spm_sha256)
    if problems:
        raise ConfigError(f"train.init_from: cannot start from {parent.source}: {'; '.join(problems)}")
    weights = {k: v for k, v in parent.model.items() if k not in _OWN_BUFFERS}
    for key in _OWN_BUFFERS:
        own = getattr(model, key, None)
        if own is not None:
            weights[key] = own
    model.load_state_dict(weights)


# How a child resumes from its own checkpoints whatever its parent became (parent.json stays).
LET_GO = "the command without --init-from and with --set train.init_from=null"


def check_parent_unchanged(run_dir: Path, init_from: str, average: int) -> bool:
    """Refuse to resume a child whose ``train.init_from`` now names other weights than those it
    started from (``parent.json``): another checkpoint, or one of the same name rewritten.
    Whether it names those weights (False where nothing was checked: a parent that is gone, no
    ``train.init_from``, or a child without a record)."""
    record_path = run_dir / PARENT_NAME
    if not init_from or not record_path.is_file():
        return False
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        recorded = [(str(c["file"]), str(c["sha256"])) for c in record["checkpoints"]]
        paths = parent_checkpoints(init_from, average)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return False
    if [sha256_file(p) for p in paths] != [sha for _, sha in recorded]:  # moved or mounted elsewhere: the same
        names = ", ".join(Path(file).name for file, _ in recorded)
        started = str(record.get("init_from", "?"))
        if started == str(Path(init_from).resolve()):  # the parent itself changed: trained further, pruned
            raise CheckpointError(
                f"{run_dir}: started from {names} of {started} ({PARENT_NAME}), which has other weights now; use a "
                f"new run directory to adapt them, or give {LET_GO} to go on training this run as it is")
        raise CheckpointError(
            f"{run_dir}: started from {names} of {started} ({PARENT_NAME}), and train.init_from {init_from} names "
            f"other weights; give the first to resume, a new run directory to adapt these, or {LET_GO} to go on "
            "training this run as it is")
    return True


__all__ = ["PARENT_NAME", "Parent", "check_parent_unchanged", "load_parent", "mismatches", "parent_checkpoints",
           "start_from"]
