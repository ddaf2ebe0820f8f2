"""The run directory: the contract between training and everything after it.

::

    <run_dir>/
      config.yaml          resolved config of the run
      spm.model            the joint SentencePiece model; or, in a run made by ``mtcli import-hf``
                           from a Marian model with separate source and target models, those two
                           (source.spm, target.spm) and vocab.json (piece -> id)
      manifest.json        the prepared cache's manifest (vocab, counts, hashes)
      text/<split>.<lang>  raw text of the valid and test splits (evaluate needs no cache)
      checkpoints/         checkpoint_last.pt, checkpoint_best.pt, checkpoint_<step>.pt, index.json
      tensorboard/         scalars
      train.log            text log
      train.lock           pid of the live trainer (:mod:`mtcli.runlock`)

After a validation, ``checkpoint_last.pt`` and ``checkpoint_best.pt`` are hard links to the step
file. ``checkpoints/index.json`` maps each step checkpoint to its validation scores, which rank
checkpoints for ``keep_best`` and ``--average-best``. This module names the files and keeps the
index; :mod:`mtcli.checkpoint` writes and reads the files themselves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mtcli.checkpoint import FORMAT, load_checkpoint
from mtcli.errors import CheckpointError, one_line
from mtcli.fileio import atomic_write
from mtcli.logs import get_logger
from mtcli.runlock import LOCK_NAME, RunLock

CONFIG_NAME = "config.yaml"
SPM_NAME = "spm.model"
SOURCE_SPM_NAME = "source.spm"
TARGET_SPM_NAME = "target.spm"
VOCAB_NAME = "vocab.json"
MANIFEST_NAME = "manifest.json"
TEXT_DIR = "text"
LAST_NAME = "checkpoint_last.pt"
BEST_NAME = "checkpoint_best.pt"
INDEX_NAME = "index.json"
#: The record every export directory holds (source checkpoint, shape): an output directory that
#: has it is one mtcli wrote, which a new export may replace (:func:`mtcli.builddir.atomic_dir`).
EXPORT_RECORD = "mtcli_export.json"
_STEP_RE = re.compile(r"^checkpoint_(\d+)\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def run_file_role(path: Path) -> str | None:
    """What ``path`` is to a run directory it lies in (its top level, ``text/`` or ``checkpoints/``): a
    file training or decoding reads ("the run's config", "a checkpoint training resumes from",
    ...), else None, for a file a command may write there (an average of its own name)."""
    parent = path.parent
    if (parent / CONFIG_NAME).is_file() and checkpoint_dir(parent).is_dir():
        own = {CONFIG_NAME: "the run's config", SPM_NAME: "its SentencePiece model",
               SOURCE_SPM_NAME: "its SentencePiece model", TARGET_SPM_NAME: "its SentencePiece model",
               VOCAB_NAME: "its vocabulary", MANIFEST_NAME: "its data manifest", LOCK_NAME: "its lock",
               # named by the layers above: mtcli.train.run, mtcli.train.parent, mtcli.infer.hf_import
               "train.log": "its log", "parent.json": "its parent's record", "import.json": "its import record",
               "learning_curves.png": "its learning curves"}
        return own.get(path.name)
    run = parent.parent
    if parent.name == TEXT_DIR and path.is_file() and (run / CONFIG_NAME).is_file() and checkpoint_dir(run).is_dir():
        return "the run's copy of a validation or test text, which evaluate reads"
    if parent == checkpoint_dir(run) and (run / CONFIG_NAME).is_file():
        if path.name == INDEX_NAME:
            return "its checkpoint index"
        if is_own_checkpoint_name(path.name):
            return "a checkpoint training resumes from and ranks"
    return None


def is_own_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one a training writes into ``checkpoints/`` and resumes from or ranks:
    ``checkpoint_last.pt``, ``checkpoint_best.pt``, ``checkpoint_<step>.pt``."""
    return name in (LAST_NAME, BEST_NAME) or bool(_STEP_RE.match(name))


def step_checkpoint_name(step: int) -> str:
    """File name of the checkpoint written at ``step``: ``checkpoint_<step>.pt``."""
    return f"checkpoint_{int(step)}.pt"


