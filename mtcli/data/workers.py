"""Forked worker processes for ``prepare``'s two parallel passes (cleaning, encoding).

Both passes cut a large file into ranges of whole lines, let each worker read and process a
range itself (the parent never touches the text), and take the results back in file order so
that the output is the same as one process would write. At most ``2 * workers`` ranges are in
flight, so memory stays bounded however large the file is.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from mtcli.errors import MtcliError


def can_fork() -> bool:
    """True where worker processes can be forked (not on Windows or macOS's default ``spawn``)."""
    return "fork" in multiprocessing.get_all_start_methods()


@contextlib.contextmanager
def forked_pool(workers: int, initializer: Callable[..., None] | None = None,
                initargs: tuple[Any, ...] = (), start: str = "fork") -> Iterator[Pool]:
    """A pool of ``workers`` forked processes, terminated on leaving (also on an error);
    ``start="spawn"``: new processes instead, for work whose library keeps a thread pool that
    does not survive a fork (libgomp's, which SentencePiece's trainer uses, waits forever in a
    child forked from a process that ran OpenMP code).

    The workers ignore SIGINT: Ctrl-C at a terminal reaches every process of the group, and a
    worker interrupted mid-task would die with a traceback, its task never done, and the parent
    would wait for it. Only the parent stops; it lets the tasks in flight finish and leaves.
    A worker that died (SIGTERM to the whole group from ``timeout``, SLURM or ``kill -TERM
    -PGID``; the out-of-memory killer) may have taken a lock of the pool's queues with it (an
    idle worker waits for tasks holding one), which the pool's shutdown would wait for for ever:
    the pool is then left with fresh locks. On Linux a worker also ends when the parent dies
    without leaving the pool (``kill -9``, the out-of-memory killer), instead of finishing its task for nobody and
    printing a ``BrokenPipeError`` traceback. A worker that dies (the out-of-memory killer)
    is noticed by :func:`result_of`, where the pool would wait for its task for ever."""
    context = multiprocessing.get_context(start)
    spawned = start != "fork"
    if spawned:
        _start_resource_tracker()
    with _sigint_ignored(spawned):
        made = context.Pool(workers, initializer=_start_worker, initargs=(os.getpid(), initializer, *initargs))
    with made as pool:
        pool._mtcli_started = list(pool._pool)  # type: ignore[attr-defined]  # its workers, as started
        try:
            yield pool
        finally:
            if _ended(pool) is not None:  # one died, perhaps holding a queue's lock: the shutdown must not wait for it
                pool._inqueue._rlock = context.Lock()  # type: ignore[attr-defined]
                pool._outqueue._wlock = context.Lock()  # type: ignore[attr-defined]


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, which a pool of new processes needs for its
    locks, deaf to hang-ups: it ignores SIGINT and SIGTERM but not SIGHUP, which a closed ssh
    session sends the whole group; it died of it, and the parent's cleanup printed its warning
    and tracebacks under the one-line error. It starts with SIGHUP blocked, which it keeps."""
    from multiprocessing import resource_tracker

    hup = getattr(signal, "SIGHUP", None)
    if hup is None or not hasattr(signal, "pthread_sigmask"):
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {hup})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _sigint_ignored(ignored: bool) -> Iterator[None]:
    """With ``ignored``, SIGINT ignored while new processes start (a disposition they keep across
    exec): a spawned worker imports the main module before it runs :func:`_start_worker`, and
    Ctrl-C then ended it with a traceback (``mtcli reproduce-bt``, which imports torch)."""
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_worker(parent: int, initializer: Callable[..., None] | None, *initargs: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):  # a hang-up reaches the whole group: the parent stops the pool, as on Ctrl-C
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool stops its workers with it
    end_with_parent(parent)
    if initializer is not None:
        initializer(*initargs)


#: ``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` to this process when its parent ends.
_PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``signum`` when ``parent`` (the process that started
    it) ends; and send it now if it already has. Linux only (elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):  # no prctl in this C library
        return
    if os.getppid() != parent:  # the parent died before the call: no signal will come
        os.kill(os.getpid(), signum)


#: How long leaving a pool early waits for the tasks still running (see :func:`settle`).
SETTLE_SECONDS = 30.0


def in_order(pool: Pool, func: Callable[[Any], Any], tasks: Iterable[Any], window: int) -> Iterator[Any]:
    """``func(task)`` for every task, computed by ``pool`` and yielded in task order, with at
    most ``window`` tasks submitted and not yet yielded. A worker's exception is re-raised here
    when its task's turn comes, so the first error in file order is the one reported; the
    tasks still running are then let finish (:func:`settle`)."""
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(pool.apply_async(func, (task,)))
            if len(pending) >= window:
                yield result_of(pool, pending.popleft())
        while pending:
            yield result_of(pool, pending.popleft())
    finally:
        settle(pending, pool)


def _exit_codes(pool: Pool | None) -> list[int]:
    """The exit codes of the workers of ``pool`` that have ended (they only end when the pool does)."""
    return [code for p in getattr(pool, "_mtcli_started", ()) if (code := p.exitcode) is not None]


def _ended(pool: Pool) -> int | None:
    """The exit code of a worker of ``pool`` that has ended, if one has (below 0: the signal
    that killed it)."""
    return next(iter(_exit_codes(pool)), None)


def result_of(pool: Pool, result: AsyncResult) -> Any:
    """``result.get()``, or :class:`MtcliError` when a worker of ``pool`` has died meanwhile:
    the pool drops the task of a worker that is killed (the out-of-memory killer, ``kill -9``)
    and would wait for it for ever."""
    while not result.ready():
        result.wait(1.0)
        if not result.ready() and (code := _ended(pool)) is not None:
            raise MtcliError(_worker_ended(code))
    return result.get()


def _worker_ended(code: int) -> str:
    """:func:`result_of`'s message for a worker that ended with exit code ``code``."""
    if code < 0:
        why = ("; the out-of-memory killer ends the largest process: lower data.num_workers or "
               "data.spm_max_sentences, or free memory") if -code == signal.SIGKILL else ""
        return f"a prepare worker process ended (killed by signal {-code}){why}"
    # a new process imports the main script (multiprocessing's spawn)
    return (f"a prepare worker process ended (exit status {code}); a script that calls mtcli's prepare or train "
            "must do so under `if __name__ == \"__main__\":`, which the worker's import of it skips")


def settle(results: Iterable[AsyncResult], pool: Pool | None = None) -> None:
    """Wait (up to :data:`SETTLE_SECONDS` in all) for tasks submitted to a pool to finish.

    A pool left early is terminated, and a worker killed while it hands back a result holds
    the result queue's lock for ever: the pool's own shutdown then waits on that lock and the
    process hangs. With every submitted task finished, the workers are idle when killed. (Not
    waited for: tasks of ``pool`` once one of its workers has died, which never finish.)"""
    deadline = time.monotonic() + SETTLE_SECONDS
    results = list(results)
    while time.monotonic() < deadline:
        unfinished = [result for result in results if not result.ready()]
        if len(unfinished) <= len(_exit_codes(pool)):  # none left, or only what dead workers dropped (the others may be sending)
            return
        unfinished[0].wait(0.1)
