"""What a process :class:`conftest.ForkedPython` forks runs: a module of its own, which imports
nothing but the standard library, so the child does not import pytest (conftest does) first."""

from __future__ import annotations

import os
import sys


def python_c(script: str, args: list[str], env: dict[str, str], cwd: str, stderr_path: str, stdout: bool) -> None:
    """What ``python -c SCRIPT ARGS`` does, in a process forked from a server that imported
    ``conftest.PRELOADED``: its environment and directory, stderr to a file, and stdout to the same
    file (``stdout``) or to /dev/null."""
    import atexit

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    out = err if stdout else os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(err)
    if out != err:
        os.close(out)
    sys.argv = ["-c", *args]
    try:
        exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child leaves with os._exit; a Python run's atexit runs
        sys.stderr.flush()
