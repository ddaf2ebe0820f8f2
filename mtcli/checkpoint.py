"""Checkpoints: atomic save with a checksum, weights-only load, resume safety, averaging.

File format
-----------
A checkpoint file is one header line followed by the payload::

    MTCLI-CHECKPOINT 1 sha256=<64 hex digits> size=<payload bytes>\\n
    <payload: the bytes of torch.save(state)>

The header and the payload are written together to a temporary file in the same directory,
flushed (``fsync``) and renamed over the target, so a crash or a full disk leaves either the
old file or the new one. On load, the payload length and ``sha256(payload)`` are checked
before a single byte is deserialised: a truncated or bit-flipped file raises
:class:`~mtcli.errors.CheckpointError` ("checksum mismatch"). The payload is then read with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers: a pickle
crafted to run code (``__reduce__``) is refused, and a file without the header (for example a
raw pickle) is refused before it is parsed at all. A valid checksum only proves the file is
the one that was written, not that it is benign, so both checks always run.

Because of ``weights_only``, a state may hold only tensors, ``dict``/``list``/``tuple``/``set``,
``str``/``bytes``/``int``/``float``/``bool``/``None`` and ``torch.Size``/``dtype``/``device``;
:func:`save_checkpoint` checks this before writing, naming the offending key (store a numpy
RNG state as ``np.random.get_state()[1].tolist()`` and friends, not as arrays).

State layout (written by the trainer)::

    {"format": 1, "step": int, "epoch": int, "model": state_dict, "optimizer": ...,
     "scheduler": ..., "rng": {...}, "data_state": {...}, "train_state": {...},
     "config": Config.to_dict(), "vocab": {"size": int, "spm_sha256": str},
     "valid": {"loss": float, "bleu": float | None}}

Run directory files handled here: ``checkpoints/checkpoint_last.pt``, ``checkpoint_best.pt``,
``checkpoint_<step>.pt``, ``checkpoints/index.json`` (step -> file and validation scores) and
``train.lock`` (the live trainer's pid, host and start time).

Averaging (Vaswani et al. 2017, section 6.1, average the last checkpoints) computes, for every
floating-point parameter, theta_avg = (1/K) * sum_k theta_k in float64, cast back to the
parameter's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mtcli.config import SECTIONS, load_config
from mtcli.errors import CheckpointError, DataError
from mtcli.fileio import atomic_link, atomic_write, sha256_file
from mtcli.logs import get_logger

FORMAT = 1
MAGIC = b"MTCLI-CHECKPOINT"
LAST_NAME = "checkpoint_last.pt"
BEST_NAME = "checkpoint_best.pt"
INDEX_NAME = "index.json"
_STEP_RE = re.compile(r"^checkpoint_(\d+)\.pt$")
_HEADER_RE = re.compile(rb"^MTCLI-CHECKPOINT (\d+) sha256=([0-9a-f]{64}) size=(\d+)$")
_MAX_HEADER = 256
_WRAPPER_RE = re.compile(r"^(?:module\.|_orig_mod\.)+")

# Types torch.load(weights_only=True) rebuilds; save_checkpoint refuses anything else.
_PLAIN_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


# --------------------------------------------------------------------------- save and load


def checkpoint_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def step_checkpoint_name(step: int) -> str:
    """File name of the checkpoint written at ``step``: ``checkpoint_<step>.pt``."""
    return f"checkpoint_{int(step)}.pt"


def _check_plain(obj: Any, where: str) -> None:
    """Raise :class:`CheckpointError` if ``obj`` holds a type weights-only loading refuses."""
    if isinstance(obj, torch.Tensor | torch.Size) or isinstance(obj, _PLAIN_SCALARS):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str | int | float | bool | tuple | type(None)):
                raise CheckpointError(f"{where}: key {key!r} of type {type(key).__name__} cannot be saved")
            _check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
        return
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise CheckpointError(
        f"{where}: a {kind} cannot be loaded back with weights_only=True; "
        "store tensors, lists or plain numbers instead"
    )


def _frame(payload: bytes | memoryview) -> bytes:
    """Header line (format, sha256, size) for ``payload``."""
    digest = hashlib.sha256(payload).hexdigest()
    return MAGIC + f" {FORMAT} sha256={digest} size={len(payload)}\n".encode("ascii")


def save_checkpoint(path: Path, state: dict, also: Iterable[Path] = ()) -> None:
    """Write ``state`` to ``path`` atomically, with a sha256 of the payload in a header line.

    The state is checked to hold only types :func:`load_checkpoint` can read back, serialised
    with ``torch.save`` to memory, then header + payload go to a temporary file in the same
    directory, which is fsynced and renamed over ``path``; each of ``also`` then becomes another
    name of that file (:func:`mtcli.fileio.atomic_link`). If anything fails (disk full, file-size
    limit, permissions) the temporary file is removed, the previous file is untouched, and
    :class:`CheckpointError` names the path and the OS error.
    """
    path = Path(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a checkpoint state must be a dict, got {type(state).__name__}")
    _check_plain(state, f"{path}: state")
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as exc:  # pickling failures come in many types
        raise CheckpointError(f"{path}: cannot serialise checkpoint ({_one_line(exc)})") from None
    payload = buffer.getbuffer()
    target = path
    try:
        with atomic_write(path, "wb") as handle:
            handle.write(_frame(payload))
            handle.write(payload)
        for target in map(Path, also):
            atomic_link(path, target)
    except OSError as exc:
        reason = exc.strerror or _one_line(exc)
        message = f"{target}: cannot write checkpoint ({reason}); the previous file is unchanged"
        raise CheckpointError(message) from None
    finally:
        del payload
        buffer.close()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unpickling_reason(exc: BaseException) -> str:
    """A short reason for a weights-only refusal, naming the refused global if present."""
    match = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if match:
        return f"it references {match.group(1)}"
    match = re.search(r"Unsupported operand (\d+)", str(exc))
    if match:
        return f"it uses pickle opcode {match.group(1)}"
    return "objects outside the weights-only allowlist"


def read_payload(path: Path) -> memoryview:
    """The verified payload bytes of checkpoint ``path`` (checks header, size and sha256)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint ({exc.strerror or exc})") from None
    end = data.find(b"\n", 0, _MAX_HEADER)
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data[: len(MAGIC)]):  # empty or cut inside the magic
            raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
        raise CheckpointError(
            f"{path}: not an mtcli checkpoint (no checksum header); refusing to load an unverified file"
        )
    match = _HEADER_RE.match(data[:end]) if end >= 0 else None
    if match is None:
        raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
    version, digest, size = int(match.group(1)), match.group(2).decode(), int(match.group(3))
    if version > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {version} is newer than this mtcli ({FORMAT})")
    payload = memoryview(data)[end + 1 :]
    if len(payload) != size:
        raise CheckpointError(
            f"{path}: checksum mismatch (corrupted or truncated: {len(payload)} of {size} payload bytes)"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (corrupted or truncated)")
    return payload


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict:
    """Verify and load a checkpoint written by :func:`save_checkpoint`.

    Raises :class:`CheckpointError` (one line, naming ``path``) if the file is missing, has no
    mtcli header, fails the size or sha256 check ("checksum mismatch (corrupted or
    truncated)"), or holds anything ``torch.load(weights_only=True)`` refuses, such as a
    pickle that would run code. Nothing in the file is ever executed.
    """
    path = Path(path)
    payload = read_payload(path)
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused: the checkpoint holds more than tensors and plain data "
            f"({_unpickling_reason(exc)}); a checkpoint never runs code"
        ) from None
    except Exception as exc:  # torch raises RuntimeError/ValueError/... for unreadable payloads
        raise CheckpointError(f"{path}: unreadable checkpoint payload ({_one_line(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: checkpoint holds a {type(state).__name__}, expected a dict")
    fmt = state.get("format", FORMAT)
    if isinstance(fmt, int) and fmt > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt} is newer than this mtcli ({FORMAT})")
    return state