def step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint_<step>.pt`` in the run, oldest first."""
    directory = checkpoint_dir(run_dir)
    entries = directory.iterdir() if directory.is_dir() else []
    matches = [(_STEP_RE.match(p.name), p) for p in entries]
    return sorted((int(m.group(1)), p) for m, p in matches if m and p.is_file())


def read_index(run_dir: Path) -> dict[int, dict]:
    """``checkpoints/index.json`` as ``{step: {"file": name, "loss": float|None, "bleu": float|None}}``
    (and ``chrf``, and ``by``: the metric that picks the best, where the run recorded them).

    Missing index: ``{}``. Unreadable index: :class:`CheckpointError` naming the file.
    """
    path = checkpoint_dir(run_dir) / INDEX_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint index ({one_line(exc)})") from None
    try:
        entries = raw["checkpoints"]
        index = {int(step): dict(entry) for step, entry in entries.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{path}: malformed checkpoint index (expected 'checkpoints' mapping)") from None
    for step, entry in index.items():
        bad = _bad_entry(entry)
        if bad:
            raise CheckpointError(f"{path}: malformed checkpoint index (step {step}: {bad})")
    return index


def _bad_entry(entry: dict) -> str | None:
    """What is wrong with one index entry (hand-edited, say), or None."""
    for key in ("loss", "bleu", "chrf"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key} is {value!r}, not a number"
    if entry.get("by") not in (None, "loss", "bleu", "chrf"):
        return f"by is {entry.get('by')!r}, not loss, bleu or chrf"
    name = entry.get("file")
    if name is not None and (not isinstance(name, str) or not _STEP_RE.match(name)):
        return f"file is {name!r}, not a checkpoint_<step>.pt of this directory"
    return None


def update_index(run_dir: Path, step: int, valid: dict) -> None:
    """Record ``checkpoint_<step>.pt`` with its validation ``loss``/``bleu`` (``chrf``, ``by``) in index.json, atomically.

    An unreadable index is logged and rebuilt from the validation scores each step checkpoint
    keeps (so that ``keep_best`` still knows the best ones when it prunes).
    """
    try:
        entries = read_index(run_dir)
    except CheckpointError as exc:
        get_logger().warning("%s; rebuilding it from the step checkpoints", exc)
        entries = _entries_from_checkpoints(run_dir, step)
    entries[int(step)] = _entry(step, valid)
    body = {"format": FORMAT, "checkpoints": {str(s): entries[s] for s in sorted(entries)}}
    path = checkpoint_dir(run_dir) / INDEX_NAME
    try:
        with atomic_write(path) as handle:
            json.dump(body, handle, indent=1)
            handle.write("\n")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write checkpoint index ({exc.strerror or exc})") from None


def _entry(step: int, valid: dict) -> dict[str, Any]:
    """The index entry of ``checkpoint_<step>.pt``, validated with the scores ``valid``."""
    return {
        "file": step_checkpoint_name(step),
        "loss": None if valid.get("loss") is None else float(valid["loss"]),
        "bleu": None if valid.get("bleu") is None else float(valid["bleu"]),
        **{key: valid[key] for key in ("chrf", "by", "basis") if valid.get(key) is not None},
    }


def _entries_from_checkpoints(run_dir: Path, but: int) -> dict[int, dict]:
    """Index entries for the step checkpoints other than ``checkpoint_<but>.pt``, from the
    scores each keeps (an unreadable one is left out)."""
    entries = {}
    for step, path in step_checkpoints(run_dir):
        if step != but:
            try:
                entries[step] = _entry(step, load_checkpoint(path).get("valid") or {})
            except CheckpointError:
                continue
    return entries


#: What each score of a validation depends on beyond the model (an entry's ``basis``: the
#: trainer's ``train`` settings it was measured under).
BASIS_KEYS = {"loss": ("label_smoothing", "valid_max_sentences"), "bleu": ("valid_max_sentences",),
              "chrf": ("valid_max_sentences",)}


def _measured_alike(entry: dict, newest: dict, by: str) -> bool:
    """Whether ``entry``'s ``by`` score was measured as ``newest``'s (an entry of an older
    mtcli, without its ``basis``, counts as alike)."""
    mine, theirs = entry.get("basis"), newest.get("basis")
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return True
    return all(mine.get(key) == theirs.get(key) for key in BASIS_KEYS[by])


def _readable_index(run_dir: Path, instead: str) -> dict[int, dict] | None:
    """:func:`read_index`, or None with a warning that says what is done ``instead`` when it
    cannot be read (the next training step rebuilds it)."""
    try:
        return read_index(run_dir)
    except CheckpointError as exc:
        get_logger().warning("%s; %s", exc, instead)
        return None


def _ranking(run_dir: Path, present: bool = True, index: dict[int, dict] | None = None
             ) -> tuple[str, list[tuple[int, Path]]]:
    """The metric, and the indexed step checkpoints that still exist (``present=False``: or
    not), best first: by the metric that picked the newest one's best (``by``:
    ``train.valid_metric``; an older index, BLEU) if all have it, else by loss; of equal scores
    the earliest first, as ``checkpoint_best`` keeps it. Those scored otherwise than the newest
    (a resume under another label smoothing, say) come after the others: their scores do not
    compare."""
    directory = checkpoint_dir(run_dir)
    index = read_index(run_dir) if index is None else index
    by = (index[max(index)].get("by") or "bleu") if index else "bleu"
    rows = []
    for step, entry in index.items():
        path = directory / str(entry.get("file") or step_checkpoint_name(step))
        if path.is_file() or not present:
            rows.append((step, path, entry.get(by), entry.get("loss")))
    if not (by != "loss" and rows and all(r[2] is not None for r in rows)):
        by, rows = "loss", [(step, path, loss, loss) for step, path, _, loss in rows if loss is not None]
    newest = index[max(index)] if index else {}
    rows.sort(key=lambda r: (not _measured_alike(index[r[0]], newest, by),
                             float(r[2]) if by == "loss" else -float(r[2]), r[0]))
    return by, [(r[0], r[1]) for r in rows]


def prune_checkpoints(run_dir: Path, keep_last: int, keep_best: int = 0) -> None:
    """Delete ``checkpoint_<step>.pt`` files beyond the newest ``keep_last``.

    ``checkpoint_last.pt``/``checkpoint_best.pt`` are never touched, nor the step files they are
    hard links to (removing one frees no space, and ``--best 1`` would find no step of the best);
    with ``keep_best`` > 0 the best ``keep_best`` indexed step checkpoints are kept too (for
    ``--average-best``).
    """
    steps = step_checkpoints(run_dir)
    keep = {p for _, p in steps[-keep_last:]} if keep_last > 0 else set()
    linked = [checkpoint_dir(run_dir) / name for name in (LAST_NAME, BEST_NAME)]
    keep |= {p for _, p in steps if any(_same_file(p, other) for other in linked)}
    if keep_best > 0:
        try:
            keep |= {p for _, p in _ranking(run_dir)[1][:keep_best]}
        except CheckpointError as exc:
            get_logger().warning("%s; keeping only the last %d", exc, keep_last)
    for _, path in steps:
        if path not in keep:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                get_logger().warning("cannot remove old checkpoint %s (%s)", path, exc.strerror or exc)


def _same_file(path: Path, other: Path) -> bool:
    try:
        return path.samefile(other)
    except OSError:  # (one of them not there)
        return False


def select_checkpoints(run_dir: Path, last: int = 0, best: int = 0) -> list[Path]:
    """The step checkpoints to average: the newest ``last`` or the best ``best`` by index.json.

    Exactly one of ``last``/``best`` must be > 0. "Best" ranks by the run's
    ``train.valid_metric`` (BLEU, chrF or loss) when every indexed checkpoint has it, else by
    validation loss. Paths are returned oldest step first.
    """
    run_dir = Path(run_dir)
    if (last > 0) == (best > 0) or last < 0 or best < 0:
        raise CheckpointError(f"give exactly one of last=K or best=K (> 0), got last={last}, best={best}")
    if last:
        steps = step_checkpoints(run_dir)
        if len(steps) < last:
            raise CheckpointError(
                f"{checkpoint_dir(run_dir)}: asked for the last {last} checkpoints, found "
                f"{len(steps)}: {names(p for _, p in steps)}{no_checkpoint_yet(run_dir) if not steps else ''}"
            )
        index = _readable_index(run_dir, f"the last {last} by their names")  # (read for a warning only)
        if index is not None:
            _warn_of_removed(sorted(index)[-last:], steps[-last:], f"last {last}")
        return [p for _, p in steps[-last:]]
    index = _readable_index(run_dir, "ranking the step checkpoints by the scores each keeps")
    if index is None:  # as the next training step rebuilds it
        index = _entries_from_checkpoints(run_dir, but=-1)
    by, ranked = _ranking(run_dir, index=index)
    if len(ranked) < best:
        raise CheckpointError(
            f"{checkpoint_dir(run_dir) / INDEX_NAME}: asked for the best {best} checkpoints, "
            f"{len(ranked)} indexed with scores still exist: {names(p for _, p in ranked)}"
        )
    indexed_by, indexed = _ranking(run_dir, present=False, index=index)
    if indexed_by == by:  # (a missing entry without the metric: the index ranked by loss, not comparable)
        _warn_of_removed([step for step, _ in indexed[:best]], ranked[:best], f"best {best}")
    return [p for _, p in sorted(ranked[:best])]


def no_checkpoint_yet(run_dir: Path) -> str:
    """What to add to an error about a run without a checkpoint: it is still training (who holds
    its lock), or it has not been trained."""
    training = RunLock(run_dir).holder()
    if training:
        return (f"; it is still training ({training}): its first checkpoint comes at the first validation, "
                "train.valid_every steps in")
    return "; train it first (mtcli train CONFIG)"


def _warn_of_removed(wanted: list[int], chosen: list[tuple[int, Path]], which: str) -> None:
    """Say so when the ``which`` checkpoints by the index (the steps ``wanted``) are not the ones
    still on disk that are ``chosen``: pruned by ``train.keep_last``, the others stand in."""
    gone = sorted(set(wanted) - {step for step, _ in chosen})
    if gone:
        get_logger().warning("the %s checkpoints by the index are steps %s; %s not on disk (removed as "
                             "train.keep_last and train.keep_best say, still being saved by a running training, or never "
                             "written): using %s", which,
                             ", ".join(map(str, sorted(wanted))),
                             ", ".join(map(str, gone)) + (" is" if len(gone) == 1 else " are"),
                             names(p for _, p in sorted(chosen)))


def names(paths: Any) -> str:
    """``"a.pt, b.pt"`` for messages (``"none"`` when empty)."""
    listed = [p.name for p in paths]
    return ", ".join(listed) if listed else "none"
