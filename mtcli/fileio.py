"""Atomic file writes and small file helpers shared by every step.

Every artifact mtcli writes (caches, checkpoints, reports, hypotheses) goes through
:func:`atomic_write` or :func:`atomic_dir` (:func:`atomic_link` gives a finished file a second
name): the data is written to a temporary name in the same directory, flushed to disk, then
renamed over the target. A crash or a full disk leaves either the old file or the new one,
never a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open()`` would give a new file (0o666 less the umask); mkstemp gives 0o600."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """The mode ``mkdir()`` would give a new directory (0o777 less the umask)."""
    return 0o777 & ~_umask()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename) to disk; a no-op where the OS does not support it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left untouched; an
    ``OSError`` that names no file (a failed write or flush: ``ENOSPC``, ``EFBIG``) is re-raised
    with ``path`` as its filename, so the one-line error says which output could not be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    binary = "b" in mode
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_file_mode())
        with os.fdopen(fd, mode, encoding=None if binary else encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            # A failed write/flush (disk full, file-size limit) names no file: name the target.
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a directory under a temporary name; on success swap it in for ``path``.

    The previous ``path`` (if any) is removed only after the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, default_dir_mode())
        yield tmp
        fsync_dir(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_link(source: str | Path, path: str | Path) -> None:
    """Make ``path`` a second name of the finished file ``source``, atomically.

    A hard link under a temporary name is renamed over ``path``, so no byte is written twice.
    Where hard links fail (the file system has none), the file is copied through
    :func:`atomic_write` instead. Either way ``path`` is never partial, and removing ``source``
    later leaves ``path`` intact.
    """
    source, path = Path(source), Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        os.link(source, tmp)
    except OSError:
        with atomic_write(path, "wb") as out, open(source, "rb") as inp:
            shutil.copyfileobj(inp, out)
        return
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_copy(source: str | Path, path: str | Path) -> None:
    """Copy ``source`` to ``path`` through :func:`atomic_write` (never a half-copied file)."""
    with atomic_write(path, "wb", encoding=None) as out, open(source, "rb") as inp:
        shutil.copyfileobj(inp, out)


def sha256_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
