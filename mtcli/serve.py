"""``mtcli serve``: a trained model over HTTP (FastAPI + uvicorn, the ``serve`` extra).

Endpoints:

* ``POST /translate`` ``{"text": ["...", ...], "beam": 5, "length_penalty": 1.0}`` (or
  ``"sampling": "topk"`` with ``"temperature"`` and ``"seed"``; ``"tgt_lang": "de"`` for a model
  of several target languages) ->
  ``{"translations": ["...", ...], "model": NAME}``, in request order; with ``"nbest": N`` also
  ``"nbest": [[{"text": ..., "score": ...}, ...], ...]``, each line's N best (or, sampling, its
  N samples in draw order);
* ``GET /health`` -> ``{"status": "ok", "model": NAME, "device": DEVICE, "target_languages":
  [...]}`` (the default first; the page offers a choice where a model has several);
* ``GET /`` a page to type or paste text and read its translation; ``GET /docs`` the OpenAPI docs.

Requests from many clients are decoded together: :class:`Batcher` collects what arrives within
``batch_wait_ms`` of the first waiting request (or until ``batch_lines`` lines), decodes each
group of equal settings with one :meth:`Translator.translate` call on one worker thread, and
hands every request its own lines back. Decoding many sentences at once is what makes a
beam search fast on any device, so 32 concurrent clients get several times the sentences/s of one.

Bad requests get a 4xx with a one-line ``{"error": ...}``: malformed JSON (400), wrong types, a
beam or length penalty out of range, or text that is not valid Unicode (422), too many lines or
characters, or a line longer than the model reads (413), a body that is not JSON (415), a
missing or wrong API key (401), an unknown path or method (404, 405). A body over
:attr:`Limits.max_body_bytes` is answered 413 as it arrives, before it is read into memory. Each
request is checked before it joins a batch, and if decoding a batch still fails, its requests
are decoded again one by one: one client's input never fails another's. A genuine failure
while decoding answers 500 with a request id, logged on one line beside its cause (no stack
trace goes to the client), and the server keeps serving; a line that does not fit in the
device's memory even alone (a batch that does not fit is decoded in halves) answers 503, with
the request id. With an
API key (``--api-key`` or ``MTCLI_API_KEY``) ``/translate`` needs ``Authorization: Bearer KEY``,
compared in constant time. The server binds 127.0.0.1 unless told otherwise. On SIGTERM
(or Ctrl-C) uvicorn stops accepting connections, the requests in flight are answered, and the
process exits 0. SIGHUP loads the model again (the run's newest ``checkpoint_best``, say, after
more training) while the old one serves, and swaps it in between batches (:class:`Reloader`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hmac
import json
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtcli.config import DECODE_RANGES
from mtcli.data.textio import check_unicode
from mtcli.errors import ConfigError, DataError, DeviceMemoryError, one_line
from mtcli.infer.translator import Translator
from mtcli.logs import get_logger
from mtcli.serve_page import PAGE

API_KEY_ENV = "MTCLI_API_KEY"


@dataclass
class Limits:
    """What one request may ask for, and how requests are gathered into batches."""

    max_lines: int = 64
    max_chars: int = 2000  # per line
    max_total_chars: int = 20_000  # per request
    max_beam: int = 16
    batch_wait_ms: float = 5.0
    batch_lines: int = 256

    @property
    def max_body_bytes(self) -> int:
        """The most bytes a request body may have: the most text, each character escaped as JSON
        escapes a character outside the BMP (12 bytes), and room for the rest of the request. A
        larger body is refused as it arrives, before it is read into memory."""
        return 12 * self.max_total_chars + 16 * self.max_lines + 4096


class TranslateRequest(BaseModel):
    """The body of ``POST /translate``."""

    model_config = ConfigDict(extra="forbid")
    text: list[StrictStr] = Field(description="Lines to translate, one sentence each.")
    beam: StrictInt | None = Field(default=None, description="Beam size (1 = greedy); the run's by default.")
    length_penalty: StrictFloat | StrictInt | None = Field(
        default=None, ge=DECODE_RANGES["length_penalty"][0], le=DECODE_RANGES["length_penalty"][1],
        description="GNMT length penalty alpha (below 0 favours shorter outputs).")
    sampling: Literal["topk", "topp"] | None = Field(
        default=None, description="Draw the translation instead of searching (the run's decode.topk / topp).")
    temperature: StrictFloat | StrictInt | None = Field(
        default=None, ge=DECODE_RANGES["temperature"][0], le=DECODE_RANGES["temperature"][1],
        description="Sampling temperature.")
    seed: StrictInt | None = Field(default=None, description="Sampling seed: the same seed gives the same output.")
    tgt_lang: StrictStr | None = Field(
        default=None, description="The language to translate into, for a model of several (the run's by default).")
    nbest: StrictInt | None = Field(
        default=None, description="Also answer N hypotheses per line, best first (the beam widens to N), or with "
                                  "sampling N samples per line, in draw order.")


class Hypothesis(BaseModel):
    """One of a line's n-best hypotheses or samples."""

    text: str
    score: float = Field(description="The length-penalised log-probability the search ranks by.")