# --------------------------------------------------------------------------- resume


def step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint_<step>.pt`` in the run, oldest first."""
    directory = checkpoint_dir(run_dir)
    entries = directory.iterdir() if directory.is_dir() else []
    matches = [(_STEP_RE.match(p.name), p) for p in entries]
    return sorted((int(m.group(1)), p) for m, p in matches if m and p.is_file())


def find_resume_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The checkpoint to resume a run from, loaded: ``(path, state)``, or None if there is none.

    Tries ``checkpoint_last.pt``, then the step checkpoints newest first, then
    ``checkpoint_best.pt`` as a last resort (it is never newer than the newest step checkpoint
    the trainer keeps). Every corrupt file met on the way is logged as a warning, with the one
    used. Raises :class:`CheckpointError` if checkpoints exist but none is intact.
    """
    directory = checkpoint_dir(run_dir)
    steps = [p for _, p in reversed(step_checkpoints(run_dir))]
    candidates = [p for p in [directory / LAST_NAME, *steps, directory / BEST_NAME] if p.is_file()]
    if not candidates:
        return None
    log = get_logger()
    failures: list[str] = []
    for path in candidates:
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("corrupt checkpoint, skipped: %s", exc)
            failures.append(path.name)
            continue
        if failures:
            log.warning(
                "resuming from %s (step %s) because %s %s not intact",
                path.name, state.get("step", "?"), ", ".join(failures),
                "is" if len(failures) == 1 else "are",
            )
        return path, state
    raise CheckpointError(
        f"{directory}: no intact checkpoint to resume from ({', '.join(failures)} all corrupt); "
        "move the run directory away to start over"
    )


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete temporary files a killed writer left in ``checkpoints/``; call under :class:`RunLock`."""
    directory = checkpoint_dir(run_dir)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file():
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    if removed:
        get_logger().info("removed %d unfinished checkpoint write(s) in %s", len(removed), directory)
    return removed


# Keys whose change makes a checkpoint unusable: the network's shape and the vocabulary/data.
UNSAFE_KEYS: frozenset[str] = frozenset(
    {
        "model.d_model", "model.n_heads", "model.encoder_layers", "model.decoder_layers",
        "model.d_ff", "model.pre_norm", "model.tie_embeddings", "model.max_positions",
        "data.name", "data.source", "data.src_lang", "data.tgt_lang", "data.hub_config",
        "data.train_split", "data.valid_split", "data.max_length", "data.max_length_ratio",
        "data.dedup", "data.vocab_size", "data.spm_model_type", "data.character_coverage",
        "data.spm_max_sentences",
        # The saved data position indexes the batch stream these keys define.
        "train.seed", "train.max_tokens", "train.max_source_length", "train.max_target_length",
        # The saved optimiser state is per parameter group, and this key decides the groups.
        "train.decay_norms_and_biases",
    }
)
# Keys that may change: training goes on correctly but is no longer an exact continuation.
INEXACT_KEYS: frozenset[str] = frozenset(
    {
        "model.dropout", "model.attention_dropout", "model.activation_dropout",
        "train.update_freq", "train.lr_factor", "train.warmup_steps", "train.label_smoothing",
        "train.adam_betas", "train.adam_eps", "train.weight_decay", "train.clip_norm",
        "train.bf16", "train.valid_bleu", "train.valid_max_sentences",
    }
)
# Keys with no effect on the trajectory (stopping, logging, hardware, decoding, evaluation).
SAFE_KEYS: frozenset[str] = frozenset(
    {
        "train.run_dir", "train.device", "train.num_threads", "train.max_steps",
        "train.max_epochs", "train.max_minutes", "train.patience", "train.valid_every",
        "train.keep_last", "train.log_every", "train.max_nonfinite", "train.progress",
        "train.ensemble",
        "data.num_workers", "data.test_splits", "data.prepared_dir",
    }
)


def _classify(key: str) -> str:
    """'unsafe', 'inexact' or 'safe'; unknown keys: model/data unsafe, train inexact, decode safe."""
    if key in UNSAFE_KEYS:
        return "unsafe"
    if key in INEXACT_KEYS:
        return "inexact"
    if key in SAFE_KEYS or key.startswith("decode."):
        return "safe"
    section = key.split(".", 1)[0]
    return "unsafe" if section in ("model", "data") else "inexact"


def _section_defaults(section: str) -> dict[str, Any]:
    """Default value of every key of a config section (for keys an older config lacks)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SECTIONS[section]) if section in SECTIONS else []:
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def check_resume_config(saved: dict, new: dict, where: str = "resume") -> list[str]:
    """Compare the config a checkpoint was trained with to the one given for resuming.

    Both are ``Config.to_dict()`` dicts; a key missing from ``saved`` (an older mtcli) counts
    as its dataclass default. Three kinds of change:

    * refused (:data:`UNSAFE_KEYS`, any unknown ``model.*``/``data.*`` key): the model shape
      and everything that builds the vocabulary or the training data. Also ``train.seed``,
      ``train.max_tokens`` and ``train.max_source_length``/``max_target_length``: the saved
      data position is an index into the batch stream these keys define, so resuming under
      new values would silently repeat or skip data. And ``train.decay_norms_and_biases``,
      which splits AdamW's parameters into groups the saved optimiser state must match.
      To change them, start a new run directory. One :class:`CheckpointError` names every
      such key as ``key: old -> new``.
    * allowed but inexact (:data:`INEXACT_KEYS`, unknown ``train.*`` keys): dropout,
      ``update_freq`` and optimiser/schedule hyperparameters; training stays correct (the
      data position counts batches, not updates) but no longer matches an uninterrupted run.
      Returned as ``"key: old -> new (resume no longer exact)"``.
    * safe (:data:`SAFE_KEYS`, ``decode.*``): stopping rules, logging, devices, decoding.
      Returned as ``"key: old -> new"``.

    The caller logs the returned strings and applies the new config.
    """
    refused: list[str] = []
    changes: list[str] = []
    for section in sorted(set(saved) | set(new)):
        old_body = dict(_section_defaults(section))
        old_body.update(saved.get(section) or {})
        new_body = new.get(section) or {}
        for key in sorted(set(old_body) | set(new_body)):
            old_value = old_body.get(key, "<unset>")
            new_value = new_body.get(key, "<unset>")
            if _same(old_value, new_value):
                continue
            dotted = f"{section}.{key}"
            text = f"{dotted}: {old_value!r} -> {new_value!r}"
            kind = _classify(dotted)
            if kind == "unsafe":
                refused.append(text)
            elif kind == "inexact":
                changes.append(f"{text} (resume no longer exact)")
            else:
                changes.append(text)
    if refused:
        raise CheckpointError(
            f"{where}: cannot resume: the config changes keys the checkpoint depends on: "
            f"{'; '.join(refused)} (restore them or use a new run directory)"
        )
    return changes


