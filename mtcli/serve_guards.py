"""What a request to ``mtcli serve`` must pass before the application reads it: its headers in
time (:func:`header_deadline_protocol`), its body's size and pace (:class:`BodyLimit`) and, on
a server with an API key, the key (:class:`KeyCheck`). The last two are ASGI middleware, so a
refused body is never read into memory, and a client without the key learns nothing from the
answers to its requests."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from typing import Any

from mtcli.errors import ConfigError

#: The environment variable that holds the API key (``--api-key``'s ``envvar``).
API_KEY_ENV = "MTCLI_API_KEY"


def stopped(scope: dict) -> None:
    """Count a request the shutdown left unanswered (``app.state.dropped``: the server's warning
    says how many)."""
    state = getattr(scope.get("app"), "state", None)
    if state is not None and isinstance(getattr(state, "dropped", None), int):
        state.dropped += 1


async def answer(send: Any, status: int, error: str, *headers: tuple[bytes, bytes]) -> None:
    """Answer ``status`` with the one-line ``{"error": ...}`` body every refusal has."""
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


#: Seconds a connection has for a request's headers, from its opening or its previous answer:
#: uvicorn times out none, so a client that sent part of a request line, a byte now and then,
#: held its connection for good (nginx's ``client_header_timeout`` is 60 s).
HEADER_TIMEOUT_S = 30.0


def header_deadline_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' where it is installed, else h11's, as uvicorn picks),
    which closes a connection whose request headers have not all arrived within
    :data:`HEADER_TIMEOUT_S` of its opening or of its previous answer. The ASGI application
    never sees such a request, so no middleware can time it out."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # (not a pipelined request, begun already)
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._close)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _close(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


#: Seconds a request body may stop arriving before it is answered 408 and its connection closed:
#: uvicorn times out no body, so a client that sends part of one held its connection for good
#: (enough of them used up the server's file descriptors).
BODY_TIMEOUT_S = 60.0


class BodyLimit:
    """ASGI middleware: a request body over ``most`` bytes is answered 413 as soon as its
    ``Content-Length``, or the bytes that have arrived, say so, and the rest is never read; what
    the application would still answer then is dropped. A body that stops arriving for
    :data:`BODY_TIMEOUT_S` is answered 408. A body still arriving when the shutdown's grace
    period ends is answered 503, as every request the shutdown leaves is (not uvicorn's
    plain-text 500, with a traceback in the log)."""

    def __init__(self, app: Any, most: int) -> None:
        self.app, self.most = app, most

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        seen, answered, started, whole = 0, False, False, False

        async def refuse() -> None:
            nonlocal answered
            answered = True
            await answer(send, 413, f"the request body is over {self.most} bytes: send fewer or shorter lines",
                         (b"connection", b"close"))

        async def counted() -> dict:
            nonlocal seen, answered, whole
            if whole:  # (the body is in: a wait for the client's disconnect may be long)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                answered = True
                await answer(send, 408, f"the request body stopped arriving for {BODY_TIMEOUT_S:g} s",
                             (b"connection", b"close"))
                raise BodyRefused from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.most:
                    await refuse()
                    raise BodyRefused
            return message

        async def sending(message: dict) -> None:
            nonlocal started
            if not answered:
                started = True
                await send(message)

        if declared.isdigit() and int(declared) > self.most:
            return await refuse()
        try:
            with contextlib.suppress(BodyRefused):
                await self.app(scope, counted, sending)
        except asyncio.CancelledError:  # the shutdown's grace period ended while the body still arrived
            if started or answered:
                raise
            stopped(scope)
            await answer(send, 503, "the server stopped before this request had arrived: send it again",
                         (b"connection", b"close"))


class BodyRefused(Exception):
    """Stops an application whose request body :class:`BodyLimit` refused (too large, or stalled)."""


#: What an API key may hold: the visible ASCII characters an HTTP header carries as they are.
_KEY_CHARACTERS = re.compile(r"[!-~]+")


def check_api_key(api_key: str) -> None:
    """Raise :class:`ConfigError` for a key no client could send: HTTP headers carry ASCII, and
    a space or a control character would not come back as it was sent."""
    if not api_key:  # an empty MTCLI_API_KEY= would serve without one, unsaid
        raise ConfigError(f"--api-key (or {API_KEY_ENV}) is empty: give a key, or leave both out to serve "
                          "without one")
    if not _KEY_CHARACTERS.fullmatch(api_key):
        raise ConfigError(f"--api-key (or {API_KEY_ENV}): use visible ASCII characters only, no spaces "
                          "(an HTTP header carries no other characters as they are)")


class KeyCheck:
    """ASGI middleware: with an API key, a request to ``/translate`` or ``/score`` without ``Authorization:
    Bearer KEY`` is answered 401 before its body is read or checked (a client without the key
    learns nothing from the server's answers to its requests). The key is compared in constant
    time."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in ("/translate", "/score"):
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope.get("headers") or ()).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        await answer(send, 401, "missing or wrong API key (send Authorization: Bearer KEY)",
                     (b"www-authenticate", b"Bearer"))


__all__ = ["API_KEY_ENV", "BodyLimit", "KeyCheck", "check_api_key"]
