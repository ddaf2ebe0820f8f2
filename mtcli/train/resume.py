"""Resuming a run: which checkpoint to resume from, and which config changes a resume allows.

A run directory with a checkpoint is resumed exactly (``mtcli train`` on it again). This module
finds the newest intact checkpoint (:func:`find_resume_checkpoint`), removes what a killed
writer left behind (:func:`remove_stale_temp_files`), and compares the checkpoint's config with
the one given now (:func:`check_resume_config`): changes that would break the checkpoint are
refused, the others are logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from mtcli.checkpoint import load_checkpoint
from mtcli.config import SECTIONS, load_config
from mtcli.data.packing import rows_per_batch
from mtcli.data.prepare import SPM_TRAINING_KEYS
from mtcli.data.tokenizer import same_model
from mtcli.errors import CheckpointError, ConfigError
from mtcli.fileio import atomic_link, live_writer, sha256_file
from mtcli.logs import get_logger
from mtcli.rundir import (
    BEST_NAME,
    CONFIG_NAME,
    LAST_NAME,
    SPM_NAME,
    TEXT_DIR,
    checkpoint_dir,
    step_checkpoints,
)

#: The words that end a config change after which the resumed run no longer matches an unbroken
#: one (the trainer logs such changes as warnings).
INEXACT = "resume no longer exact"


def find_resume_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The checkpoint to resume a run from, loaded: ``(path, state)``, or None if there is none.

    Tries ``checkpoint_last.pt`` (or a newer step checkpoint, when a stop came before it was
    linked as the last), then the step checkpoints newest first, then
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
        newer = [(step, p) for step, p in step_checkpoints(run_dir) if step > int(state.get("step", 0))]
        if path.name == LAST_NAME and newer:  # a stop between writing checkpoint_<N> and linking it as the last
            with contextlib.suppress(CheckpointError):
                return newer[-1][1], load_checkpoint(newer[-1][1])
        return path, state
    raise CheckpointError(
        f"{directory}: no intact checkpoint to resume from ({', '.join(failures)} all corrupt); "
        "move the run directory away to start over"
    )


def finish_interrupted_save(run_dir: Path, path: Path, state: dict[str, Any]) -> list[str]:
    """Make the step checkpoint a run resumes from (``path``: newer than ``checkpoint_last``, a
    stop having come between writing it and linking it; or ``checkpoint_last`` was unreadable)
    ``checkpoint_last``, and ``checkpoint_best`` where its validation improved: else serve,
    evaluate and export kept reading an older best for good. The names linked (none for
    ``checkpoint_last`` itself, or links already made)."""
    if path.name in (LAST_NAME, BEST_NAME):
        return []
    directory = checkpoint_dir(run_dir)
    ts = state.get("train_state") or {}
    improved = ts.get("bad_validations") == 0 and ts.get("last_valid_step") == state.get("step")
    linked = []
    for name in ([BEST_NAME] if improved else []) + [LAST_NAME]:
        target = directory / name
        with contextlib.suppress(OSError):
            if target.is_file() and os.path.samefile(path, target):
                continue
        atomic_link(path, target)
        linked.append(name)
    if linked:  # a save cut short before its links, or an unreadable checkpoint_last
        get_logger().info("%s now %s step %s, which the run resumes from", " and ".join(linked),
                          "name" if len(linked) > 1 else "names", state.get("step"))
    return linked


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete temporary files a killed writer left in the run directory, its ``text/`` and its
    ``checkpoints/``, but not those of a process still writing (an average written into
    ``checkpoints/``); call under :class:`RunLock`."""
    removed: list[Path] = []
    for directory in (run_dir, run_dir / TEXT_DIR, checkpoint_dir(run_dir)):
        entries = list(directory.iterdir()) if directory.is_dir() else []
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file() \
                    and not live_writer(entry.name):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry)
    if removed:
        get_logger().info("removed %d unfinished write(s) in %s", len(removed), run_dir)
    return removed


