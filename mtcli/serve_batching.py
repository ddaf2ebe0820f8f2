"""The request limits of ``mtcli serve`` and its :class:`Batcher`: one worker thread that decodes
the requests of many clients together (see :mod:`mtcli.serve`).

The worker outlives anything that goes wrong in it: an exception of its own (not the model's,
which :meth:`Batcher._decode` answers per request) fails the requests of that batch, with one
log line each, and the worker takes the next batch. A request whose client went away before
its turn (its future cancelled: uvicorn cancels the requests still waiting when the shutdown
grace period ends) is not decoded at all.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mtcli.config import DecodeConfig
from mtcli.errors import ConfigError, DataError, one_line
from mtcli.infer.translator import Translator
from mtcli.logs import get_logger

#: The longest ``batch_wait_ms`` (``--batch-wait-ms``): ten seconds is already far more than
#: batching gains from, and a wait must stay a number a thread can wait for.
MAX_BATCH_WAIT_MS = 10_000.0


@dataclass
class Limits:
    """What one request may ask for, and how requests are gathered into batches."""

    max_lines: int = 64
    max_chars: int = 2000  # per line
    max_total_chars: int = 20_000  # per request
    max_beam: int = 16
    batch_wait_ms: float = 5.0
    batch_lines: int = 256

    def __post_init__(self) -> None:
        wait = self.batch_wait_ms
        if not (isinstance(wait, int | float) and math.isfinite(wait) and 0 <= wait <= MAX_BATCH_WAIT_MS):
            raise ConfigError(f"--batch-wait-ms {wait!r}: must be between 0 and {MAX_BATCH_WAIT_MS:g} "
                              "(milliseconds to gather requests into one batch)")

    def fitting(self, decode: DecodeConfig) -> Limits:
        """These limits with room for the server's own beam and n-best (``--beam 20``): a request
        may ask for what the server decodes without being asked."""
        wider = max(self.max_beam, decode.beam_size, decode.nbest)
        return self if wider == self.max_beam else dataclasses.replace(self, max_beam=wider)

    @property
    def max_body_bytes(self) -> int:
        """The most bytes a request body may have: the most text, each character escaped as JSON
        escapes a character outside the BMP (12 bytes), and room for the rest of the request. A
        larger body is refused as it arrives, before it is read into memory."""
        return 12 * self.max_total_chars + 16 * self.max_lines + 4096


@dataclass
class _Job:
    lines: list[str]
    settings: tuple[tuple[str, Any], ...]
    request_id: str
    targets: list[str] | None = None  # scored against ``lines`` (POST /score), not translated
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def _settle(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
    """Give ``job`` its result or error; a future settled already (cancelled by its client) is
    left as it is."""
    try:
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


class Batcher:
    """One worker thread that decodes the requests of many clients together (module docstring)."""

    def __init__(self, translator: Translator, limits: Limits) -> None:
        self.translator = translator
        self.limits = limits
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="mtcli-serve-decode", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        """Whether the worker still takes requests (False once it stopped, for whatever reason)."""
        return self.thread.is_alive()

    def submit(self, lines: list[str], request_id: str = "-", targets: list[str] | None = None,
               **settings: Any) -> concurrent.futures.Future:
        """Queue ``lines`` for translation (or, given ``targets``, for scoring the pairs:
        :meth:`Translator.score`); the future gets the name of the model and the translations
        (or scores), in order, or the error that decoding them alone raised (``request_id``
        names them in the log). Cancel the future to have them skipped."""
        job = _Job(lines, tuple(sorted((k, v) for k, v in settings.items() if v is not None)), request_id, targets)
        self.jobs.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs, then stop the worker; with ``timeout``, wait that long at most:
        the server closes it once every request has been answered, so what still decodes then
        is for requests answered 503 already (a shutdown grace period that ended), and the
        process does not wait for it. False when the worker is still decoding: the process must
        then end without finalising (``os._exit``), since the interpreter's exit beneath a
        thread inside torch aborts it."""
        self.jobs.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            get_logger().warning("shutdown: a batch for requests already answered was still decoding; left unfinished")
            return False
        return True

    def _gather(self, batch: list[_Job]) -> bool:
        """Add to ``batch`` (its first job) what arrives within ``batch_wait_ms`` (up to
        ``batch_lines`` lines); True when the queue says stop."""
        lines = sum(len(job.lines) for job in batch)
        deadline = time.monotonic() + self.limits.batch_wait_ms / 1000.0
        while lines < self.limits.batch_lines:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                return True
            batch.append(job)
            lines += len(job.lines)
        return False

    def _work(self) -> None:
        stop = False
        while not stop:
            first = self.jobs.get()
            if first is None:
                return
            batch = [first]
            try:
                stop = self._gather(batch)
                groups: dict[tuple, list[_Job]] = {}
                for job in batch:
                    groups.setdefault((job.targets is not None, job.settings), []).append(job)
                for (_, settings), jobs in groups.items():
                    # a job whose client has gone (its future cancelled) is not decoded; the
                    # others can no longer be cancelled
                    waiting = [job for job in jobs if job.future.set_running_or_notify_cancel()]
                    if waiting:
                        self._decode(waiting, dict(settings))
            except Exception as exc:  # the worker's own failure: fail this batch, serve the next
                for job in batch:
                    if not job.future.done():
                        get_logger().error("request %s: decoding failed: %s: %s", job.request_id,
                                           type(exc).__name__, one_line(exc))
                        _settle(job, error=exc)

    def _decode(self, jobs: list[_Job], settings: dict[str, Any]) -> None:
        """One translate (or score) call for ``jobs`` (equal settings); each job gets its slice. If
        the call fails, each job is decoded alone, so only a job that fails by itself gets an error."""
        lines = [line for job in jobs for line in job.lines]
        n = settings.get("nbest")  # hypotheses per line (a list each) instead of one translation
        rest = {key: value for key, value in settings.items() if key != "nbest"}
        translator = self.translator  # a reload swaps it between batches, never inside one
        try:
            if jobs[0].targets is not None:
                out: list[Any] = translator.score(lines, [t for job in jobs for t in job.targets or ()], **rest)
            else:
                out = translator.translate(lines, **rest) if n is None else translator.nbest(lines, n=n, **rest)
        except Exception as exc:
            if len(jobs) > 1:
                for job in jobs:
                    self._decode([job], settings)
                return
            job = jobs[0]
            if not isinstance(exc, DataError):  # the client's input is answered with a 422
                get_logger().error("request %s: decoding failed: %s: %s", job.request_id,
                                   type(exc).__name__, one_line(exc))
            _settle(job, error=exc)
            return
        start = 0
        for job in jobs:
            _settle(job, (translator.name, out[start:start + len(job.lines)]))
            start += len(job.lines)


__all__ = ["MAX_BATCH_WAIT_MS", "Batcher", "Limits"]