class TranslateResponse(BaseModel):
    """The answer of ``POST /translate``: one translation per input line, in order (and with
    ``nbest``, each line's hypotheses)."""

    translations: list[str]
    model: str
    nbest: list[list[Hypothesis]] | None = None


class RequestError(Exception):
    """A request the server refuses, with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class InternalError(RequestError):
    """A failure that is the server's, not the request's: a 500 that names its request id (the
    log line with the cause carries the same id)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(500, f"translation failed (request id {request_id}; the server log has the cause)")
        self.request_id = request_id


@dataclass
class _Job:
    lines: list[str]
    settings: tuple[tuple[str, Any], ...]
    request_id: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Batcher:
    """One worker thread that decodes the requests of many clients together (module docstring)."""

    def __init__(self, translator: Translator, limits: Limits) -> None:
        self.translator = translator
        self.limits = limits
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="mtcli-serve-decode", daemon=True)
        self.thread.start()

    def submit(self, lines: list[str], request_id: str = "-", **settings: Any) -> concurrent.futures.Future:
        """Queue ``lines`` for translation; the future gets the name of the model that translated
        them and their translations, in order (or the error that decoding them alone raised;
        ``request_id`` names them in the log)."""
        job = _Job(lines, tuple(sorted((k, v) for k, v in settings.items() if v is not None)), request_id)
        self.jobs.put(job)
        return job.future

    def close(self) -> None:
        """Finish the queued jobs, then stop the worker."""
        self.jobs.put(None)
        self.thread.join()

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        """``first`` and what arrives within ``batch_wait_ms`` (up to ``batch_lines`` lines)."""
        batch, lines = [first], len(first.lines)
        deadline = time.monotonic() + self.limits.batch_wait_ms / 1000.0
        while lines < self.limits.batch_lines:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                return batch, True
            batch.append(job)
            lines += len(job.lines)
        return batch, False

    def _work(self) -> None:
        stop = False
        while not stop:
            first = self.jobs.get()
            if first is None:
                return
            batch, stop = self._gather(first)
            groups: dict[tuple, list[_Job]] = {}
            for job in batch:
                groups.setdefault(job.settings, []).append(job)
            for settings, jobs in groups.items():
                self._decode(jobs, dict(settings))

    def _decode(self, jobs: list[_Job], settings: dict[str, Any]) -> None:
        """One translate call for ``jobs`` (equal settings); each job gets its slice. If the
        call fails, each job is decoded alone, so only a job that fails by itself gets an error."""
        lines = [line for job in jobs for line in job.lines]
        n = settings.get("nbest")  # hypotheses per line (a list each) instead of one translation
        rest = {key: value for key, value in settings.items() if key != "nbest"}
        translator = self.translator  # a reload swaps it between batches, never inside one
        try:
            out: list[Any] = (translator.translate(lines, **rest) if n is None
                              else translator.nbest(lines, n=n, **rest))
        except Exception as exc:
            if len(jobs) > 1:
                for job in jobs:
                    self._decode([job], settings)
                return
            job = jobs[0]
            if not isinstance(exc, DataError):  # the client's input is answered with a 422
                get_logger().error("request %s: decoding failed: %s: %s", job.request_id,
                                   type(exc).__name__, one_line(exc))
            job.future.set_exception(exc)
            return
        start = 0
        for job in jobs:
            job.future.set_result((translator.name, out[start:start + len(job.lines)]))
            start += len(job.lines)


def check_request(body: TranslateRequest, limits: Limits) -> None:
    """Raise :class:`RequestError` when ``body`` asks for more than ``limits`` allow."""
    if len(body.text) > limits.max_lines:
        raise RequestError(413, f"too many lines: {len(body.text)} (at most {limits.max_lines} a request)")
    for i, line in enumerate(body.text):
        if len(line) > limits.max_chars:
            raise RequestError(413, f"text[{i}] has {len(line)} characters (at most {limits.max_chars})")
    total = sum(map(len, body.text))
    if total > limits.max_total_chars:
        raise RequestError(413, f"{total} characters in the request (at most {limits.max_total_chars})")
    for name, value in (("beam", body.beam), ("nbest", body.nbest)):
        if value is not None and not 1 <= value <= limits.max_beam:
            raise RequestError(422, f"{name} must be between 1 and {limits.max_beam}, got {value}")
    for i, line in enumerate(body.text):
        try:
            check_unicode(line, f"text[{i}]")
        except DataError as exc:
            raise RequestError(422, str(exc)) from None


