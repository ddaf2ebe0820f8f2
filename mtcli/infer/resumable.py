"""``mtcli translate -o FILE`` that survives an interruption: the same command goes on from where
the last one stopped, instead of translating millions of lines again.

The output grows in ``.FILE.partial`` beside ``FILE``. After each window of input lines (a window
is decoded on its own, so the lines after it come out the same whether or not a run stopped
there) it is flushed to disk, and ``.FILE.partial.json`` records how many input lines and output
bytes it holds, and the key of what made them: the inputs' sha256, the model's weights and the
decode settings that shape a translation (:func:`translation_key`; the caller leaves out those
that only batch the lines). A later run with the same key keeps the partial
output up to that record (bytes written after it, by a run killed mid-window, are cut off) and
goes on from the next line; a run with another key starts over. When every line is done the
partial file is renamed to ``FILE``, so ``FILE`` is never partial. An error in the input's text (a
byte that is not UTF-8) keeps nothing: the input mended is other input, which starts over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from mtcli.errors import DataError
from mtcli.fileio import (
    TEMP_NAME_EXTRA,
    atomic_write,
    fsync_dir,
    make_file_parent,
    named_after,
    replaced_mode,
    still_names,
)
from mtcli.logs import get_logger
from mtcli.version import __version__


def translation_key(model: torch.nn.Module, inputs: Sequence[str], settings: dict[str, Any]) -> str:
    """sha256 over what an output's lines depend on: the inputs' contents in order (``inputs``:
    their sha256), ``model``'s weights (an average or an ensemble included) and ``settings``
    (the decode settings, the engine, the output format; JSON-serialisable)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    record = {"inputs": list(inputs), "model": digest.hexdigest(),
              "settings": settings, "mtcli": __version__}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass
class PartialOutput:
    """The open partial output of :func:`resumable_output`: write lines to :attr:`handle`, call
    :meth:`commit` at the end of each window."""

    handle: IO[str]
    data: Path  # the partial file open in handle
    record: Path
    key: str
    done: int  # input lines whose output the partial file held when it was opened
    committed: int  # input lines recorded by the last commit
    size: int  # the bytes of their output

    def discard(self) -> None:
        """Keep nothing of this output when the run ends (its lines are not what its key says:
        an input rewritten while it was read)."""
        self.record.unlink(missing_ok=True)

    def commit(self, lines: int) -> None:
        """Record that the output of the first ``lines`` input lines is complete, on disk."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        if not still_names(self.handle.fileno(), self.data):  # not recorded in a directory made anew
            raise FileNotFoundError(errno.ENOENT, "removed while it was written", str(self.data))
        size = os.fstat(self.handle.fileno()).st_size
        with atomic_write(self.record) as out:
            json.dump({"key": self.key, "lines": lines, "bytes": size}, out)
        self.committed, self.size = lines, size


def partial_paths(output: Path) -> tuple[Path, Path]:
    """Where the output of an unfinished translation to ``output`` grows, and its record."""
    return output.with_name(f".{output.name}.partial"), output.with_name(f".{output.name}.partial.json")


def _name_max(directory: Path) -> int:
    """The longest file name ``directory``'s file system takes (255 where it does not say)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