# Keys whose change makes a checkpoint unusable: the network's shape and the vocabulary/data.
UNSAFE_KEYS: frozenset[str] = frozenset(
    {
        "model.d_model", "model.n_heads", "model.encoder_layers", "model.decoder_layers",
        "model.d_ff", "model.pre_norm", "model.tie_embeddings", "model.max_positions",
        "data.name", "data.source", "data.src_lang", "data.tgt_lang", "data.hub_config",
        "data.train_split", "data.valid_split", "data.max_length", "data.max_length_ratio",
        "data.dedup", "data.vocab_size", "data.spm_model_type", "data.character_coverage",
        "data.spm_max_sentences", "data.spm_normalization",
        # The saved data position indexes the batch stream these keys define (sampled
        # segmentations make an epoch's lengths, and so its batches).
        "train.seed", "train.pack_length", "train.max_source_length", "train.max_target_length",
        "train.subword_alpha", "train.subword_nbest", "train.subword_sides",
        # The parent's weights are read once, when a run starts: a resume would not read them.
        "train.init_from", "train.init_average",
    }
)
# Keys naming the weights a child run started from: another parent is refused, none (a child
# going on from its own checkpoints, whatever its parent became) is safe.
PARENT_KEYS: frozenset[str] = frozenset({"train.init_from", "train.init_average"})
# Keys a checkpoint that saved its batch budget (``data_state["max_tokens"]``) lets change: the
# epoch keeps the batches it had done and batches the pairs it has not seen anew
# (BatchStream.load_state_dict).
REBATCH_KEYS: frozenset[str] = frozenset({"train.max_tokens"})
# Keys that may change: training goes on correctly but is no longer an exact continuation.
INEXACT_KEYS: frozenset[str] = frozenset(
    {
        "model.dropout", "model.attention_dropout", "model.activation_dropout",
        "train.update_freq", "train.lr_schedule", "train.lr", "train.lr_factor", "train.warmup_steps", "train.label_smoothing",
        "train.adam_betas", "train.adam_eps", "train.weight_decay", "train.clip_norm",
        "train.precision", "train.compile", "train.valid_bleu", "train.valid_metric", "train.valid_max_sentences",
    }
)
# Keys of what a run computes on: compared as run (:func:`hardware_changes`) where the checkpoint
# records it, else as configured, and then inexact.
HARDWARE_KEYS: frozenset[str] = frozenset({"train.device", "train.num_threads"})
# Keys with no effect on the trajectory (stopping, logging, where the files go, decoding, evaluation).
SAFE_KEYS: frozenset[str] = frozenset(
    {
        *HARDWARE_KEYS, "train.max_steps",
        "train.max_epochs", "train.max_minutes", "train.patience", "train.valid_every",
        "train.keep_last", "train.keep_best", "train.log_every", "train.max_nonfinite", "train.progress",
        "data.num_workers", "data.test_splits", "data.prepared_dir",
    }
)


def _classify(key: str, rebatchable: bool, hardware_kept: bool = True) -> str:
    """'unsafe', 'inexact' or 'safe'; unknown keys: model/data unsafe, train inexact, decode safe;
    :data:`REBATCH_KEYS` inexact when ``rebatchable``, else unsafe; :data:`HARDWARE_KEYS`
    inexact unless the checkpoint keeps what the run computed on (``hardware_kept``)."""
    if key in HARDWARE_KEYS and not hardware_kept:
        return "inexact"
    if key in REBATCH_KEYS:
        return "inexact" if rebatchable else "unsafe"
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


