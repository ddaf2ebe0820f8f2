"""SIGINT/SIGTERM during training, and SIGHUP (a closed ssh session or terminal) unless the
process ignores it (``nohup``): finish the step, save ``checkpoint_last``, then stop."""

from __future__ import annotations

import signal
import threading
from typing import Any

from mtcli.logs import get_logger


class StopSignals:
    """Record SIGINT/SIGTERM instead of dying, so the loop can checkpoint and stop cleanly."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # the first signal is the one the stop reports (torchrun follows
            # a Ctrl-C's SIGINT with its own SIGTERM to the ranks)
            get_logger().warning("received %s: finishing this step, then saving checkpoint_last",
                                 signal.Signals(signum).name)
            self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL else []  # (nohup: ignored)
            for sig in (signal.SIGINT, signal.SIGTERM, *hangup):
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