def _same(a: Any, b: Any) -> bool:
    """Equality that treats lists and tuples alike and 1 == 1.0 (YAML round trips)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


# --------------------------------------------------------------------------- index and pruning


def read_index(run_dir: Path) -> dict[int, dict]:
    """``checkpoints/index.json`` as ``{step: {"file": name, "loss": float|None, "bleu": float|None}}``.

    Missing index: ``{}``. Unreadable index: :class:`CheckpointError` naming the file.
    """
    path = checkpoint_dir(run_dir) / INDEX_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint index ({_one_line(exc)})") from None
    try:
        entries = raw["checkpoints"]
        return {int(step): dict(entry) for step, entry in entries.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{path}: malformed checkpoint index (expected 'checkpoints' mapping)") from None


def update_index(run_dir: Path, step: int, valid: dict) -> None:
    """Record ``checkpoint_<step>.pt`` with its validation ``loss``/``bleu`` in index.json, atomically.

    An unreadable index is logged and rebuilt from this entry on (it only ranks checkpoints).
    """
    try:
        entries = read_index(run_dir)
    except CheckpointError as exc:
        get_logger().warning("%s; starting a new index", exc)
        entries = {}
    entries[int(step)] = {
        "file": step_checkpoint_name(step),
        "loss": None if valid.get("loss") is None else float(valid["loss"]),
        "bleu": None if valid.get("bleu") is None else float(valid["bleu"]),
    }
    body = {"format": FORMAT, "checkpoints": {str(s): entries[s] for s in sorted(entries)}}
    path = checkpoint_dir(run_dir) / INDEX_NAME
    try:
        with atomic_write(path) as handle:
            json.dump(body, handle, indent=1)
            handle.write("\n")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write checkpoint index ({exc.strerror or exc})") from None


def _ranked_best(run_dir: Path) -> list[tuple[int, Path]]:
    """Indexed step checkpoints that still exist, best first: by BLEU if all have it, else loss."""
    directory = checkpoint_dir(run_dir)
    rows = []
    for step, entry in read_index(run_dir).items():
        path = directory / str(entry.get("file") or step_checkpoint_name(step))
        if path.is_file():
            rows.append((step, path, entry.get("bleu"), entry.get("loss")))
    if rows and all(r[2] is not None for r in rows):
        rows.sort(key=lambda r: (-float(r[2]), -r[0]))
    else:
        rows = [r for r in rows if r[3] is not None]
        rows.sort(key=lambda r: (float(r[3]), -r[0]))
    return [(r[0], r[1]) for r in rows]


def prune_checkpoints(run_dir: Path, keep_last: int, keep_best: int = 0) -> None:
    """Delete ``checkpoint_<step>.pt`` files beyond the newest ``keep_last``.

    ``checkpoint_last.pt``/``checkpoint_best.pt`` are never touched; with ``keep_best`` > 0
    the best ``keep_best`` indexed step checkpoints are kept too (for ``--average-best``).
    """
    steps = step_checkpoints(run_dir)
    keep = {p for _, p in steps[-keep_last:]} if keep_last > 0 else set()
    if keep_best > 0:
        try:
            keep |= {p for _, p in _ranked_best(run_dir)[:keep_best]}
        except CheckpointError as exc:
            get_logger().warning("%s; keeping only the last %d", exc, keep_last)
    for _, path in steps:
        if path not in keep:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                get_logger().warning("cannot remove old checkpoint %s (%s)", path, exc.strerror or exc)


# --------------------------------------------------------------------------- averaging


def average_checkpoints(paths: list[Path]) -> dict:
    """Average the model parameters of ``paths`` into one state.

    For each floating-point tensor, theta = (1/K) sum_k theta_k, accumulated in float64 and
    cast back; other tensors (integer buffers) are taken from the last checkpoint. All
    checkpoints must hold the same parameter names and shapes and the same ``vocab``, else
    :class:`CheckpointError`. The result keeps ``format``, ``step``, ``epoch``, ``config``,
    ``vocab`` of the last checkpoint, drops optimiser/RNG/data state (it cannot be resumed),
    and lists its sources under ``averaged_from``.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise CheckpointError("no checkpoints to average")
    sums: dict[str, torch.Tensor] = {}
    reference: dict[str, tuple[torch.dtype, torch.Size]] = {}
    first_vocab: Any = None
    last: dict = {}
    sources: list[dict] = []
    for i, path in enumerate(paths):
        state = load_checkpoint(path)
        model = state.get("model")
        if not isinstance(model, dict) or not model:
            raise CheckpointError(f"{path}: checkpoint has no model parameters")
        if i == 0:
            first_vocab = state.get("vocab")
            reference = {k: (v.dtype, v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
        else:
            if state.get("vocab") != first_vocab:
                raise CheckpointError(
                    f"cannot average {paths[0].name} and {path.name}: different vocabularies "
                    f"({_vocab_text(first_vocab)} vs {_vocab_text(state.get('vocab'))})"
                )
            _check_same_params(paths[0], reference, path, model)
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


def select_checkpoints(run_dir: Path, last: int = 0, best: int = 0) -> list[Path]:
    """The step checkpoints to average: the newest ``last`` or the best ``best`` by index.json.

    Exactly one of ``last``/``best`` must be > 0. "Best" ranks by validation BLEU when every
    indexed checkpoint has one, else by validation loss. Paths are returned oldest step first.
    """
    run_dir = Path(run_dir)
    if (last > 0) == (best > 0) or last < 0 or best < 0:
        raise CheckpointError(f"give exactly one of last=K or best=K (> 0), got last={last}, best={best}")
    if last:
        steps = step_checkpoints(run_dir)
        if len(steps) < last:
            raise CheckpointError(
                f"{checkpoint_dir(run_dir)}: asked for the last {last} checkpoints, found "
                f"{len(steps)}: {_names(p for _, p in steps)}"
            )
        return [p for _, p in steps[-last:]]
    ranked = _ranked_best(run_dir)
    if len(ranked) < best:
        raise CheckpointError(
            f"{checkpoint_dir(run_dir) / INDEX_NAME}: asked for the best {best} checkpoints, "
            f"{len(ranked)} indexed with scores still exist: {_names(p for _, p in ranked)}"
        )
    return [p for _, p in sorted(ranked[:best])]


def _names(paths: Any) -> str:
    names = [p.name for p in paths]
    return ", ".join(names) if names else "none"


def average_run_checkpoints(run_dir: Path, output: Path, last: int = 0, best: int = 0) -> list[Path]:
    """Average the last or best K checkpoints of a run into ``output`` (see :func:`select_checkpoints`).

    Returns the averaged paths, oldest step first; ``output`` is written with
    :func:`save_checkpoint`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: run directory not found")
    paths = select_checkpoints(run_dir, last=last, best=best)
    state = average_checkpoints(paths)
    save_checkpoint(Path(output), state)
    get_logger().info("averaged %s into %s", _names(paths), output)
    return paths


# --------------------------------------------------------------------------- inference


@dataclasses.dataclass
class InferenceModel:
    """What ``evaluate``/``translate`` need from a run: model, tokenizer, config and a name."""

    model: torch.nn.Module
    tokenizer: Any
    config: Any
    name: str
    state: dict | None = None  # checkpoint metadata (step, valid, ...) without the parameters


def _resolve_checkpoint(run_dir: Path, checkpoint: str | Path) -> Path:
    directory = checkpoint_dir(run_dir)
    text = str(checkpoint)
    if text in ("best", "last"):
        path = directory / (BEST_NAME if text == "best" else LAST_NAME)
        if text == "best" and not path.is_file() and (directory / LAST_NAME).is_file():
            get_logger().info("%s has no %s; using %s", run_dir, BEST_NAME, LAST_NAME)
            path = directory / LAST_NAME
    else:
        path = Path(checkpoint)
        if not path.exists() and not path.is_absolute() and (directory / path).exists():
            path = directory / path
    if not path.is_file():
        raise CheckpointError(
            f"{path}: checkpoint not found (checkpoints in {run_dir}: "
            f"{_names(sorted(directory.glob('*.pt')))})"
        )
    return path


def load_for_inference(
    run_dir: str | Path,
    checkpoint: str | Path = "best",
    average_last: int = 0,
    average_best: int = 0,
    device: str | torch.device = "cpu",
) -> InferenceModel:
    """Load a run directory for decoding: Transformer (eval mode, on ``device``) + tokenizer + config.

    ``checkpoint`` is "best" (falls back to "last", logged, when there is no best), "last",
    or a path (absolute, relative to the working directory, or a file name in
    ``checkpoints/``). With ``average_last``/``average_best`` > 0 the last/best K step
    checkpoints are averaged in memory instead (``checkpoint`` is then ignored).
    Raises :class:`CheckpointError` (one line) for a missing run directory, a directory
    without ``config.yaml`` or ``spm.model``, a missing checkpoint (listing what exists), or
    a checkpoint whose vocabulary is not the run's ``spm.model`` (naming both).
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir}: run directory not found")
    if not run_dir.is_dir() or not (run_dir / "config.yaml").is_file():
        from mtcli.ensemble import member_dirs

        members = member_dirs(run_dir)
        if members:
            others = " ".join(f"--ensemble {m}" for m in members[1:])
            raise CheckpointError(f"{run_dir}: an ensemble run (train.ensemble); decode its members "
                                  f"together with {members[0]} {others}")
        raise CheckpointError(f"{run_dir}: not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    spm_path = run_dir / "spm.model"
    if not spm_path.is_file():
        raise CheckpointError(f"{run_dir}: incomplete run directory (no spm.model)")
    from mtcli.tokenizer import PAD_ID, Tokenizer

    try:
        tokenizer = Tokenizer(spm_path)
    except DataError as exc:
        raise CheckpointError(str(exc)) from None

    if average_last > 0 or average_best > 0:
        paths = select_checkpoints(run_dir, last=average_last, best=average_best)
        state = average_checkpoints(paths)
        kind = f"last{average_last}" if average_last > 0 else f"best{average_best}"
        name = f"avg_{kind} ({_names(paths)})"
        source = f"{paths[0].name}..{paths[-1].name}"
    else:
        path = _resolve_checkpoint(run_dir, checkpoint)
        state = load_checkpoint(path)
        name = f"{path.name} (step {state.get('step', '?')})"
        source = str(path)

    vocab = state.get("vocab")
    spm_sha = sha256_file(spm_path)
    if isinstance(vocab, dict):
        size, sha = vocab.get("size"), vocab.get("spm_sha256")
        if (size is not None and int(size) != tokenizer.vocab_size) or (sha and sha != spm_sha):
            raise CheckpointError(
                f"{source}: checkpoint vocabulary (size {size}, spm sha256 {str(sha)[:12]}) does not "
                f"match {spm_path} (size {tokenizer.vocab_size}, sha256 {spm_sha[:12]})"
            )
    model_state = state.get("model")
    if not isinstance(model_state, dict):
        raise CheckpointError(f"{source}: checkpoint has no model parameters")

    from mtcli.model import Transformer

    model_state = {_WRAPPER_RE.sub("", k): v for k, v in model_state.items()}  # DDP/compile names
    try:
        model = Transformer(config.model, tokenizer.vocab_size, PAD_ID, model_state.get("output_ids"))
        model.load_state_dict(model_state)
    except (RuntimeError, ValueError) as exc:
        detail = " ".join(str(exc).split())
        raise CheckpointError(
            f"{source}: parameters do not fit the model of {run_dir / 'config.yaml'} ({detail[:300]})"
        ) from None
    model.to(device).eval()
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler", "rng", "rng_ranks")}
    return InferenceModel(model=model, tokenizer=tokenizer, config=config, name=name, state=meta)