def check_resume_config(saved: dict, new: dict, where: str = "resume", *, rebatchable: bool = False,
                        hardware_kept: bool = True, parent_checked: bool = False, content_kept: bool = False) -> list[str]:
    """Compare the config a checkpoint was trained with to the one given for resuming.

    Both are ``Config.to_dict()`` dicts; a key missing from ``saved`` (an older mtcli) counts
    as its dataclass default. Three kinds of change:

    * refused (:data:`UNSAFE_KEYS`, any unknown ``model.*``/``data.*`` key): the model shape
      and everything that builds the vocabulary or the training data. Also ``train.seed``,
      ``train.pack_length`` and ``train.max_source_length``/``max_target_length``: the saved
      data position is an index into the batch stream these keys define, so resuming under
      new values would silently repeat or skip data. To change them, start a new run
      directory. One :class:`CheckpointError` names every such key as ``key: old -> new``.
    * allowed but inexact (:data:`INEXACT_KEYS`, unknown ``train.*`` keys): dropout,
      ``update_freq`` and optimiser/schedule hyperparameters; training stays correct (the
      data position counts batches, not updates) but no longer matches an uninterrupted run.
      Returned as ``"key: old -> new (resume no longer exact)"``. ``train.max_tokens`` too
      when ``rebatchable`` (the checkpoint saved its batch budget: the pairs the epoch has not
      seen are batched anew), else refused.
    * safe (:data:`SAFE_KEYS`, ``decode.*``): stopping rules, logging, decoding; and
      ``train.init_from`` set to none, or any :data:`PARENT_KEYS` change when ``parent_checked``
      (:func:`~mtcli.train.parent.check_parent_unchanged` found them naming the weights the run
      started from). Returned as ``"key: old -> new"``. ``data.source`` too, and the
      ``source`` of ``data.sources`` items, when ``content_kept`` (the checkpoint records its
      pairs' sha256, which :func:`check_resume_data` compares: the same files read elsewhere).

    The caller logs the returned strings and applies the new config.
    """
    refused: list[str] = []
    changes: list[str] = []
    for section in sorted(set(saved) | set(new)):
        old_body = dict(_section_defaults(section))
        old_body.update(saved.get(section) or {})
        new_body = new.get(section) or {}
        if section == "data":
            old_body, new_body = _as_read(old_body, new_body)
        for key in sorted(set(old_body) | set(new_body)):
            old_value = old_body.get(key, "<unset>")
            new_value = new_body.get(key, "<unset>")
            dotted = f"{section}.{key}"
            if _same(old_value, new_value) or dotted == "train.run_dir":  # found there: where it is, not a setting
                continue
            older = key not in (saved.get(section) or {})  # a checkpoint of an mtcli without the key: its default
            text = _item_changes(dotted, old_value, new_value) or (
                f"{dotted}: {old_value!r}{' (from before the key existed)' if older else ''} -> {new_value!r}")
            if key not in new_body and section in SECTIONS:  # a key of the mtcli that trained it
                text = f"{dotted}: {old_value!r}, a key this mtcli no longer has"
            kind = _classify(dotted, rebatchable, hardware_kept)
            if dotted == "train.max_steps" and (new.get("train") or {}).get("cooldown_steps", 0) > 0:
                kind = "inexact"  # the cooldown's start moves with it: the learning rate changes
            if dotted in PARENT_KEYS and (parent_checked or not (new.get("train") or {}).get("init_from")):
                kind = "safe"  # let go of its parent, or named its parent again (the weights it started from)
            if dotted in ("data.source", "data.sources") and content_kept and _same(*map(_placeless, (old_value,
                                                                                                new_value))):
                kind = "safe"  # read from another place: the pairs themselves are compared (check_resume_data)
            if kind == "unsafe":
                refused.append(text)
            elif kind == "inexact":
                changes.append(f"{text} ({INEXACT})")
            else:
                changes.append(text)
    if refused:
        raise CheckpointError(
            f"{where}: cannot resume: the config changes keys the checkpoint depends on: "
            f"{'; '.join(refused)} (restore them, setting a key from before it existed to that value, or use a new "
            "run directory)"
        )
    return changes


def _run_decode(run_dir: Path) -> dict[str, Any] | None:
    """The decode section of the run's config.yaml, or None where it cannot be read."""
    try:
        return load_config(run_dir / CONFIG_NAME, lenient=True).to_dict()["decode"]
    except ConfigError:
        return None


