"""Errors in the OpenAI format, ``{"error": {"message", "type", "param", "code"}}``, never a
traceback.

Handlers raise :class:`ApiError`; the middleware turns it, aiohttp's own HTTP errors (an unknown
route, a wrong method) and anything unexpected into that shape. An unexpected exception is logged
with its traceback as text (names and types only reach the log, never the request's content) and
answered 500 without details.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

log = structlog.get_logger("tandem.server")

# A 503 that has no estimate of its own (a stopped actor, a cancelled request): a client that
# honours Retry-After comes back after this long.
DEFAULT_RETRY_AFTER_S = 1.0

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answer. ``close``: the connection is closed after it (the request's body was not
    read to its end); ``retry_after_s``: sent as Retry-After."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after_s: float | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500
                                       else "invalid_request_error")
        self.retry_after_s = retry_after_s
        self.close = close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        retry_after_s = self.retry_after_s
        if retry_after_s is None and self.status == 503:
            retry_after_s = DEFAULT_RETRY_AFTER_S  # every 503 says when to come back
        if retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(retry_after_s)))
        resp = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close:
            resp.force_close()
        return resp


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                           ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        resp = e.response()
        if e.close:
            # The rest of the body is never read: send the answer, then close at once (aiohttp
            # would otherwise linger, reading what a slow client still sends).
            await resp.prepare(request)
            await resp.write_eof()
            if request.protocol is not None:
                request.protocol.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise  # a redirect is not an error
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            e.status)
        message = e.reason if e.status != 404 else f"no route {request.method} {request.path}"
        error = ApiError(e.status, message, code=code)
        resp = error.response()
        for name in ("Allow",):
            if name in e.headers:
                resp.headers[name] = e.headers[name]
        return resp
    except Exception as e:
        log.error("request_failed", path=request.path, error=type(e).__name__,
                  traceback="".join(traceback.format_exception(e)))
        return ApiError(500, "internal server error", type="server_error",
                        code="internal_error").response()
