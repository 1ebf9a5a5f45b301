"""Who may call what: the checks every request passes before its route.

Always, whatever the tokens (a browser is the attacker here: any page it shows can send requests
to a server on localhost):

- ``Host`` must name this server: localhost, 127.0.0.1 or [::1], the bound address, the local
  address the client's connection reached (so a server bound to 0.0.0.0 answers by any of its own
  addresses), or a name in ``allowed_hosts`` ('*': any). Another name is 421: a DNS-rebound page
  sends its own domain. The port is not compared (a forwarded port changes it; the name is what
  rebinding controls). A request without Host (HTTP/1.0) passes: browsers always send one.
- a POST whose ``Origin`` is present and is not this server's own is 403: a page elsewhere
  posting across origins. Own: http(s), a name the Host check accepts (localhost for a page
  served as 127.0.0.1 too), and the port the client addressed (another port is another app).
- a POST whose Content-Type is not application/json is 415: a page may send text/plain or a form
  to any origin without asking, never JSON. So is a Content-Encoding aiohttp does not decode (a
  body that does not match one it decodes is the route's 400).

``api_key``: when set, /v1/* needs ``Authorization: Bearer <api_key>`` (401, code
invalid_api_key, as OpenAI answers); the admin token is accepted too, so one client can carry
both. /health, /metrics and /console (the page; its data comes from /v1/actors) stay open.

Admin (state-changing: a route marked with :func:`admin_route`, and the request field
``tandem_forced_output``, which asks :func:`require_admin`): with ``admin_token`` set it needs
``Authorization: Bearer <admin_token>`` (401 without one, 403 with another); unset, only a
loopback peer may call it (403). Tokens are compared in constant time. Recording is a start-up
knob (record_dir), not a route.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from aiohttp import web
from yarl import URL

from tandem.config import ServerConfig
from tandem.server.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})  # aiohttp's
_DEFAULT_PORTS = {"http": 80, "https": 443}

# Why the current request may not change state (None: it may). Set by the middleware for each
# request (aiohttp runs each in its own task, so the value is that request's); the default fails
# closed, for code that runs without the middleware.
_ADMIN_DENIAL: ContextVar[ApiError | None] = ContextVar(
    "tandem_admin_denial",
    default=ApiError(403, "no guard checked this request", type="permission_error",
                     code="admin_only"))


def admin_route(handler: Handler) -> Handler:
    """Mark a route handler as one that changes the server's state (admin only)."""
    handler.__tandem_admin__ = True  # type: ignore[attr-defined]
    return handler


def require_admin() -> None:
    """Raise the current request's admin refusal (401/403), if any; for checks that depend on
    the body (tandem_forced_output). Called from the request's own task or a copy of its
    context (asyncio.to_thread copies it)."""
    denial = _ADMIN_DENIAL.get()
    if denial is not None:
        raise denial


