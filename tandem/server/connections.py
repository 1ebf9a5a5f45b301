"""Connections: a deadline on request headers, a cap on open connections, and HTTP framing
errors answered in the OpenAI format.

aiohttp times nothing before a request's headers are complete: a client that sends them a byte
a second holds its connection (a file descriptor) for as long as it likes, and enough of them
fill the file table. Here each connection is either *waiting for headers* (since it opened, or
since its previous response ended; an idle keep-alive connection is waiting too) or *mid-request*
(its headers are in; the body's own deadline is the route's request_read_timeout_s):

- a connection waiting longer than ``header_timeout_s`` is closed;
- at ``max_connections`` open, a new connection closes the one that has waited longest for its
  headers and takes its place, so that a flood of slow clients never keeps /health from
  answering; only when every connection is mid-request is the new one refused (a 503, closed).

`GuardedRunner` is aiohttp's AppRunner with this protocol; `tandem serve` and the tests' server
both use it. aiohttp's own parse errors (a bad request line or header, a header over 8190 bytes)
are answered as JSON in the OpenAI error shape instead of text/plain.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from tandem.server.errors import ApiError
from tandem.server.keys import CONFIG

log = structlog.get_logger("tandem.server")

FD_MARGIN = 64  # descriptors kept for everything that is not a client connection

_REFUSED_BODY = msgspec.json.encode(ApiError(
    503, "the server holds as many connections as it may (max_connections), each mid-request",
    code="too_many_connections").body())
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
           + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)

_FRAMING = {  # aiohttp's parse errors by class name: what the client is told (never its bytes)
    "LineTooLong": "a request line or header is too long",
    "BadStatusLine": "the request line is malformed",
    "BadHttpMethod": "the request line is malformed",
    "InvalidURLError": "the request target is malformed",
    "InvalidHeader": "a header is malformed",
    "BadHttpMessage": "the request is malformed",
    "ContentEncodingError": "the body does not match its Content-Encoding",
    "ContentLengthError": "the body does not match its Content-Length",
    "TransferEncodingError": "the body's chunked encoding is malformed",
}


class GuardedHandler(RequestHandler):
    """aiohttp's protocol for one connection, with the header deadline and the JSON errors."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout_s = manager.header_timeout_s
        # Loop time since which the connection waits for a request's headers; None while a
        # request is in (read, handled, answered).
        self.waiting_since: float | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._guard_manager = manager

    @property
    def open(self) -> bool:
        return self.transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard_manager.admit():
            log.warning("connection_refused", reason="max_connections")
            transport.write(REFUSED)  # type: ignore[attr-defined]
            transport.close()
            self._manager = None  # never registered: connection_lost has nothing to undo
            return
        super().connection_made(transport)
        self._wait_for_headers()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a request's headers are complete
            self._disarm()

    async def _handle_request(self, request, start_time, request_handler):
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            # The answer is out: the connection waits for the next request's headers, unless
            # they are already queued (pipelined) or it is closing.
            if self.open and not self._messages:
                self._wait_for_headers()

    def _wait_for_headers(self) -> None:
        loop = asyncio.get_running_loop()
        self._disarm()
        self.waiting_since = loop.time()
        self._deadline = loop.call_at(self.waiting_since + self.header_timeout_s,
                                      self._headers_late)

    def _disarm(self) -> None:
        self.waiting_since = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.waiting_since is not None and self.open:
            log.info("connection_closed", reason="header_timeout",
                     timeout_s=self.header_timeout_s)
            self.evict()

    def evict(self) -> None:
        """Close the connection now (it is waiting for headers: no request is lost)."""
        self._disarm()
        self.force_close()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse, or to a handler's escape, as an
        OpenAI error (the connection closes after it)."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response is partly sent; no error can follow it")
        name = type(exc).__name__ if exc is not None else None
        if status >= 500:
            log.error("request_failed", path=request.path, error=name)
            error = ApiError(status, "internal server error", type="server_error",
                             code="internal_error")
        else:
            log.info("http_invalid", status=status, error=name)
            error = ApiError(status, f"the request is not valid HTTP/1.1: "
                             f"{_FRAMING.get(name or '', 'it could not be parsed')}",
                             code="invalid_http")
        resp = error.response()
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's connection factory and registry, making `GuardedHandler` connections."""

    def __init__(self, handler: Any, *, header_timeout_s: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.header_timeout_s = header_timeout_s
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and max_connections > soft - FD_MARGIN:
            held = max(1, soft - FD_MARGIN)
            log.warning("max_connections_over_fd_limit", max_connections=max_connections,
                        fd_limit=soft, held_to=held)
            max_connections = held
        self.max_connections = max_connections
        self.refused = 0
        self.evicted = 0

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)

    def admit(self) -> bool:
        """Room for one more connection: True when there is (closing the one that has waited
        longest for its headers when at the cap), False when every one is mid-request."""
        live = [h for h in self._connections if getattr(h, "open", True)]
        if len(live) < self.max_connections:
            return True
        waiting = [h for h in live if getattr(h, "waiting_since", None) is not None]
        if not waiting:
            self.refused += 1
            return False
        oldest = min(waiting, key=lambda h: h.waiting_since)
        log.info("connection_closed", reason="max_connections")
        oldest.evict()
        self.evicted += 1
        return True


class GuardedRunner(web.AppRunner):
    """AppRunner serving through `GuardedServer`; the knobs default to the app's config
    (server.header_timeout_s, server.max_connections)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float | None = None,
                 max_connections: int | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        server = app[CONFIG].server if CONFIG in app else None
        self.header_timeout_s = header_timeout_s if header_timeout_s is not None else (
            server.header_timeout_s if server is not None else 10.0)
        self.max_connections = max_connections if max_connections is not None else (
            server.max_connections if server is not None else 1024)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app's own, with every handler argument
        return GuardedServer(
            plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=plain._loop,
            header_timeout_s=self.header_timeout_s, max_connections=self.max_connections,
            **plain._kwargs)
