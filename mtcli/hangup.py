"""SIGHUP for a long-running command: do something (reload a model), unless the signal says the
terminal the process runs in has hung up (a closed ssh session); then end the process, as SIGHUP
did before it was handled. A terminal that hung up answers no query (``isatty`` is False for it
from then on). Light to import, so a command can install it before its slow imports."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any


def act_or_hang_up(act: Callable[[int], object]) -> Callable[[int, Any], None]:
    """A SIGHUP handler that calls ``act(signum)``, or ends the process when its terminal hung up."""
    terminals = [fd for fd in (0, 1, 2) if os.isatty(fd)]

    def handle(signum: int, frame: Any) -> None:
        if terminals and not all(os.isatty(fd) for fd in terminals):
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGHUP)
            return
        act(signum)

    return handle


__all__ = ["act_or_hang_up"]