def request_settings(body: TranslateRequest) -> dict[str, Any]:
    """The decode settings ``body`` asks for, as :class:`Translator` takes them (None: the
    server's own)."""
    return {"beam": body.beam, "length_penalty": body.length_penalty, "sampling": body.sampling,
            "temperature": body.temperature, "seed": body.seed, "tgt_lang": body.tgt_lang}


def check_decoding(body: TranslateRequest, translator: Translator) -> None:
    """Raise :class:`RequestError` for settings the translator refuses (a target language the
    model does not produce, a temperature without sampling: 422), or a line that encodes to
    more pieces than the model reads (413): translating it would silently drop its end. Run
    before the request joins a batch, so that it fails alone."""
    try:
        lengths = translator.source_pieces(body.text, **request_settings(body))
    except ConfigError as exc:
        raise RequestError(422, str(exc).replace("--tgt-lang", "tgt_lang")) from None
    limit = translator.max_source_pieces
    for i, pieces in enumerate(lengths):
        if pieces > limit:
            raise RequestError(413, f"text[{i}] encodes to {pieces} pieces (the model reads at most {limit}); "
                                    "split it into sentences")


class _BodyLimit:
    """ASGI middleware: a request body over ``most`` bytes is answered 413 as soon as its
    ``Content-Length``, or the bytes that have arrived, say so, and the rest is never read; what
    the application would still answer then is dropped."""

    def __init__(self, app: Any, most: int) -> None:
        self.app, self.most = app, most

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        seen, answered = 0, False

        async def refuse() -> None:
            nonlocal answered
            answered = True
            body = json.dumps({"error": f"the request body is over {self.most} bytes: send fewer or "
                                        "shorter lines"}).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.most:
                    await refuse()
                    raise _BodyTooLarge
            return message

        async def sending(message: dict) -> None:
            if not answered:
                await send(message)

        if declared.isdigit() and int(declared) > self.most:
            return await refuse()
        with contextlib.suppress(_BodyTooLarge):
            await self.app(scope, counted, sending)


class _BodyTooLarge(Exception):
    """Stops an application whose request body :class:`_BodyLimit` refused."""


