"""Exclusive use of a run directory: one trainer at a time, a stale lock taken over.

A trainer holds ``run_dir/train.lock`` (pid, host, start time, boot id) while it runs. A second
trainer on the same run directory gets :class:`~mtcli.errors.RunLockedError` naming the holder;
a lock whose process is gone (or was another boot, or a reused pid) is taken over.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import time
import uuid
from pathlib import Path

from mtcli.errors import CheckpointError, RunLockedError
from mtcli.fileio import pid_alive
from mtcli.logs import get_logger

LOCK_NAME = "train.lock"


def _boot_id() -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return None


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    with contextlib.suppress(IndexError, ValueError):
        return int(text[text.rindex(")") + 2 :].split()[19])
    return None


class RunLock:
    """Exclusive use of a run directory by one trainer: ``with RunLock(run_dir): ...``.

    Acquiring creates ``run_dir/train.lock`` with ``O_CREAT | O_EXCL`` (atomic: of two
    processes, exactly one creates it) holding JSON with the pid, hostname, start time, boot id
    and the process start tick. If the file exists, its holder is checked: on this host, a pid
    that is gone (or reused by a newer process, or from before a reboot) makes the lock stale;
    it is logged and taken over. A live holder, or a holder on another host (whose liveness
    cannot be checked), raises :class:`RunLockedError` naming pid, host and start time.
    Leaving the ``with`` block removes the lock if it is still ours.
    """

    def __init__(self, run_dir: str | Path) -> None:
        """Prepare a lock on ``run_dir`` (not acquired until ``__enter__``/:meth:`acquire`)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.held = False

    def _content(self) -> bytes:
        started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                "boot_id": _boot_id(), "proc_start": _proc_start(os.getpid()), "token": self.token}
        return (json.dumps(info) + "\n").encode()

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._content())
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise CheckpointError(f"{self.path}: cannot write lock file ({exc.strerror or exc})") from None
        os.close(fd)
        return True

    def _stale_reason(self, raw: bytes) -> str | None:
        """Why the lock held in ``raw`` is stale, or None if its holder may be alive."""
        try:
            info = json.loads(raw.decode())
            pid = int(info["pid"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            with contextlib.suppress(OSError):
                if time.time() - self.path.stat().st_mtime > 10:
                    return "unreadable lock file"
            return None
        if info.get("host") != socket.gethostname():
            return None
        boot = _boot_id()
        if info.get("boot_id") and boot and info["boot_id"] != boot:
            return f"pid {pid} ran before this machine rebooted"
        if not pid_alive(pid):
            return f"pid {pid} is not running"
        start = info.get("proc_start")
        now = _proc_start(pid)
        if start is not None and now is not None and int(start) != now:
            return f"pid {pid} now belongs to another process"
        return None

    def _holder(self, raw: bytes) -> str:
        try:
            info = json.loads(raw.decode())
            return f"pid {info.get('pid')} on host {info.get('host')} since {info.get('started')}"
        except (ValueError, UnicodeDecodeError, AttributeError):
            return "an unknown process (lock file being written)"

    def holder(self) -> str | None:
        """Who trains in the run directory now (``pid P on host H since T``); None when no lock
        is held, or its holder is gone."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return None
        return None if self._stale_reason(raw) is not None else self._holder(raw)

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunLockedError`; a stale lock is taken over."""
        if self.held:
            return self
        log = get_logger()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._try_create():
                self.held = True
                return self
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                continue  # released between our create and read: try again
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot read lock file ({exc.strerror or exc})") from None
            reason = self._stale_reason(raw)
            if reason is None:
                raise RunLockedError(
                    f"{self.run_dir}: run directory is in use by {self._holder(raw)} "
                    f"(lock file {self.path}; remove it only if that process is gone)"
                )
            self._take_over(raw)
            log.warning("stale lock %s (%s, %s) taken over", self.path, self._holder(raw), reason)
        raise RunLockedError(f"{self.run_dir}: could not take the lock {self.path} (it keeps changing)")

    def _take_over(self, raw: bytes) -> None:
        """Remove the stale lock whose bytes are ``raw``, unless someone replaced it meanwhile."""
        aside = self.path.with_name(f".{LOCK_NAME}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_bytes() != raw:
                # Another process took the lock over first: put its lock back, without clobbering.
                with contextlib.suppress(OSError):
                    os.link(aside, self.path)
                raise RunLockedError(
                    f"{self.run_dir}: run directory was just taken by {self._holder(aside.read_bytes())}"
                )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(aside)

    def release(self) -> None:
        """Remove the lock file if this object holds it and it still carries our token."""
        if not self.held:
            return
        self.held = False
        try:
            info = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if info.get("token") == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def __enter__(self) -> RunLock:
        """Acquire; see :meth:`acquire`."""
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        """Release; see :meth:`release`."""
        self.release()


__all__ = ["LOCK_NAME", "RunLock", "pid_alive"]
