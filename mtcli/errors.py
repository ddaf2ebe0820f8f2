"""Typed errors raised by library code.

Library modules never call ``sys.exit``; they raise one of these and ``mtcli.cli`` turns it
into a one-line message on stderr and a non-zero exit code (``exit_code`` below).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class MtcliError(Exception):
    """Base class of every error a user can cause; its message is one line for the terminal."""

    exit_code = 1


class ConfigError(MtcliError):
    """A config file or ``--set`` override is invalid (unknown key, wrong type, missing key)."""

    exit_code = 2


class DataError(MtcliError):
    """Input text or a prepared cache is unusable (mismatched files, bad UTF-8, missing split)."""


class CheckpointError(MtcliError):
    """A checkpoint or run directory is missing, corrupted, untrusted, or incompatible."""


class RunLockedError(MtcliError):
    """Another live process holds the run directory."""


class TrainingError(MtcliError):
    """Training cannot go on (for example, too many non-finite losses in a row)."""


class DeviceMemoryError(MtcliError):
    """The GPU (or the CPU) ran out of memory; the message names the setting that sizes the batch."""


class TrainingInterrupted(MtcliError):
    """Training stopped on SIGINT/SIGTERM after saving ``checkpoint_last``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum

    def __reduce__(self) -> tuple:
        # picklable with its signal (an error may cross a process boundary)
        return (type(self), (str(self), self.signum))


class Terminated(BaseException):
    """SIGTERM, or SIGHUP (the terminal hung up: a closed ssh session), raised where the main
    thread is (:func:`raise_terminated`), so that ``with`` blocks and ``finally`` clauses run: a
    temporary output is removed and worker processes are stopped, as on Ctrl-C; the command
    line and the pipelines then say it in one line, ``str()`` of this, with :attr:`exit_code`."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum

    def __str__(self) -> str:
        return "hung up" if self.signum == getattr(signal, "SIGHUP", None) else "terminated"


def raise_terminated(signum: int, frame: object) -> None:
    """The SIGTERM (and SIGHUP) handler of the command line and the pipelines: raises
    :class:`Terminated`, once: the same signal again (a hang-up is often sent twice) is ignored
    from then on, so that it cannot cut short the cleanup the first one started."""
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signum)


def hang_ups() -> list[int]:
    """SIGHUP, to stop on as on SIGTERM, unless it is ignored (``nohup``: the command is meant
    to outlive its terminal) or the platform has none; else nothing."""
    hup = getattr(signal, "SIGHUP", None)
    return [hup] if hup is not None and signal.getsignal(hup) != signal.SIG_IGN else []


def stop_on_signals() -> dict[int, Any]:
    """Install :func:`raise_terminated` for SIGTERM and :func:`hang_ups`; returns the handlers
    it replaced, for :func:`restore_handlers`. Call it from the main thread."""
    return {sig: signal.signal(sig, raise_terminated) for sig in (signal.SIGTERM, *hang_ups())}


def restore_handlers(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`stop_on_signals` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP for the body (outputs that must be replaced together): one
    that comes meanwhile is acted on as it would have been, once the body is done. In a thread
    other than the main one, where no handler can be set, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM, *hang_ups())
            if signal.getsignal(sig) is not None]  # (None: a handler set outside Python)
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in held}
    try:
        yield
    finally:
        restore_handlers(previous)
        if arrived:
            signal.raise_signal(arrived[0])


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace runs, newlines included, become one space;
    at most ``limit`` characters; its type name when empty): how mtcli quotes a third-party
    failure inside its own one-line errors."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: How an allocation failure reads when it is not PyTorch's ``OutOfMemoryError``: the C allocator
#: on a CPU (under a memory limit; without one the kernel kills the process), CUDA libraries
#: that allocate for themselves (cuBLAS's workspace, the runtime's own), and CTranslate2's
OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                       "CUDA failed with error out of memory")


def failed_to_allocate(exc: BaseException) -> bool:
    """Whether ``exc`` itself (not what it wraps) is a failed allocation: a ``MemoryError``
    (also a C++ library's ``std::bad_alloc``, as pybind11 gives it) or a ``RuntimeError`` that
    reads as one (:data:`OUT_OF_MEMORY_TEXTS`). Needs no torch: a broad ``except`` around a
    library call asks it before calling what failed a bad file or a bad value."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and any(text in str(exc) for text in OUT_OF_MEMORY_TEXTS))


def install_advice(extra: str) -> str:
    """How to install the packages of mtcli's optional ``extra`` (pyproject's
    ``[project.optional-dependencies]``), by their own names: ``pip install 'fastapi>=0.110' ...``.
    Not ``pip install 'mtcli[extra]'``: the name mtcli on PyPI is another project's, which that
    would fetch (or put in place of this one)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        listed = requires("mtcli") or []
    except PackageNotFoundError:  # run from a checkout that was never installed
        listed = []
    wanted = [r.split(";")[0].strip() for r in listed if r.replace("'", '"').endswith(f'extra == "{extra}"')]
    if not wanted:
        return f"pip install -e '.[{extra}]' in mtcli's checkout"
    return "pip install " + " ".join(f"'{r}'" for r in wanted)


def shown(value: Any, limit: int = 120) -> str:
    """``repr(value)`` as an error quotes a value it was given: at most ``limit`` characters, and
    built no further than that (a YAML file or pickle of shared references, a few hundred bytes,
    would expand to gigabytes in full)."""
    import reprlib

    brief = reprlib.Repr()
    brief.maxlevel = 3
    brief.maxlist = brief.maxtuple = brief.maxdict = brief.maxset = brief.maxfrozenset = brief.maxdeque = 6
    brief.maxstring = brief.maxother = brief.maxlong = limit
    text = brief.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
