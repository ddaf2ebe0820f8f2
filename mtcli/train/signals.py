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


#: A SIGTERM in the ranks' summed stop flags (a SIGINT counts 1): up to 4,095 ranks, the sum
#: still says whether a Ctrl-C was among them (exact even in float32, to 2^24).
TERM_FLAG = 4096.0


class StopSignals:
    """Record SIGINT/SIGTERM instead of dying, so the loop can checkpoint and stop cleanly.

    Under DDP the ranks sum their :meth:`flag` with each step's numbers, and every rank stops at
    the step whose sum says one was signalled (:meth:`agree`, :meth:`stop_now`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.agreed = False
        self._previous: dict[int, Any] = {}
        self._cut = False

    def flag(self) -> float:
        """This rank's stop signal as a number the ranks sum: 0 none, 1 SIGINT, :data:`TERM_FLAG`
        SIGTERM (so the sum says whether any rank had a Ctrl-C)."""
        return 0.0 if self.signum is None else 1.0 if self.signum == signal.SIGINT else TERM_FLAG

    def agree(self, total: float) -> None:
        """Record a stop signal summed over the ranks (another rank's, perhaps: named as it was)."""
        if total > 0:
            self.agreed = True
            if self.signum is None:
                self.signum = signal.SIGINT if total % TERM_FLAG else signal.SIGTERM

    def stop_now(self, distributed: bool) -> bool:
        """Whether to save and stop after this step: at a signal in one process; under DDP once
        the ranks' summed flag says one was signalled, so that all stop at the same step."""
        return self.agreed if distributed else self.signum is not None

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
