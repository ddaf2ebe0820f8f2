"""A directory built whole under a temporary name, then swapped in (:func:`atomic_dir`): a
prepared cache, an export, an imported run. Readers find the old directory or the new one,
never a half-built one, and a build killed at any point is cleaned up, or put in place when it
was whole, by the next one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from mtcli.fileio import (
    another_alive,
    check_directory,
    default_dir_mode,
    fsync_dir,
    make_parent,
    pid_alive,
)

#: Inside a directory :func:`atomic_dir` is building: the builder's pid, so that a later build
#: removes what a killed one left (``.NAME.*.tmp``), and only that; ``PID complete`` once the
#: build is whole, so that one killed while it swapped it in is put in place (:func:`restore_swap`).
BUILDER_NAME = ".mtcli-builder.pid"
COMPLETE = "complete"


def _place(path: str | Path) -> Path:
    """Where a directory at ``path`` is built: the directory a symbolic link there points to
    (on its disk, beside it; the link stays), else ``path``."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _builds(path: Path) -> Iterator[tuple[Path, int]]:
    """The directories builds of ``path`` keep beside it, with their builder's pid: ``.NAME.*.tmp``
    (the pid in it, kept until after its swap) and ``.NAME.old-PID``."""
    for entry in path.parent.glob(f".{path.name}.*"):
        if not entry.is_dir():
            continue
        try:
            if entry.name.endswith(".tmp"):
                yield entry, int((entry / BUILDER_NAME).read_text().split()[0])
            elif ".old-" in entry.name:
                yield entry, int(entry.name.rsplit("-", 1)[1])
        except (OSError, ValueError):
            continue  # not one of ours, or still starting: left alone


def remove_stale_builds(path: Path) -> None:
    """Delete what killed builds of ``path`` left beside it: the directories of
    :func:`_builds` whose process is gone."""
    path = _place(path)
    for entry, pid in _builds(path):
        if not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def restore_swap(path: Path) -> bool:
    """Put in place the whole build of ``path`` that a process killed between the two renames of
    its swap left beside it (``path`` then missing: the old one moved aside, the new one not yet
    in); whether it did. Until then readers find no ``path``."""
    path = _place(path)
    if path.exists():
        return False
    for entry, pid in _builds(path):
        try:
            whole = (entry / BUILDER_NAME).read_text().split()[1:] == [COMPLETE]
        except OSError:
            continue
        if whole and entry.name.endswith(".tmp") and not another_alive(pid):
            try:
                os.replace(entry, path)
            except OSError:  # another process restored or built it meanwhile
                return path.exists()
            with contextlib.suppress(OSError):
                (path / BUILDER_NAME).unlink()
            fsync_dir(path.parent)
            remove_stale_builds(path)  # the old one it had moved aside
            return True
    return False


def live_builders(path: Path) -> list[int]:
    """The pids of other processes building ``path`` now (:func:`atomic_dir`)."""
    return [pid for entry, pid in _builds(_place(path)) if entry.name.endswith(".tmp") and another_alive(pid)]


#: What :func:`atomic_dir` leaves in each directory it builds: its mark and its entries, so that
#: it replaces only a directory holding nothing else (a run holds a copy of its cache's manifest).
CONTENTS_NAME = ".mtcli-contents.json"


