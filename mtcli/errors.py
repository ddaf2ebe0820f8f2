"""Typed errors raised by library code.

Library modules never call ``sys.exit``; they raise one of these and ``mtcli.cli`` turns it
into a one-line message on stderr and a non-zero exit code (``exit_code`` below).
"""

from __future__ import annotations


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
    """SIGTERM, raised where the main thread is (:func:`raise_terminated`), so that ``with``
    blocks and ``finally`` clauses run: a temporary output is removed and worker processes are
    stopped, as on Ctrl-C; the command line and the pipelines then say it in one line."""


def raise_terminated(signum: int, frame: object) -> None:
    """The SIGTERM handler of the command line and the pipelines: raises :class:`Terminated`."""
    raise Terminated


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace runs, newlines included, become one space;
    at most ``limit`` characters; its type name when empty): how mtcli quotes a third-party
    failure inside its own one-line errors."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