def _bearer_check(api_key: str | None) -> Any:
    """A FastAPI dependency: with ``api_key`` set, ``Authorization: Bearer KEY`` or a 401."""

    def check(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError(401, "missing or wrong API key (send Authorization: Bearer KEY)")

    return check


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    """Malformed JSON -> 400; anything else the schema refuses -> 422, naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    if where == "text" and isinstance(first.get("input"), str):
        return 422, 'text: a list of lines, not one string (wrap it: {"text": ["..."]})'
    return 422, f"{where}: {first.get('msg', 'invalid value')}"


def _answer_errors(app: FastAPI) -> None:
    """Every refusal and failure as one ``{"error": ...}`` line with its status (see the module docstring)."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        if isinstance(exc, InternalError):
            return JSONResponse({"error": str(exc), "request_id": exc.request_id}, status_code=500,
                                headers={"X-Request-ID": exc.request_id})
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def not_here(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
        if exc.status_code == 400:  # FastAPI's answer to a body json cannot decode (not UTF-8)
            return JSONResponse({"error": f"malformed JSON: {exc.detail} (send it in UTF-8)"}, status_code=400)
        return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"},
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(DataError)
    async def unusable_text(request: Request, exc: DataError) -> JSONResponse:
        return JSONResponse({"error": one_line(exc)}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):  # FastAPI reads no JSON then
            return JSONResponse({"error": f"Content-Type {kind or '(none)'}: send the request as JSON "
                                          "(Content-Type: application/json)"}, status_code=415)
        status, message = _validation_message(exc)
        return JSONResponse({"error": message}, status_code=status)


def create_app(translator: Translator, limits: Limits | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``translator`` (see the module docstring)."""
    limits = limits or Limits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.batcher = Batcher(translator, limits)
        try:
            yield
        finally:
            app.state.batcher.close()

    app = FastAPI(title="mtcli", summary=f"Machine translation with {translator.name}", lifespan=lifespan)
    app.add_middleware(_BodyLimit, most=limits.max_body_bytes)
    guard = Depends(_bearer_check(api_key))

    _answer_errors(app)

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True,
              dependencies=[guard])
    async def translate(body: TranslateRequest) -> TranslateResponse:
        check_request(body, limits)
        request_id = uuid.uuid4().hex[:12]
        try:
            await asyncio.to_thread(check_decoding, body, app.state.batcher.translator)
        except (RequestError, DataError):
            raise
        except Exception as exc:
            get_logger().error("request %s: reading the input failed: %s: %s", request_id,
                               type(exc).__name__, one_line(exc))
            raise InternalError(request_id) from None
        future = app.state.batcher.submit(body.text, request_id, nbest=body.nbest, **request_settings(body))
        try:
            name, out = await asyncio.wrap_future(future)
        except DataError:  # the client's own text, found only when decoded alone
            raise
        except DeviceMemoryError:  # even alone; the batcher logged it with the request id
            raise RequestError(503, f"out of memory translating this request (request id {request_id}); "
                                    "send fewer or shorter lines") from None
        except Exception:  # the batcher logged it with the request id
            raise InternalError(request_id) from None
        if body.nbest is None:
            return TranslateResponse(translations=out, model=name)
        nbest = [[Hypothesis(text=h.text, score=h.score) for h in hyps] for hyps in out]
        return TranslateResponse(translations=[hyps[0].text if hyps else "" for hyps in out], model=name, nbest=nbest)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        serving = app.state.batcher.translator
        return {"status": "ok", "model": serving.name, "device": str(serving.device),
                "target_languages": serving.target_languages}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> str:
        return PAGE

    return app


class Reloader:
    """The model loaded again (``load``: the same run directory and checkpoint, so ``best`` is
    the run's newest ``checkpoint_best``) in a thread of its own while the old one goes on
    serving, then swapped in between two batches: a new model without a moment's downtime. A
    load that fails leaves the old model serving, with one log line."""

    def __init__(self, app: FastAPI, load: Callable[[], Translator]) -> None:
        self.app, self.load = app, load
        self._busy = threading.Lock()

    def start(self) -> threading.Thread | None:
        """Start loading (from a signal handler: it returns at once); None if a load is under way."""
        if not self._busy.acquire(blocking=False):
            get_logger().warning("reload: the model is being loaded already")
            return None
        thread = threading.Thread(target=self._run, name="mtcli-serve-reload", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            batcher = getattr(self.app.state, "batcher", None)
            if batcher is None:  # a SIGHUP before the server has started: it loads the newest already
                return
            old = batcher.translator.name
            try:
                new = self.load()
            except Exception as exc:
                get_logger().error("reload failed, still serving %s: %s: %s", old, type(exc).__name__, one_line(exc))
                return
            batcher.translator = new
            get_logger().info("reloaded: serving %s (was %s)", new.name, old)
        finally:
            self._busy.release()


def _reload_or_hang_up(reloader: Reloader) -> Callable[[int, Any], None]:
    """The SIGHUP handler: reload, unless the signal says the terminal the server runs in has
    hung up (a closed ssh session): then it ends the server, as SIGHUP did before it reloaded.
    A terminal that hung up answers no query (``isatty`` is False for it from then on)."""
    terminals = [fd for fd in (0, 1, 2) if os.isatty(fd)]

    def handle(signum: int, frame: Any) -> None:
        if terminals and not all(os.isatty(fd) for fd in terminals):
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGHUP)
            return
        reloader.start()

    return handle


def check_listening(host: str, port: int) -> None:
    """Raise :class:`ConfigError` naming ``host`` or ``port`` when the server could not listen
    there (a host this machine does not have, a port in use): said before a model is loaded,
    instead of uvicorn's log line and exit status 3 after it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host}: not an address to listen on ({getattr(exc, 'strerror', None) or exc})"
                          ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        sock.bind(address)
    except OSError as exc:
        hint = "; another process is listening there: give another --port" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"{host}:{port}: cannot listen there ({exc.strerror or exc}){hint}") from None
    finally:
        sock.close()


def serve(translator: Translator, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          api_key: str | None = None, load: Callable[[], Translator] | None = None) -> None:
    """Run the server until SIGTERM/SIGINT (requests in flight are answered first). With
    ``load`` (how ``translator`` was made), SIGHUP serves a freshly loaded model (:class:`Reloader`)."""
    check_listening(host, port)
    log = get_logger()
    log.info("serving %s on http://%s:%d (API key %s)", translator.name, host, port,
             "required" if api_key else "not set")
    app = create_app(translator, limits, api_key)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for the
    # handler it found installed: with this one, a drained server returns and exits 0
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    if load is not None and hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _reload_or_hang_up(Reloader(app, load)))
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=60)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("stopped by %s after answering the requests in flight", signal.Signals(received[0]).name)


__all__ = ["API_KEY_ENV", "Batcher", "Hypothesis", "Limits", "Reloader", "TranslateRequest", "create_app",
           "check_listening", "serve"]
