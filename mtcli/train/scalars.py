"""A run's TensorBoard scalars (``run_dir/tensorboard``), which never stop its training: a write
that fails (a full disk) is one warning naming the directory, and the scalars stop there, while
``train.log`` and the checkpoints (each of which says so when it cannot be written) go on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from mtcli.logs import get_logger


def _quiet_event_threads() -> None:
    """Keep the traceback of TensorBoard's writing thread off the console: the error it died of
    comes back in the training's thread at the next write, where :class:`Scalars` says it in one
    line."""
    previous = threading.excepthook
    if getattr(previous, "mtcli_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.mtcli_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Scalars:
    """``SummaryWriter``'s ``add_scalar``, ``flush`` and ``close`` for ``directory``, each
    guarded (module docstring)."""

    def __init__(self, directory: Path, purge_step: int | None = None) -> None:
        _quiet_event_threads()
        self.directory = directory
        self._writer: SummaryWriter | None = None
        try:
            self._writer = SummaryWriter(str(directory), purge_step=purge_step)
        except OSError as exc:  # (the event file is made at once: a full disk, a directory not writable)
            get_logger().warning("%s: cannot write TensorBoard's scalars (%s); the training goes on without them",
                                 directory, exc.strerror or exc)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Log ``value`` as ``tag`` at ``step``."""
        self._guarded(lambda writer: writer.add_scalar(tag, value, step))

    def flush(self) -> None:
        """Write what is queued to the event file."""
        self._guarded(lambda writer: writer.flush())

    def close(self) -> None:
        """Flush and close the event file."""
        self._guarded(lambda writer: writer.close())
        self._writer = None

    def _guarded(self, call: Callable[[SummaryWriter], Any]) -> None:
        if self._writer is None:
            return
        try:
            call(self._writer)
        except OSError as exc:
            self._writer = None  # its thread has died: nothing more reaches the file
            get_logger().warning("%s: cannot write TensorBoard's scalars (%s); they stop here, the training "
                                 "goes on", self.directory, exc.strerror or exc)


__all__ = ["Scalars"]
