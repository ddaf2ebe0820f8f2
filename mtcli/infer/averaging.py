"""Checkpoint averaging (Vaswani et al. 2017, section 6.1: average the last checkpoints).

For every floating-point parameter, ``theta_avg = (1/K) * sum_k theta_k``, accumulated in float64
and cast back to the parameter's dtype. ``mtcli average`` writes the result as a checkpoint;
:func:`mtcli.infer.loading.load_for_inference` averages in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtcli.checkpoint import (
    FORMAT,
    architecture_mismatches,
    directions_text,
    is_checkpoint_file,
    load_checkpoint,
    other_directions,
    save_checkpoint,
)
from mtcli.errors import CheckpointError
from mtcli.logs import get_logger
from mtcli.rundir import (
    checkpoint_dir,
    is_own_checkpoint_name,
    names,
    run_file_role,
    select_checkpoints,
)


def _saved_model(state: dict) -> dict[str, Any]:
    """The model settings a checkpoint records (``{}`` where it records none)."""
    saved = (state.get("config") or {}).get("model")
    return saved if isinstance(saved, dict) else {}


def _saved_data(state: dict) -> Any:
    """The data settings a checkpoint records (its directions), or None."""
    return (state.get("config") or {}).get("data")


def _saved_train(state: dict) -> dict[str, Any]:
    """The training settings a checkpoint records (``{}`` where it records none)."""
    saved = (state.get("config") or {}).get("train")
    return saved if isinstance(saved, dict) else {}


def _check_distinct(paths: list[Path]) -> None:
    """:class:`CheckpointError` for one file given twice (by two paths, or a link and its file)."""
    seen: dict[Any, Path] = {}
    for path in paths:
        try:
            found = path.stat()
            key: Any = (found.st_dev, found.st_ino)
        except OSError:
            key = str(path.resolve())  # said by the loader
        if key in seen:
            raise CheckpointError(f"the same checkpoint twice: {seen[key]} and {path}")
        seen[key] = path


def _warn_other_start(first: Path, first_train: dict[str, Any], path: Path, train: dict[str, Any]) -> bool:
    """Warn when two checkpoints come from trainings of other seeds that did not start from one
    model (``train.init_from``): independently initialised weights do not average into a model.
    Whether it warned."""
    seeds = first_train.get("seed"), train.get("seed")
    if seeds[0] != seeds[1] and not (first_train.get("init_from") and first_train.get("init_from") == train.get("init_from")):
        get_logger().warning("averaging %s (seed %s) and %s (seed %s): trainings of other seeds from random starts; "
                             "their average is no model (average checkpoints of one run)", first, seeds[0], path,
                             seeds[1])
        return True
    return False


def average_checkpoints(paths: list[Path]) -> dict:
    """Average the model parameters of ``paths`` into one state.

    For each floating-point tensor, theta = (1/K) sum_k theta_k, accumulated in float64 and
    cast back; other tensors (integer buffers) are taken from the last checkpoint. All
    checkpoints must hold the same parameter names and shapes and the same ``vocab``, else
    :class:`CheckpointError`. The result keeps ``format``, ``step``, ``epoch``, ``config``,
    ``vocab`` of the last checkpoint, drops optimiser/RNG/data state (it cannot be resumed),
    and lists its sources under ``averaged_from``.
    """
    if isinstance(paths, (str, Path)):
        raise TypeError("paths must be a list of checkpoint paths, not one path (wrap it: [path])")
    paths = [Path(p) for p in paths]
    _check_distinct(paths)
    if not paths:
        raise CheckpointError("no checkpoints to average")
    sums: dict[str, torch.Tensor] = {}
    reference: dict[str, tuple[torch.dtype, torch.Size]] = {}
    first_vocab: Any = None
    last: dict = {}
    sources: list[dict] = []
    warned = False  # about checkpoints of other seeds: once
    there = {path for path in paths if path.is_file()}
    for i, path in enumerate(paths):
        try:
            state = load_checkpoint(path)
        except CheckpointError:
            if path in there and not path.exists():
                raise CheckpointError(f"{path}: removed while the average was made (a training of the run prunes its "
                                      "older checkpoints as it saves new ones); run it again") from None
            raise
        model = state.get("model")
        if not isinstance(model, dict) or not model:
            raise CheckpointError(f"{path}: checkpoint has no model parameters")
        if i == 0:
            first_vocab, first, first_data = state.get("vocab"), _saved_model(state), _saved_data(state)
            state_train = _saved_train(state)
            reference = {k: (v.dtype, v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
        else:
            if state.get("vocab") != first_vocab:
                raise CheckpointError(
                    f"cannot average {paths[0].name} and {path.name}: different vocabularies "
                    f"({_vocab_text(first_vocab)} vs {_vocab_text(state.get('vocab'))})"
                )
            _check_same_params(paths[0], reference, path, model)
            directions = other_directions(first_data, _saved_data(state))
            if directions:
                raise CheckpointError(f"cannot average {paths[0].name} and {path.name}: trained for other directions "
                                      f"({directions_text(directions[0])} and {directions_text(directions[1])})")
            warned = warned or _warn_other_start(paths[0], state_train, path, _saved_train(state))
            differ = architecture_mismatches(_saved_model(state), first)
            if differ:
                said = "; ".join(f"model.{key} {own} and {saved}" for key, saved, own in differ)
                raise CheckpointError(f"cannot average {paths[0].name} and {path.name}: different models ({said})")
        for key, value in model.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.detach().to(torch.float64)
                if key in sums:
                    sums[key] += value
                else:
                    sums[key] = value.clone()
        sources.append({"file": path.name, "step": state.get("step")})
        last = state
    count = len(paths)
    averaged: dict[str, Any] = {}
    for key, value in last["model"].items():
        if key in sums:
            averaged[key] = (sums[key] / count).to(value.dtype)
        else:
            averaged[key] = value
    out = {k: last[k] for k in ("format", "step", "epoch", "config", "vocab") if k in last}
    out.setdefault("format", FORMAT)
    out["model"] = averaged
    out["averaged_from"] = sources
    return out


def _vocab_text(vocab: Any) -> str:
    if not isinstance(vocab, dict):
        return "no vocab recorded"
    return f"size {vocab.get('size')}, spm {str(vocab.get('spm_sha256') or '?')[:12]}"


def _check_same_params(
    first: Path, reference: dict[str, tuple[torch.dtype, torch.Size]], path: Path, model: dict
) -> None:
    keys = {k for k, v in model.items() if isinstance(v, torch.Tensor)}
    missing, extra = sorted(set(reference) - keys), sorted(keys - set(reference))
    if missing or extra:
        raise CheckpointError(
            f"cannot average {first.name} and {path.name}: different parameters "
            f"(missing {missing[:3]}, extra {extra[:3]})"
        )
    for key, (_dtype, shape) in reference.items():
        if model[key].shape != shape:
            raise CheckpointError(
                f"cannot average {first.name} and {path.name}: {key} has shape "
                f"{tuple(shape)} vs {tuple(model[key].shape)}"
            )


def average_run_checkpoints(run_dir: Path, output: Path, last: int = 0, best: int = 0) -> list[Path]:
    """Average the last or best K checkpoints of a run into ``output`` (see :func:`select_checkpoints`).

    Returns the averaged paths, oldest step first; ``output`` is written with
    :func:`save_checkpoint`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: run directory not found")
    if not checkpoint_dir(run_dir).is_dir():
        raise CheckpointError(f"{run_dir}: not a run directory (no checkpoints/)")
    output = Path(output)
    example = f"checkpoint_avg_{'last' if last else 'best'}{last or best}.pt"
    if output.parent.resolve() == checkpoint_dir(run_dir).resolve() and is_own_checkpoint_name(output.name):
        raise CheckpointError(f"{output}: a name of the run's own checkpoints, which training resumes from and "
                              f"--last averages (an average holds no optimizer state); write it as {example}")
    role = run_file_role(output.resolve())
    if role is not None:
        raise CheckpointError(f"{output}: {role} in the run directory {output.resolve().parent}, not an output "
                              f"to replace; write the average as, say, {example}")
    if output.is_file() and output.stat().st_size and not is_checkpoint_file(output):
        raise CheckpointError(f"{output}: a file that is not an mtcli checkpoint, which an average would replace; "
                              f"write it to a new path, say {example}")
    paths = select_checkpoints(run_dir, last=last, best=best)
    state = average_checkpoints(paths)
    save_checkpoint(Path(output), state, follow=True)
    get_logger().info("averaged %s into %s", names(paths), output)
    return paths