def _as_read(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two data sections as prepare reads them, so that a change that changes nothing is none:
    a corpus's ``langs`` left out is the run's pair; ``data.spm_model`` is its file, however
    spelled; and given one, the keys that would have trained a model are not read
    (:data:`~mtcli.data.prepare.SPM_TRAINING_KEYS`)."""
    bodies = []
    for body in (old, new):
        body = dict(body)
        pair = [body.get("src_lang"), body.get("tgt_lang")]
        if isinstance(body.get("sources"), list):
            body["sources"] = [dict(item, langs=item.get("langs") or pair) if isinstance(item, dict) else item
                               for item in body["sources"]]
        if body.get("spm_model"):
            body["spm_model"] = str(Path(body["spm_model"]).resolve())
        bodies.append(body)
    if bodies[0].get("spm_model") and bodies[1].get("spm_model"):
        for body in bodies:
            for key in SPM_TRAINING_KEYS:
                body.pop(key, None)
    return bodies[0], bodies[1]


def _placeless(value: Any) -> Any:
    """``data.sources`` without where each corpus is read from (``data.source``: None)."""
    if isinstance(value, list):
        return [{k: v for k, v in item.items() if k != "source"} if isinstance(item, dict) else item for item in value]
    return None


def _item_changes(dotted: str, old: Any, new: Any) -> str:
    """Two lists of mappings (``data.sources``) told apart item by item,
    ``data.sources[1].weight: 0.5 -> 0.6``, or one the other's start and more,
    ``data.sources[2]: added {...}``; "" for any other pair of values."""
    if not (isinstance(old, list) and isinstance(new, list) and all(isinstance(item, dict) for item in [*old, *new])):
        return ""
    if len(old) != len(new) and not all(_same(a, b) for a, b in zip(old, new, strict=False)):
        return ""  # inserted or removed inside the list: both lists, whole, say it best
    found = [f"{dotted}[{i}].{key}: {a.get(key)!r} -> {b.get(key)!r}" for i, (a, b) in enumerate(zip(old, new, strict=False))
             for key in sorted(set(a) | set(b)) if not _same(a.get(key), b.get(key))]
    found += [f"{dotted}[{i}]: added {item!r}" for i, item in enumerate(new[len(old):], len(old))]
    found += [f"{dotted}[{i}]: removed {item!r}" for i, item in enumerate(old[len(new):], len(new))]
    return "; ".join(found)


def kept_model_sha256(run_dir: Path, saved: str | None, cache_model: Path) -> str | None:
    """``saved``, the sha256 of the SentencePiece model a run's checkpoints name, when the cache's
    model ``cache_model`` is other bytes of that same model (prepared again by another mtcli)
    and the run's own copy is the file they name; else None. A resumed run then keeps its own
    copy; a child run starts from such a parent."""
    own = run_dir / SPM_NAME
    if saved is None or not own.is_file() or not cache_model.is_file() or cache_model.name != SPM_NAME:
        return None
    if sha256_file(own) != saved or not same_model(own, cache_model):
        return None
    get_logger().info("%s is %s in other bytes (the same pieces and ids)", cache_model, own)
    return saved


def check_resume_data(saved: dict[str, str], now: dict[str, str], where: str, cache: Path) -> None:
    """Refuse a resume on other training or validation pairs than the checkpoint's
    (:meth:`~mtcli.data.cache.PreparedCorpus.content_sha256`; a checkpoint of an older mtcli
    records none): the saved data position indexes the training pairs, and the best
    checkpoint and patience compare scores on the validation pairs."""
    changed = [what for what, key in (("training", "train"), ("validation", "valid"))
               if saved.get(key) is not None and saved[key] != now.get(key)]
    if changed:
        raise CheckpointError(
            f"{where}: cannot resume: the {' and '.join(changed)} pairs of {cache} are not the checkpoint's (the "
            "cache was prepared again from other data); use a new run directory (train.init_from starts it from "
            "this run's weights)")


def _processes(state: dict[str, Any]) -> tuple[int, int, int | None]:
    """The process count, ``train.update_freq`` and ``train.max_tokens`` a checkpoint was saved
    under (None: not recorded)."""
    saved = int(state.get("world_size") or len(state.get("rng_ranks") or []) or 1)
    train = (state.get("config") or {}).get("train") or {}
    tokens = train.get("max_tokens")
    return saved, int(train.get("update_freq", 1)), None if tokens is None else int(tokens)


def _slots(max_tokens: int, pack_length: int) -> int:
    """The tokens a batch holds: ``max_tokens``, or under ``train.pack_length`` the whole rows
    of that many slots it fits (1,600 tokens in rows of 128: 12 rows, 1,536)."""
    return pack_length * rows_per_batch(max_tokens, pack_length) if pack_length > 0 else max_tokens


def _update_sizes(state: dict[str, Any], world_size: int, update_freq: int,
                  max_tokens: int | None, pack_length: int = 0) -> tuple[int, int]:
    """An update's size in the checkpoint's run and in this one: processes x batches x tokens
    (the whole packed rows' slots under ``train.pack_length``; x batches where either budget is
    not known)."""
    saved, saved_freq, saved_tokens = _processes(state)
    known = saved_tokens is not None and max_tokens is not None
    saved_pack = int(((state.get("config") or {}).get("train") or {}).get("pack_length") or 0)
    return (saved * saved_freq * (_slots(saved_tokens, saved_pack) if known else 1),
            world_size * update_freq * (_slots(max_tokens, pack_length) if known else 1))


def process_change(state: dict[str, Any], world_size: int, update_freq: int,
                   max_tokens: int | None = None, pack_length: int = 0) -> str | None:
    """How the process count differs from the checkpoint's, as a config change is logged, or
    None: every process takes ``update_freq`` batches of ``max_tokens`` an update, so the
    update's size changes with their number, unless ``train.update_freq`` or
    ``train.max_tokens`` changed the other way (1 GPU of 25,000 tokens to 8 of 3,200: as large).
    Either way the resume is inexact where dropout is on: each process draws its own masks."""
    saved, saved_freq, saved_tokens = _processes(state)
    if saved == world_size:
        return None
    known = saved_tokens is not None and max_tokens is not None
    before, now = _update_sizes(state, world_size, update_freq, max_tokens, pack_length)
    if before == now:
        moved = [f"train.update_freq {saved_freq} -> {update_freq}"] if saved_freq != update_freq else []
        moved += [f"train.max_tokens {saved_tokens} -> {max_tokens}"] if known and saved_tokens != max_tokens else []
        moved_text = f" with {' and '.join(moved)}" if moved else ""
        return (f"processes: {saved} -> {world_size}{moved_text}: each update as large as before ({INEXACT} where "
                "dropout is on: each process draws its own masks)")
    ratio = Fraction(now, before)
    size = f"{ratio.numerator}x" if ratio.denominator == 1 else f"{ratio.numerator}/{ratio.denominator}"
    return f"processes: {saved} -> {world_size} (each update {size} the size; {INEXACT})"


def _same(a: Any, b: Any) -> bool:
    """Equality that treats lists and tuples alike and 1 == 1.0 (YAML round trips)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def check_same_config_file(state: dict[str, Any], config_path: str, run_dir: Path) -> None:
    """Refuse (:class:`ConfigError`) to resume a run from another config file than the one it was
    last trained from, both still there: two recipes of one name (``exp1/config.yaml`` and
    ``exp2/config.yaml``) name one run, so the second went on training the first's, with its own
    settings, and the first's checkpoints were the second's from then on. Nothing is refused for
    the same file by any path, a moved one, or the run's own ``config.yaml`` now or then."""
    saved, own = state.get("config_file"), run_dir / CONFIG_NAME
    if not saved or config_path == "<config>" or not Path(saved).is_file():
        return
    if any(_same_file(a, b) for a, b in ((config_path, own), (saved, config_path), (saved, own))):
        return
    raise ConfigError(
        f"{run_dir} was trained from {saved}, not from {Path(config_path).resolve()}: going on would train that "
        f"run with this config's settings; set train.run_dir for a run of this config's own (a run is named after "
        f"its config file's name), or go on with the run's own config: mtcli train {own} [--set KEY=VALUE]")


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` are one file (through ``..`` or a link); False when one is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def hardware(device: torch.device) -> dict[str, Any]:
    """What a run computes on, as a checkpoint keeps it: the device (a GPU by its name), and on a
    CPU the threads its sums are split over (another count rounds them otherwise)."""
    if device.type == "cuda":
        return {"device": f"cuda ({torch.cuda.get_device_name(device)})"}
    return {"device": device.type, "threads": torch.get_num_threads()}


def hardware_changes(saved: dict[str, Any] | None, here: dict[str, Any]) -> list[str]:
    """How the device and threads of a resume differ from the checkpoint's (``saved``: none in a
    checkpoint from before they were kept), each an inexact resume, whatever the config says."""
    return [f"{key}: {saved[key]} -> {value} ({INEXACT})" for key, value in here.items()
            if saved is not None and key in saved and saved[key] != value]


def resume_changes(state: dict[str, Any], new: dict[str, Any], world_size: int, where: str,
                   here: dict[str, Any] | None = None, parent_checked: bool = False,
                   run_dir: Path | None = None) -> list[str]:
    """Every change a resume from ``state`` under the config ``new`` (``Config.to_dict()``),
    ``world_size`` processes and the device and threads ``here`` (:func:`hardware`) makes, to
    log (:func:`check_resume_config` refuses the unsafe ones): a change of
    ``train.update_freq`` that keeps each update as large under another process count is said
    once, with the processes. ``parent_checked``: see :func:`check_resume_config`. The decode
    settings are compared with ``run_dir``'s config.yaml where it has them: a start of a
    finished run takes new ones there, not into its checkpoint (they were said again at every
    later start)."""
    saved = dict(state.get("config") or {})
    decode = _run_decode(run_dir) if run_dir is not None else None
    if decode is not None:
        saved["decode"] = decode
    changes = check_resume_config(saved, new, where,
                                  rebatchable="max_tokens" in (state.get("data_state") or {}),
                                  hardware_kept=state.get("hardware") is not None, parent_checked=parent_checked,
                                  content_kept=bool((state.get("data") or {}).get("train")))
    changes += hardware_changes(state.get("hardware"), here or {})
    train = new.get("train") or {}
    update_freq, max_tokens = int(train.get("update_freq", 1)), train.get("max_tokens")
    budget = (None if max_tokens is None else int(max_tokens), int(train.get("pack_length") or 0))
    process = process_change(state, world_size, update_freq, *budget)
    if process is None:
        return changes
    before, now = _update_sizes(state, world_size, update_freq, *budget)
    if before == now:  # said with the processes
        changes = [change for change in changes if not change.startswith("train.update_freq:")]  # (max_tokens: rebatched)
    return [*changes, process]
