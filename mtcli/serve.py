"""``mtcli serve``: a trained model over HTTP (FastAPI + uvicorn, the ``serve`` extra).

Endpoints:

* ``POST /translate`` ``{"text": ["...", ...], "beam": 5, "length_penalty": 1.0}`` (or
  ``"sampling": "topk"`` with ``"temperature"`` and ``"seed"``, or ``"none"`` for a search; ``"tgt_lang": "de"`` for a model
  of several target languages) ->
  ``{"translations": ["...", ...], "model": NAME}``, in request order; with ``"nbest": N`` also
  ``"nbest": [[{"text": ..., "score": ...}, ...], ...]``, each line's N best (or, sampling, its
  N samples in draw order; with ``--engine ctranslate2``, by score);
* ``POST /score`` ``{"source": [...], "target": [...]}`` (``"normalize": true``, ``"tgt_lang"``
  optional) -> ``{"scores": [...], "model": NAME}``: log p(target | source) of each pair
  (:meth:`Translator.score`), ``null`` where the model cannot produce the target; batched with the
  other scoring requests as translations are;
* ``GET /health`` -> ``{"status": "ok", "model": NAME, "weights_sha256": SHA, "device": DEVICE,
  "target_languages": [...]}`` (the sha256 of the weights, which tells two models apart, a
  checkpoint's or an average's; the languages with the default first: the page offers a
  choice where a model has several);
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
API key (``--api-key`` or ``MTCLI_API_KEY``) ``/translate`` and ``/score`` need ``Authorization: Bearer KEY``,
checked first and compared in constant time (:mod:`mtcli.serve_guards`). The server binds 127.0.0.1 unless told otherwise. On SIGTERM
(or Ctrl-C) uvicorn stops accepting connections, the requests in flight are answered, and the
process exits 0; a request still unanswered when the grace period (``shutdown_grace_s``) ends is
not translated but answered 503, and a warning says how many were. ``GET /health`` answers 503
should the decoding thread have stopped. SIGHUP loads the model again (the run's newest ``checkpoint_best``, say, after
more training) while the old one serves, and swaps it in between batches (:class:`Reloader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import ipaddress
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtcli.errors import ConfigError, DataError, DeviceMemoryError, one_line
from mtcli.hangup import act_or_hang_up
from mtcli.infer.translator import Translator
from mtcli.logs import console_quiet, get_logger, on_terminal
from mtcli.serve_batching import Batcher, Limits
from mtcli.serve_guards import (
    API_KEY_ENV,
    BodyLimit,
    KeyCheck,
    check_api_key,
    header_deadline_protocol,
)
from mtcli.serve_page import PAGE
from mtcli.serve_requests import (
    REFUSALS,
    SCORE_REFUSALS,
    ErrorAnswer,
    Hypothesis,
    InternalError,
    RequestError,
    ScoreRequest,
    ScoreResponse,
    TranslateRequest,
    TranslateResponse,
    check_decoding,
    check_request,
    check_score_request,
    check_scoring,
    request_settings,
    request_words,
)


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    """Malformed JSON -> 400; anything else the schema refuses -> 422, naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse the body')}"
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # the field, and the index in a list; not the member of a union that pydantic tried last
    where = "".join([str(loc[0]), *(f"[{p}]" for p in loc[1:] if isinstance(p, int))]) if loc else "body"
    if where == "text" and isinstance(first.get("input"), str):
        return 422, 'text: a list of lines, not one string (wrap it: {"text": ["..."]})'
    return 422, f"{where}: {first.get('msg', 'invalid value')}"