def split_host(value: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6][:port]``) as a lowercased name without a trailing dot, and the
    port or None. A port that is not a number is ValueError."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError("unclosed [")
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError("junk after ]")
        port = rest[1:] or None
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, None  # a bare IPv6 address is not a valid Host; it just won't match
    port_number = None
    if port is not None:
        if not port.isdigit() or len(port) > 5:
            raise ValueError("bad port")
        port_number = int(port)
    return name.lower().rstrip("."), port_number


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _bearer(request: web.Request) -> bytes | None:
    """The token of ``Authorization: Bearer <token>``, or None."""
    value = request.headers.get("Authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogateescape")


def _same(token: bytes | None, wanted: bytes) -> bool:
    return token is not None and hmac.compare_digest(token, wanted)


class Guard:
    """The checks of one server's config; ``middleware`` goes inside error_middleware, so that a
    refusal is answered in the OpenAI format."""

    def __init__(self, config: ServerConfig) -> None:
        self.admin_token = config.admin_token.encode() if config.admin_token else None
        self.api_key = config.api_key.encode() if config.api_key else None
        names = {n.strip().lower().rstrip(".") for n in config.allowed_hosts.split(",")}
        self.any_host = "*" in names
        bound = config.host.strip().strip("[]").lower().rstrip(".")
        names.discard("")
        self.names = frozenset(names | LOOPBACK_NAMES
                               | ({bound} if bound not in WILDCARDS else set()))

    # -- the checks --------------------------------------------------------------------------

    def _own_names(self, request: web.Request) -> set[str]:
        """Names the server answers to for this connection: the configured ones and the local
        address the client's connection reached."""
        names = set(self.names)
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(sockname, tuple) and sockname:
            local = str(sockname[0]).lower()
            names.add(local)
            try:
                mapped = getattr(ipaddress.ip_address(local), "ipv4_mapped", None)
            except ValueError:
                mapped = None
            if mapped is not None:
                names.add(str(mapped))
        return names

    def check_host(self, request: web.Request) -> tuple[str, int | None] | None:
        """The Host header as (name, port), None when absent; 421 when it names another
        server."""
        value = request.headers.get("Host")
        if value is None:
            return None
        try:
            host = split_host(value)
        except ValueError:
            raise ApiError(400, "the Host header is malformed", code="invalid_host") from None
        if not self.any_host and host[0] not in self._own_names(request):
            raise ApiError(421, "this server does not answer for that Host; add the name to "
                           "allowed_hosts to reach it by it", code="misdirected_request")
        return host

    def check_origin(self, request: web.Request, host: tuple[str, int | None] | None) -> None:
        origin = request.headers.get("Origin")
        if origin is None:
            return
        refused = ApiError(403, "cross-origin requests are refused: the Origin is not this "
                           "server's", type="permission_error", code="cross_origin")
        try:
            url = URL(origin)
            scheme, name = url.scheme, (url.host or "").lower().rstrip(".")
            port = url.explicit_port
        except (ValueError, TypeError):
            raise refused from None
        if scheme not in _DEFAULT_PORTS or not name or url.path not in ("", "/"):
            raise refused  # "null" (a sandboxed frame, a file), or not an origin at all
        default = _DEFAULT_PORTS[scheme]
        if host is not None:
            addressed = host[1] or default
        else:
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            addressed = sockname[1] if isinstance(sockname, tuple) else default
        # The server's own page, by any of its names, on the port the client addressed (another
        # port of this machine is another web app).
        if (port or default) != addressed or not (
                self.any_host or name in self._own_names(request)):
            raise refused

    def check_api_key(self, request: web.Request) -> None:
        if self.api_key is None or not (request.path == "/v1" or
                                        request.path.startswith("/v1/")):
            return
        token = _bearer(request)
        if _same(token, self.api_key) or (self.admin_token and _same(token, self.admin_token)):
            return
        raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                       "<api_key>'", type="invalid_request_error", code="invalid_api_key")

    def admin_denial(self, request: web.Request) -> ApiError | None:
        """Why this request may not change state, or None when it may."""
        if self.admin_token is None:
            if is_loopback(request.remote):
                return None
            return ApiError(403, "this changes the server's state and is answered to loopback "
                            "clients only (set admin_token to allow it from elsewhere)",
                            type="permission_error", code="admin_only")
        token = _bearer(request)
        if token is None:
            return ApiError(401, "this changes the server's state: send 'Authorization: Bearer "
                            "<admin_token>'", type="authentication_error",
                            code="admin_token_required")
        if not _same(token, self.admin_token):
            return ApiError(403, "the admin token is wrong", type="permission_error",
                            code="admin_token_wrong")
        return None

    # -- the middleware ----------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            denial = self.check(request)
        except ApiError as e:
            # Refused before its body was read: close after the answer rather than let aiohttp
            # read (linger over) what the client still sends.
            e.close = e.close or request.can_read_body
            raise
        _ADMIN_DENIAL.set(denial)
        return await handler(request)

    def check(self, request: web.Request) -> ApiError | None:
        """Raise the refusal of ``request``; return why it may not change state (None: it
        may), for the checks that depend on its body."""
        host = self.check_host(request)
        if request.method not in SAFE_METHODS:
            self.check_origin(request, host)
            if request.content_type != "application/json":
                raise ApiError(415, "the body must be JSON (Content-Type: application/json)",
                               code="unsupported_media_type")
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in DECODED_ENCODINGS:
                # aiohttp would hand such a body over as it came, undecoded.
                raise ApiError(415, "the Content-Encoding must be one of gzip, deflate, br, zstd",
                               code="unsupported_content_encoding")
        self.check_api_key(request)
        denial = self.admin_denial(request)
        if denial is not None and getattr(request.match_info.handler, "__tandem_admin__",
                                          False):
            raise denial
        return denial


def guard_middleware(config: ServerConfig) -> Any:
    return Guard(config).middleware
