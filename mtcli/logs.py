"""The one path for progress and messages: the ``mtcli`` logger and tqdm bars on stderr.

Library code logs through :func:`get_logger` and makes bars with :func:`progress`; it never
prints. The CLI calls :func:`setup_logging` once; a run directory adds a file handler so the
text log (``train.log``) gets the same lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mtcli.errors import MtcliError

LOGGER_NAME = "mtcli"
_FORMAT = "%(asctime)s | %(levelname)s | %(message)s"


def get_logger() -> logging.Logger:
    """The package logger; everything mtcli says goes through it."""
    return logging.getLogger(LOGGER_NAME)


#: Control characters (C0, DEL, C1), which a terminal would obey: a name or text from a file
#: someone else made (a run's lock, a corpus line) could move the cursor, retitle the window or
#: forge a line.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with each control character written as its escape (``\\x1b``, ``\\n``): what
    mtcli prints on the console, one line that says what it holds."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines through tqdm so they do not break an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(printable(self.format(record)), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def _version(package: str) -> str:
    """An installed package's version, read without importing it ("?" where not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def setup_logging(verbose: bool = False, tag: str = "", quiet: bool = False) -> None:
    """Send ``mtcli`` log records to stderr (INFO, or DEBUG when ``verbose``; with ``quiet``
    warnings and errors only, and no progress bars, while a run's ``train.log`` still gets every
    line); ``tag`` prefixes each message (e.g. ``member 2``, when several processes share one
    terminal)."""
    logger = get_logger()
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler = next((h for h in logger.handlers if isinstance(h, _TqdmHandler)), None)
    if handler is None:
        handler = _TqdmHandler()
        logger.addHandler(handler)
    handler.setLevel(logging.WARNING if quiet and not verbose else logging.NOTSET)
    fmt = _FORMAT.replace("%(message)s", f"{tag} | %(message)s") if tag else _FORMAT
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logger.propagate = False
    if verbose:  # what a bug report needs first
        logger.debug("mtcli %s | Python %s | torch %s | %s | %d cores", _version("mtcli"), platform.python_version(),
                     _version("torch"), platform.platform(), os.cpu_count() or 0)


def console_quiet() -> bool:
    """Whether the command line asked for warnings and errors only (:func:`setup_logging`'s
    ``quiet``); False where it did not set up the log (mtcli called from Python)."""
    handler = next((h for h in get_logger().handlers if isinstance(h, _TqdmHandler)), None)
    return handler is not None and handler.level >= logging.WARNING


class _FileLog(logging.FileHandler):
    """A run's text log that never stops its run: a line that cannot be written (a full disk) is
    one warning on the console naming the file, instead of a traceback a line, and the file
    takes no more lines (the checkpoints, which say so if they cannot be written, go on)."""

    failed: OSError | None = None
    level_before: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if self.failed is not None:
            return
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):  # a record that cannot be formatted: logging's own report
            super().handleError(record)
            return
        self.failed = error
        get_logger().warning("%s: cannot write the log (%s); it stops here, the console goes on",
                             self.baseFilename, error.strerror or error)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last lines' flush (said already, or not worth a traceback now)
            pass


def add_file_log(path: str | Path) -> logging.Handler:
    """Also append log records to ``path``; returns the handler so the caller can remove it.
    A symbolic link there is refused (:class:`~mtcli.errors.MtcliError`): a run directory made
    by someone else could point it at any file of the user's, which training would append to."""
    if Path(path).is_symlink():
        raise MtcliError(f"{path}: a symbolic link, where a run keeps its log as a file of its own; remove it")
    handler = _FileLog(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    logger = get_logger()
    logger.addHandler(handler)
    handler.level_before = logger.level  # (a host's level, put back by remove_log_handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


@contextlib.contextmanager
def failures_logged(handler: logging.Handler) -> Iterator[None]:
    """Write an error that ends the block into ``handler``'s file only (the console gets it from
    the command's own one line): a log read later says why its run stopped."""
    try:
        yield
    except Exception as exc:
        handler.handle(_stopped(exc, ""))
        raise


def _stopped(exc: Exception, who: str) -> logging.LogRecord:
    """The log record of ``exc`` ending a run, one line: ``[who ]stopped: <error>``."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return logging.LogRecord(get_logger().name, logging.ERROR, __file__, 0, "%sstopped: %s",
                             (f"{who} " if who else "", text), None)


@contextlib.contextmanager
def failures_appended(path: Path, who: str, unless: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """For a process that does not keep the run's log ``path`` (another rank of the run): an
    error that ends the block is appended to it, one line naming ``who``, so that the log says
    why the run stopped (not only that a collective failed). Nothing when the file is not there
    (the run's directory is on another machine), nor for an error of the ``unless`` types (one
    that the log's own process says too)."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, unless) and path.is_file() and not path.is_symlink():
            handler = _FileLog(path, encoding="utf-8")
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
            handler.handle(_stopped(exc, who))
            handler.close()
        raise


def remove_log_handler(handler: logging.Handler) -> None:
    """Detach and close a handler added by :func:`add_file_log`, and put back the logger's level
    from before it (a program that calls ``train`` keeps its own)."""
    get_logger().removeHandler(handler)
    handler.close()
    if isinstance(handler, _FileLog) and handler.level_before is not None:
        get_logger().setLevel(handler.level_before)


#: Off a terminal (a log file, nohup, a batch or CI job) a bar redrawn in place would fill the
#: log with carriage-return redraws, several a second; there a bar writes one plain line at most
#: this often instead.
PLAIN_BAR_SECONDS = 60.0


class _PlainLines:
    """Where tqdm writes off a terminal: each redraw becomes one line; the clearing writes vanish."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stderr.write(text + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def on_terminal() -> bool:
    """True when stderr is a terminal (where a bar can redraw in place)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def progress(iterable: Iterable | None = None, *, enabled: bool = True, terminal_only: bool = False,
             **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr; ``enabled=False`` gives a silent bar with the same interface.

    On a terminal the bar redraws in place. Elsewhere it writes a plain line every
    :data:`PLAIN_BAR_SECONDS` at most, the first after that long (a long ``translate`` in a
    batch job still shows where it is; a short one writes no bar at all),
    or nothing with ``terminal_only`` (for a loop whose log lines already say the same).
    """
    kwargs.setdefault("leave", False)
    console = next((h for h in get_logger().handlers if isinstance(h, _TqdmHandler)), None)
    enabled = enabled and (console is None or console.level <= logging.INFO)  # (not with --quiet)
    if on_terminal():
        kwargs.setdefault("dynamic_ncols", True)
        return tqdm(iterable, file=sys.stderr, disable=not enabled, **kwargs)
    for key in ("delay", "mininterval", "maxinterval"):  # nothing at all for a shorter job
        kwargs.setdefault(key, PLAIN_BAR_SECONDS)
    return tqdm(iterable, file=_PlainLines(), disable=not enabled or terminal_only, ascii=True, **kwargs)


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: ``45s``, ``12m05s``, ``3h12m``, ``2d04h``."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The loggers ``names`` (a library's) say only errors for the block: what fails becomes
    mtcli's one line, without the library's warnings before it."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