def _unparsable(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not parse a JSON body (the error it raised ``from``)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"{exc.detail} (send it in UTF-8)"
    if isinstance(cause, RecursionError):
        return "nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "a number with too many digits"
    return str(exc.detail)


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
        if exc.status_code == 400:  # FastAPI's answer to a body it cannot parse, short of a JSONDecodeError
            return _encoded(request) or JSONResponse({"error": f"malformed JSON: {_unparsable(exc)}"}, status_code=400)
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
        return _encoded(request) or JSONResponse({"error": message}, status_code=status)


def _encoded(request: Request) -> JSONResponse | None:
    """The 415 of a compressed body (``Content-Encoding: gzip``), which FastAPI reads as text
    and so answered as malformed JSON; None for a body sent as it is."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    return JSONResponse({"error": f"Content-Encoding {encoding}: send the body uncompressed"}, status_code=415)


#: How long the server's shutdown waits for the decoding thread once every request is answered.
CLOSE_WAIT_S = 2.0

#: The answer while the decoding thread is not running (it never stops but at shutdown).
STOPPED = "the decoding thread has stopped (the server log says why): restart the server"


async def _client_gone(request: Request) -> None:
    """Return once the client of ``request`` has closed its connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


async def _decoded(batcher: Batcher, body: TranslateRequest | ScoreRequest, request_id: str,
                   request: Request | None = None) -> tuple[str, list[Any]]:
    """``body`` checked (:func:`check_decoding`, :func:`check_scoring`) and decoded (or scored)
    by ``batcher``: the name of the model and its output; a :class:`RequestError` for a refusal
    or a failure. A client that closes its connection (``request``) before its lines' turn takes
    them out of the queue: a client that timed out and left does not keep the others waiting."""
    scoring = isinstance(body, ScoreRequest)
    doing = "scoring" if scoring else "translation"
    try:
        await asyncio.to_thread(check_scoring if scoring else check_decoding, body, batcher.translator)
    except (RequestError, DataError):
        raise
    except Exception as exc:
        get_logger().error("request %s: reading the input failed: %s: %s", request_id,
                           type(exc).__name__, one_line(exc))
        raise InternalError(request_id, doing) from None
    if not batcher.alive:
        raise RequestError(503, STOPPED)
    future = (batcher.submit(body.source, request_id, targets=body.target, normalize=body.normalize,
                             tgt_lang=body.tgt_lang) if scoring
              else batcher.submit(body.text, request_id, nbest=body.nbest, **request_settings(body)))
    waiting = asyncio.ensure_future(asyncio.wrap_future(future))  # cancelled: not decoded, unless begun
    watch = None if request is None else asyncio.ensure_future(_client_gone(request))
    try:
        if watch is not None:
            await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                get_logger().info("request %s: the client has gone; its lines are dropped unless their decoding "
                                  "had begun", request_id)
                raise RequestError(499, "the client closed the connection")
        return await waiting
    except RequestError:
        raise
    except DataError:  # the client's own text, found only when decoded alone
        raise
    except DeviceMemoryError:  # even alone; the batcher logged it with the request id
        raise RequestError(503, f"out of memory {'scoring' if scoring else 'translating'} this request (request id "
                                f"{request_id}); send fewer or shorter lines") from None
    except Exception:  # the batcher logged it with the request id
        raise InternalError(request_id, doing) from None
    finally:
        for task in (waiting, watch):
            if task is not None and not task.done():
                task.cancel()


async def _answered(app: FastAPI, body: TranslateRequest | ScoreRequest, request: Request,
                    doing: str) -> tuple[str, list[Any]]:
    """:func:`_decoded` under a new request id; a 503 (counted in ``app.state.dropped``) when
    uvicorn's shutdown grace period ends before the answer (``doing``: what it was for)."""
    request_id = uuid.uuid4().hex[:12]
    try:
        return await _decoded(app.state.batcher, body, request_id, request)
    except asyncio.CancelledError:
        app.state.dropped += 1
        raise RequestError(503, f"the server stopped before {doing} this request (request id {request_id}): "
                                "send it again") from None


def create_app(translator: Translator, limits: Limits | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``translator`` (see the module docstring)."""
    limits = (limits or Limits()).fitting(translator.decode)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the translator comes from the app's state, which a reload replaces: a closure over the
        # first one would keep its model in memory beside every later one
        app.state.batcher = Batcher(app.state.translator, limits)
        try:
            yield
        finally:
            app.state.still_decoding = not app.state.batcher.close(timeout=CLOSE_WAIT_S)

    app = FastAPI(title="mtcli", summary=f"Machine translation with {translator.name}", lifespan=lifespan)
    app.state.translator = translator
    app.state.dropped = 0  # requests answered 503 untranslated: the shutdown grace period ended first
    app.state.still_decoding = False  # at shutdown: a batch of those requests left decoding
    app.add_middleware(BodyLimit, most=limits.max_body_bytes)
    if api_key is not None:
        check_api_key(api_key)
        app.add_middleware(KeyCheck, api_key=api_key)  # added last: it runs first

    _answer_errors(app)

    @app.post("/translate", response_model=TranslateResponse, response_model_exclude_none=True,
              responses=REFUSALS)
    async def translate(body: TranslateRequest, request: Request) -> TranslateResponse:
        check_request(body, limits)
        name, out = await _answered(app, body, request, "translating")
        if body.nbest is None:
            return TranslateResponse(translations=out, model=name)
        nbest = [[Hypothesis(text=h.text, score=h.score) for h in hyps] for hyps in out]
        return TranslateResponse(translations=[hyps[0].text if hyps else "" for hyps in out], model=name, nbest=nbest)

    @app.post("/score", response_model=ScoreResponse, responses=SCORE_REFUSALS)
    async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
        check_score_request(body, limits)
        name, out = await _answered(app, body, request, "scoring")
        return ScoreResponse(scores=[value if math.isfinite(value) else None for value in out], model=name)

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        batcher = app.state.batcher
        serving = batcher.translator
        about = {"model": serving.name, "weights_sha256": serving.bundle.weights_sha256, "device": str(serving.device),
                 "target_languages": serving.target_languages}
        if not batcher.alive:  # it survives any failure of a batch, so this is a bug: say so, to be restarted
            return JSONResponse({"status": "unhealthy", "error": STOPPED, **about}, status_code=503)
        return {"status": "ok", **about}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> str:
        return PAGE

    return app


class Reloader:
    """The model loaded again (``load``: the same run directory and checkpoint, so ``best`` is
    the run's newest ``checkpoint_best``) in a thread of its own while the old one goes on
    serving, then swapped in between two batches: a new model without a moment's downtime. A
    load that fails leaves the old model serving, with one log line. A SIGHUP during a load asks
    for one more after it (the checkpoint may have changed since the load began)."""

    def __init__(self, app: FastAPI, load: Callable[[], Translator]) -> None:
        self.app, self.load = app, load
        self._busy = threading.Lock()
        self._asked = False  # a reload asked for and not yet begun

    def start(self) -> threading.Thread | None:
        """Start loading (from a signal handler: it returns at once); None if a load is under way
        (which then loads once more when it is done)."""
        self._asked = True
        if not self._busy.acquire(blocking=False):
            get_logger().info("reload: one is under way (or waits for the server to start); the model is loaded "
                              "once more after it")
            return None
        thread = threading.Thread(target=self._run, name="mtcli-serve-reload", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        while True:
            try:
                while self._asked:
                    self._reload()
            finally:
                self._busy.release()
            if not self._asked or not self._busy.acquire(blocking=False):
                return  # none asked for meanwhile, or a new thread of start() has it

    def _reload(self) -> None:
        """Load the model and swap it in, once the server has started: a SIGHUP before that (while
        the model loaded, say) may be newer than the model, and the SIGHUPs up to the load ask
        for this one load."""
        while (batcher := getattr(self.app.state, "batcher", None)) is None:
            time.sleep(0.1)
        self._asked = False
        old = batcher.translator.name
        try:
            new = self.load()
        except Exception as exc:
            get_logger().error("reload failed, still serving %s: %s: %s", old, type(exc).__name__, one_line(exc))
            return
        batcher.translator = self.app.state.translator = new
        self.app.summary, self.app.openapi_schema = f"Machine translation with {new.name}", None  # /docs: made anew
        get_logger().info("reloaded: serving %s (was %s)", new.name, old)


def warn_of_exposure(host: str, api_key: str | None) -> None:
    """Warn when the server listens where other machines reach it: without an API key anyone who
    reaches the port translates (and the page and /health say what model it is); with one, the
    key crosses the network in clear text. A request's headers and body are timed out here, but
    only per connection: a server for others belongs behind a reverse proxy that adds TLS and
    limits what one client may hold."""
    try:
        local = all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                    for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError, ValueError):
        local = False
    if not local:
        get_logger().warning("%s is reached from other machines: %s; put a reverse proxy with TLS and read timeouts "
                             "in front of it", host, "the API key crosses the network in clear text" if api_key
                             else "without an API key (--api-key, MTCLI_API_KEY) anyone who reaches it translates")


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


#: The most seconds ``--shutdown-grace-s`` may give the requests in flight after SIGTERM.
MAX_SHUTDOWN_GRACE_S = 86_400.0


class _QuietForcedStop(logging.Filter):
    """Drops what uvicorn logs of the lifespan's ``CancelledError`` when a second Ctrl-C forces
    its stop (a traceback): :func:`serve` says the stop in one line after."""

    def __init__(self, server: uvicorn.Server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.server.force_exit and "CancelledError" in record.getMessage())


class _Server(uvicorn.Server):
    """uvicorn's server, which says where it listens once it does: with port 0, the port the
    system chose."""

    def __init__(self, config: uvicorn.Config, listening: Callable[[int], None]) -> None:
        super().__init__(config)
        self.listening = listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Listen (uvicorn's startup), then call ``listening`` with the port."""
        await super().startup(sockets=sockets)
        bound = [sock for server in getattr(self, "servers", ()) for sock in (server.sockets or ())]
        if self.started:
            self.listening(bound[0].getsockname()[1] if bound else self.config.port)


def _uvicorn_logging() -> dict[str, Any]:
    """uvicorn's logging with its access lines on stderr, beside every other log line: standard
    output is left alone (a closed pipe there cost a traceback a request)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def serve(translator: Translator, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          api_key: str | None = None, load: Callable[[], Translator] | None = None,
          shutdown_grace_s: float = 60.0, sighup_received: Callable[[], bool] | None = None) -> bool:
    """Run the server until SIGTERM/SIGINT: the requests in flight are answered first, for up to
    ``shutdown_grace_s`` seconds; those still unanswered then are answered 503 untranslated,
    and a warning says how many. With ``load`` (how ``translator`` was made), SIGHUP serves a
    freshly loaded model (:class:`Reloader`); ``sighup_received`` says whether a SIGHUP came
    before this function could handle it (while the model loaded): it is handled now.

    Returns whether the decoding thread was left inside a batch (:meth:`Batcher.close`): a
    caller that ends the process should then end it with ``os._exit``."""
    if not (isinstance(shutdown_grace_s, int | float) and 0 <= shutdown_grace_s <= MAX_SHUTDOWN_GRACE_S):
        raise ConfigError(f"--shutdown-grace-s {shutdown_grace_s!r}: must be between 0 and {MAX_SHUTDOWN_GRACE_S:g}")
    check_listening(host, port)
    warn_of_exposure(host, api_key)
    log = get_logger()
    app = create_app(translator, limits, api_key)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for the
    # handler it found installed: with this one, a drained server returns and exits 0
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    if load is not None and hasattr(signal, "SIGHUP"):
        reloader = Reloader(app, load)
        hang_up = act_or_hang_up(lambda signum: reloader.start())
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, hang_up)
        if sighup_received is not None and sighup_received():
            hang_up(signal.SIGHUP, None)
    # (ws "none": the app has no WebSocket routes, and an upgraded connection leaves the HTTP protocol's deadline)
    # uvicorn's lines (a request's access line among them) follow mtcli's level: none of its INFO under --quiet
    level = "warning" if console_quiet() else "info"
    config = uvicorn.Config(app, host=host, port=port, log_level=level, timeout_graceful_shutdown=shutdown_grace_s,
                            http=header_deadline_protocol(), ws="none", log_config=_uvicorn_logging(), use_colors=on_terminal() and not os.environ.get("NO_COLOR"))
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    targets = translator.target_languages
    into = f"; into {targets[0]} unless a request's tgt_lang names another of {', '.join(targets)}" \
        if len(targets) > 1 else ""
    name = translator.name
    del translator  # the app's state holds it, until a reload replaces it (then it is freed)
    server = _Server(config, lambda bound: log.info("serving %s on http://%s:%d (API key %s%s)", name,
                                                    shown, bound, "required" if api_key else "not set", into))
    quiet = _QuietForcedStop(server)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot start; its log line says why
        if server.started:
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if not server.started:
        raise ConfigError(f"{host}:{port}: the server did not start (the log above says why)")
    if received and app.state.dropped and server.force_exit:  # a second Ctrl-C: uvicorn stopped waiting
        log.warning("stopped by a second %s before the %g s shutdown grace period ended: %d request(s) still "
                    "unanswered were answered 503, untranslated", signal.Signals(received[-1]).name,
                    shutdown_grace_s, app.state.dropped)
    elif received and app.state.dropped:
        log.warning("stopped by %s: %d request(s) still unanswered after the %g s shutdown grace period "
                    "(--shutdown-grace-s) were answered 503, untranslated", signal.Signals(received[0]).name,
                    app.state.dropped, shutdown_grace_s)
    elif received:
        log.info("stopped by %s after answering the requests in flight", signal.Signals(received[0]).name)
    return app.state.still_decoding


__all__ = ["API_KEY_ENV", "ErrorAnswer", "MAX_SHUTDOWN_GRACE_S", "STOPPED", "Batcher", "Hypothesis", "Limits", "Reloader",
           "TranslateRequest", "check_api_key", "create_app", "check_listening", "request_words", "serve"]