@contextlib.contextmanager
def resumable_output(output: Path, key: str) -> Iterator[PartialOutput]:
    """The partial output for ``output`` (see the module docstring), resumed when its record
    holds ``key``; renamed to ``output`` on leaving without an error. On an error it stays, as
    its last commit recorded it, and a warning says so; nothing is kept before the first commit.
    A second run on the same output while one is writing it raises ``BlockingIOError`` naming
    ``output`` (the partial file is locked while it is open)."""
    output = Path(output)
    make_file_parent(output)
    data, record = partial_paths(output)
    if len(os.fsencode(record.name)) + TEMP_NAME_EXTRA > _name_max(output.parent):  # said now, not after a window
        raise OSError(errno.ENAMETOOLONG, f"too long a name: the record beside it, {record.name[:24]}..., would "
                      "not fit the file system's names; give a shorter one", str(output))
    mode = replaced_mode(output)  # (a write-protected output: refused now, not after the translation)
    try:
        handle = open(data, "a", encoding="utf-8")
    except OSError as exc:  # named after the output asked for, not the hidden file beside it
        raise type(exc)(exc.errno, exc.strerror, str(output)) from None
    try:
        _lock(handle, output)
        if not still_names(handle.fileno(), data):  # the run that held the lock renamed it to the output meanwhile
            raise BlockingIOError(errno.EAGAIN, "another mtcli command has just finished this output", str(output))
        done, size = _resume_point(handle, record, key)
        os.ftruncate(handle.fileno(), size)  # bytes after the record: a run killed mid-window
        if done:
            get_logger().info("%s: resuming after input line %d (the output an interrupted run left in %s)",
                              output, done, data.name)
        else:
            record.unlink(missing_ok=True)
        partial = PartialOutput(handle, data, record, key, done, done, size)
        try:
            yield partial
            handle.flush()
            os.fsync(handle.fileno())
            try:
                os.fchmod(handle.fileno(), mode)
            except PermissionError:  # a partial file of another user's: its mode stays
                get_logger().warning("%s: written with the mode of %s, another user's file (not %o)", output,
                                     data.name, mode)
            os.replace(data, output)  # still locked: no other run takes it up in between
            record.unlink(missing_ok=True)
            fsync_dir(output.parent)
        except BaseException as exc:
            if not still_names(handle.fileno(), data):  # removed meanwhile, or its directory: nothing to keep
                if isinstance(exc, OSError):
                    raise FileNotFoundError(errno.ENOENT, f"removed while it was written (its directory, or "
                                            f"{data.name} beside it); nothing of it is kept", str(output)) from None
                raise
            if isinstance(exc, DataError):  # the input must change, and changed input starts over
                partial.discard()
            _keep(partial, data, output)
            renamed = named_after(exc, output)
            if renamed is not None:
                raise renamed from exc
            raise
    finally:  # after a failed write, closing fails again on the same buffered lines: they are gone
        with contextlib.suppress(OSError):
            handle.close()


def _lock(handle: IO[str], output: Path) -> None:
    """Lock the partial file of ``output`` open in ``handle``; ``BlockingIOError`` naming
    ``output`` when another run holds it."""
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BlockingIOError(errno.EAGAIN, "another mtcli command is writing this output now", str(output)) from None
    except OSError:  # a file system without locks (some network mounts): go on unguarded
        pass


@contextlib.contextmanager
def output_locked(output: Path) -> Iterator[None]:
    """Hold the lock :func:`resumable_output` takes, for a run that writes ``output`` at once
    (its input a stream, read once): a run of either kind on that output meanwhile is refused.
    The partial file that holds the lock is removed after, when this run made it or it holds
    nothing to resume (no record: one a killed run left before its first window)."""
    data, record = partial_paths(output)
    make_file_parent(output)
    try:
        try:
            handle, made = os.fdopen(os.open(data, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "a"), True
        except FileExistsError:  # a run interrupted while it wrote a file's translation left it
            handle, made = open(data, "a", encoding="utf-8"), False
    except OSError as exc:  # named after the output asked for, not the hidden file beside it
        raise type(exc)(exc.errno, exc.strerror, str(output)) from None
    with handle:
        _lock(handle, output)  # (refused: the file is the other run's now, made here or not)
        if not still_names(handle.fileno(), data):  # the run that held it removed or renamed it meanwhile
            raise BlockingIOError(errno.EAGAIN, "another mtcli command has just finished this output", str(output))
        try:
            yield
        finally:
            if made or not record.exists():  # (without its record, nothing of it can be resumed)
                data.unlink(missing_ok=True)


def _keep(partial: PartialOutput, data: Path, output: Path) -> None:
    """After an error: the partial output up to its last commit, said in a warning; or nothing,
    when no window was finished. The last commit is the record on disk: a signal may come after
    the record was written and before :meth:`PartialOutput.commit` returned."""
    with contextlib.suppress(OSError):
        partial.handle.flush()
    committed, size = _resume_point(partial.handle, partial.record, partial.key)
    if not committed:
        for path in (partial.record, data):
            path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError):
        os.ftruncate(partial.handle.fileno(), size)  # the lines after the last commit go
    get_logger().warning("%s: the output of the first %d input lines is kept in %s; the same command goes "
                         "on from there", output, committed, data.name)


def _resume_point(handle: IO[str], record: Path, key: str) -> tuple[int, int]:
    """``(input lines, bytes)`` of the partial output open in ``handle`` to go on from: its
    record's, when that holds ``key`` and the file has those bytes; else ``(0, 0)``."""
    try:
        state = json.loads(record.read_text(encoding="utf-8"))
        lines, size = int(state["lines"]), int(state["bytes"])
        fits = state["key"] == key and os.fstat(handle.fileno()).st_size >= size
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0
    if not fits:
        get_logger().info("%s: left by a run of other input, model or settings; starting over", record.name)
        return 0, 0
    return lines, size
