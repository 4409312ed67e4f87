"""HTTP/1.1 connections with a time limit on receiving each request.

uvicorn limits the idle time between two requests on a kept-alive connection, but not the time a
client takes to send a request: a client that sends its headers (or a body it announced) a byte
at a time, or connects and sends nothing, holds its connection and a file descriptor for as long
as it likes, and enough of them exhaust the server's descriptors (slowloris). `TimedH11` is
uvicorn's h11 protocol with one timer per request: armed when the connection opens and again when
a response ends, it closes the connection if the next request has not fully arrived
`REQUEST_TIMEOUT` seconds later. Unlike nginx's `client_body_timeout`, which times the gap
between two reads, the limit is on the whole request: a body sent a byte a minute is cut too. A
context-sized prompt (128 KB for 32K tokens) arrives in 60 s at 2 KB/s. A request that has
arrived is never timed: a long streamed answer runs as long as it needs. A handler whose client
is cut off mid-body sees a disconnect, with the request's scope marked `TIMED_OUT`, so the server
logs and counts it as a 408, not as a client that went away.

The server always uses this protocol (never httptools, which uvicorn would pick when installed):
one implementation, one behaviour.
"""

from __future__ import annotations

import asyncio
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = 60.0  # seconds from connecting (or from the last response's end) to a whole request
TIMED_OUT = "specgen.request_timed_out"  # set in the ASGI scope of a request whose body the timer cut


class TimedH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request is not in within REQUEST_TIMEOUT."""

    _request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._request_timer = self.loop.call_later(REQUEST_TIMEOUT, self._request_late)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_late(self) -> None:
        """Close the connection unless its request is in: the client's side of h11 is IDLE while
        no request or only part of its head has come, SEND_BODY while part of its body has."""
        self._request_timer = None
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if self.cycle is not None and self.conn.their_state is h11.SEND_BODY:
                self.cycle.scope[TIMED_OUT] = True  # type: ignore[index]
            self.transport.close()


class RequestIds:
    """ASGI middleware, outermost: every answer carries `x-request-id`, the client's own (as vLLM
    echoes it; printable ASCII up to 128 characters) or a new one; a request cancelled because
    the server was forced to stop ends quietly (uvicorn would log a traceback per connection)."""

    def __init__(self, app, stopping=lambda: False):
        self.app, self.stopping = app, stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        ident = (
            given
            if 0 < len(given) <= 128 and all(33 <= c < 127 for c in given)
            else uuid.uuid4().hex.encode()
        )

        async def sending(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", ident)])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            # the server forced to stop (a second Ctrl-C): its connections just close
            if not self.stopping():
                raise
