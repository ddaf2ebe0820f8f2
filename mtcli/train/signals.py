"""SIGINT/SIGTERM during training, and SIGHUP (a closed ssh session or terminal) unless the
process ignores it (``nohup``): finish the step, save ``checkpoint_last``, then stop. A
validation is cut short instead (:meth:`StopSignals.cutting`): it changes nothing the
checkpoint holds, and the resumed run validates that step first."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from mtcli.errors import hang_ups
from mtcli.logs import get_logger


class ValidationCut(BaseException):
    """A stop signal came during a validation that :meth:`StopSignals.cutting` let it cut short
    (a BaseException, as KeyboardInterrupt: raised inside a log call, logging would swallow an
    Exception)."""


class StopSignals:
    """Record SIGINT/SIGTERM instead of dying, so the loop can checkpoint and stop cleanly."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._cut = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # the first signal is the one the stop reports (torchrun follows
            # a Ctrl-C's SIGINT with its own SIGTERM to the ranks); recorded before it is said
            self.signum = signum
            get_logger().warning("received %s: %s, then saving checkpoint_last", signal.Signals(signum).name,
                                 "stopping the validation" if self._cut else "finishing this step")
        if self._cut:
            self._cut = False
            raise ValidationCut

    @contextlib.contextmanager
    def cutting(self, enabled: bool = True) -> Iterator[None]:
        """Inside, a stop signal (or one already received) raises :class:`ValidationCut` rather
        than waiting for the end of the block: for a validation, whose work a stop loses nothing
        of. ``enabled=False`` (ranks of DDP, which stop together): the block runs to its end."""
        if enabled and self.signum is not None:
            raise ValidationCut
        self._cut = enabled and bool(self._previous)
        try:
            yield
        finally:
            self._cut = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, *hang_ups()):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signum is None:
            self.restore()
        # else a stop is under way: a later signal (torchrun's to the other ranks once one has
        # exited) is only recorded, so the shutdown finishes and says why, until restore()

    def restore(self) -> None:
        """Put back the handlers there were before (once)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
