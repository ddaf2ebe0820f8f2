"""How the ``mtcli`` command line ends: a result printed on stdout (:func:`say`), or one line
``mtcli: error: ...`` on stderr and an exit status (:func:`fail`) for a library error, an
interrupt, an OS error, running out of memory (:func:`handle_errors`) or a usage error
(:class:`Commands`); never a traceback."""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import typer
import typer.core

from mtcli.errors import MtcliError, Terminated, restore_handlers, stop_on_signals
from mtcli.logs import printable

# click's exception classes, as the typer installed raises them (it may carry its own click)
_USAGE_ERROR, _CLICK_EXCEPTION = (next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
                                  for name in ("UsageError", "ClickException"))


class Commands(typer.core.TyperGroup):
    """mtcli's commands, with a usage error (an unknown option, a missing argument, a value out
    of range) said in one line, as every other error is, rather than in a box."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        _SAID.set(False)
        if sys.stderr is None:  # started with stderr closed (2>&-): Python would print its lines on stdout
            sys.stderr = open(os.devnull, "w")  # (for the life of the process)
        try:
            done = super().main(*args, standalone_mode=False, **kwargs)
        except BrokenPipeError:  # --version or --help into a pipe closed early
            sys.exit(141)
        except OSError as exc:  # --version or --help into a full disk
            with contextlib.suppress(OSError):
                print(f"mtcli: error: {exc.filename or '<stdout>'}: {exc.strerror or exc}", file=sys.stderr)
            sys.exit(1)
        except _USAGE_ERROR as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare ``mtcli``: the help
                exc.show()
                sys.exit(exc.exit_code)
            where = exc.ctx.command_path if exc.ctx is not None else self._named(args, kwargs)
            print(f"mtcli: error: {exc.format_message()} (see {where} --help)", file=sys.stderr)
            sys.exit(exc.exit_code)
        except _CLICK_EXCEPTION as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        if done == 130 and not _SAID.get():  # typer's Exit(130) for a Ctrl-C before the command's own handling
            print("mtcli: error: interrupted", file=sys.stderr)
        sys.exit(done if isinstance(done, int) else 0)

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """``mtcli COMMAND`` for the command the arguments name (a usage error the parser raises
        without its command's context: an option's value missing), else ``mtcli``."""
        argv = kwargs.get("args") or (args[0] if args else None) or sys.argv[1:]
        named = next((word for word in argv if word in self.commands), None)
        return f"mtcli {named}" if named else "mtcli"


#: Whether this call of the command line said its error (its one line), so that a Ctrl-C typer
#: turns into a silent exit status 130 before the command runs (while it parses the arguments)
#: gets its line too.
_SAID: contextvars.ContextVar[bool] = contextvars.ContextVar("mtcli_said", default=False)


def fail(message: str, code: int) -> None:
    """End the command with ``mtcli: error: <message>`` on stderr and exit status ``code``."""
    with contextlib.suppress(OSError):  # (a terminal that hung up takes no more lines)
        print(f"mtcli: error: {printable(message)}", file=sys.stderr)
    _SAID.set(True)
    raise typer.Exit(code)


def say(text: str) -> None:
    """Print a command's result on standard output and flush it: a write that fails (a full
    disk, a closed stdout: ``>&-``) is an error naming ``<stdout>``, raised before the command
    returns."""
    if sys.stdout is None:  # (print would write nothing, and flush fail on None)
        raise OSError(errno.EBADF, "closed", "<stdout>")
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, "<stdout>") from None


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors, interrupts (Ctrl-C, SIGTERM, SIGHUP but under ``nohup``), OS errors
    and running out of host memory into one line and an exit code. ``train`` and ``serve``
    install their own signal handling while they run."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        main = threading.current_thread() is threading.main_thread()
        previous = stop_on_signals() if main else {}
        try:
            return func(*args, **kwargs)
        except MtcliError as exc:
            fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Terminated as exc:  # (translate -o of files keeps its finished windows to go on from)
            fail(str(exc), exc.exit_code)
        except BrokenPipeError:
            # stdout closed early (e.g. `| head`): stop quietly like other Unix tools.
            sys.stderr.close()
            raise typer.Exit(141) from None
        except OSError as exc:
            where = f"{os.fsdecode(exc.filename)}: " if getattr(exc, "filename", None) else ""  # (bytes: b'...')
            fail(f"{where}{exc.strerror or exc}", 1)
        except MemoryError as exc:  # where no step of the library knows a smaller way to go on
            fail(f"out of memory{f': {exc}' if str(exc) else ''}", 1)
        except RuntimeError as exc:  # torch's allocation failures (a model too large to build)
            loop = re.fullmatch(r"Symlink loop from '(.*)'", str(exc), re.S)  # Path.resolve() before Python 3.13
            if loop is not None:
                fail(f"{loop[1]}: {os.strerror(errno.ELOOP)}", 1)
            if str(exc).startswith("can't start new thread"):  # a memory or process limit (ulimit -v, -u)
                fail(f"out of memory or processes: {exc}", 1)
            if "torch" not in sys.modules:  # (prepare never imports it: under a memory limit that would fail too)
                raise
            from mtcli.device import is_out_of_memory

            if not is_out_of_memory(exc):
                raise
            fail(f"out of memory: {' '.join(str(exc).split())[:300]}", 1)
        finally:
            restore_handlers(previous)

    return wrapper


def kept_results(run: Callable[[], Any]) -> Any:
    """What a reproduction pipeline's ``run()`` gives. Results it finished but could not write
    (:class:`~mtcli.pipeline.Unsaved`) are printed on stdout first, so the work is not lost; a
    stop by a signal says that the same command goes on from where it stopped."""
    from mtcli.pipeline import Unsaved

    try:
        try:
            return run()
        except Unsaved as exc:
            say(json.dumps(exc.row, indent=2))
            raise exc.__cause__ from None  # type: ignore[misc]
    except KeyboardInterrupt:
        fail("interrupted (run the same command again to go on)", 130)
    except Terminated as exc:
        fail(f"{exc} (run the same command again to go on)", exc.exit_code)


__all__ = ["Commands", "fail", "handle_errors", "kept_results", "say"]