def check_replaceable(path: Path, mark: str | None, derived: Collection[str] = ()) -> None:
    """Raise unless :func:`atomic_dir` may replace ``path`` (see there; a file is never swapped
    out for a directory): a command calls it before its work, so a wrong output is refused at
    once, not after the work. ``derived``: entries a later command makes from what was written
    (a conversion cache), replaced with it."""
    path = _place(path)
    check_directory(path)
    if os.path.ismount(path):
        raise OSError(errno.EBUSY, "a mount point: mtcli builds this directory beside it and swaps it in whole, "
                      "which cannot be done to a mount point; give a directory inside it", str(path))
    if mark is None or not path.is_dir() or not any(path.iterdir()):
        return
    if not (path / mark).exists():
        raise FileExistsError(errno.EEXIST, f"a directory of other files (it has no {mark}); give a new or "
                              "empty directory, mtcli replaces only what it wrote there", str(path))
    foreign = [name for name in _foreign_entries(path, mark) if name not in derived]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise FileExistsError(errno.EEXIST, f"holds files besides those mtcli wrote there ({shown}); give a new or "
                              "empty directory, or move them away: mtcli replaces only what it wrote there", str(path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _foreign_entries(path: Path, mark: str) -> list[str]:
    """The entries of ``path`` (which holds ``mark``) that :func:`atomic_dir` did not write: by
    its contents record; for a directory of an older mtcli, by what its mark says (a cache's
    manifest lists its files; an export's record names its run, an import's its model)."""
    names = {entry.name for entry in path.iterdir()} - {BUILDER_NAME}  # a build killed right after its swap
    contents = _read_json(path / CONTENTS_NAME)
    if isinstance(contents, dict) and contents.get("mark") == mark and isinstance(contents.get("entries"), list):
        return sorted(names - set(map(str, contents["entries"])) - {CONTENTS_NAME})
    record = _read_json(path / mark)
    if not isinstance(record, dict):  # a file of that name that is not mtcli's (a web app's manifest.json)
        return sorted(names)
    files = record.get("files")
    if isinstance(files, dict) and all(isinstance(k, str) and (path / k).is_file() for k in files):
        return sorted(names - set(files) - {mark})
    if {"run_dir", "checkpoint"} <= record.keys() or "max_logit_difference" in record:  # an export's, an import's
        return sorted(names & {"train.log", "eval", "tensorboard"})  # what training or scoring there added
    return sorted(names - {mark}) if {"build_key", "mtcli_version"} & record.keys() else sorted(names)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, mark: str | None, derived: Collection[str] = ()) -> Iterator[Path]:
    """Build a directory under a temporary name; on success swap it in for ``path``.

    The previous ``path`` (if any) is removed only after the new one is complete. ``mark`` names
    a file every directory of this kind holds (``manifest.json`` of a cache): a directory that is
    not empty and lacks it, or holds anything the build did not write (:data:`CONTENTS_NAME`
    records what it wrote), is not one mtcli wrote, so it is never replaced, and
    :class:`FileExistsError` is raised before anything is built (``mark=None``: the caller has
    checked, as ``--force`` does). ``derived``: see :func:`check_replaceable`. A file at ``path``
    raises :class:`NotADirectoryError`, a mount point (which cannot be renamed) an ``OSError``
    before anything is built. A symbolic link at ``path`` stays: the directory it points to is
    replaced, and built beside it, on its disk.
    """
    path = _place(path)
    check_replaceable(path, mark, derived)
    make_parent(path)
    remove_stale_builds(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as exc:  # a read-only directory: named as the output, not the hidden build
        raise type(exc)(exc.errno, f"{exc.strerror} (it is built beside it, in {path.parent}, then swapped in)",
                        str(path)) from None
    old = None
    try:
        os.chmod(tmp, default_dir_mode())
        (tmp / BUILDER_NAME).write_text(str(os.getpid()))
        yield tmp
        if mark is not None:
            entries = sorted(entry.name for entry in tmp.iterdir() if entry.name != BUILDER_NAME)
            (tmp / CONTENTS_NAME).write_text(json.dumps({"mark": mark, "entries": entries}) + "\n", encoding="utf-8")
        fsync_dir(tmp)
        (tmp / BUILDER_NAME).write_text(f"{os.getpid()} {COMPLETE}")  # whole: restore_swap may put it in
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        with contextlib.suppress(OSError):  # until here a killed build's directory is known for one
            (path / BUILDER_NAME).unlink()
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raced = old is not None and old.exists() and path.exists()  # another build's, put in between the renames
        if raced:
            shutil.rmtree(old, ignore_errors=True)
        elif old is not None and old.exists():  # the previous one, back in place
            with contextlib.suppress(OSError):
                os.replace(old, path)
        if isinstance(exc, OSError) and exc.errno is not None and str(exc.filename or tmp).startswith(str(tmp)):
            kept = ("another process put its own there meanwhile" if raced else
                    "the previous one is unchanged" if path.exists() else "nothing was written")
            raise type(exc)(exc.errno, f"{exc.strerror or exc}; {kept}", str(path)) from exc  # not the hidden build
        raise
