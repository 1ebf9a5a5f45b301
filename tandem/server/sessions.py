"""A request's session: the body's conversation id, else the ``x-session-id`` header, else none.

The raw value is a client's identifier and may be anything a user typed; only its hash leaves
this module, so no log line or file name ever holds it. The hash is an HMAC-SHA256 (its first 16
hex digits) keyed by the home's secret (``session.key`` under home, 0600, made once), so a
journal's hashes cannot be matched against guessed ids without that file, and stay the same
across restarts. The key in effect is the current request's (``secret_middleware`` sets it);
outside a request it is a random key of this process.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from aiohttp import web

BODY_FIELDS = ("conversation_id", "conversation", "session_id")
HEADER = "x-session-id"
SECRET_FILE = "session.key"
SECRET_BYTES = 32

_PROCESS_SECRET = secrets.token_bytes(SECRET_BYTES)
_SECRET: ContextVar[bytes] = ContextVar("tandem_session_secret", default=_PROCESS_SECRET)


def load_secret(home: Path) -> bytes:
    """The home's session secret, made (0600, with home 0700 if it is made too) when missing or
    not a whole key."""
    path = Path(home) / SECRET_FILE
    try:
        key = path.read_bytes()
        if len(key) == SECRET_BYTES:
            return key
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(SECRET_BYTES)
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)  # whole or absent: a torn key would change every hash
    return key


def secret_middleware(secret: bytes) -> Any:
    """Hash the sessions of this app's requests with ``secret``."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        _SECRET.set(secret)
        return await handler(request)

    return middleware


def hash_session(raw: str, secret: bytes | None = None) -> str:
    # surrogatepass: total over every str, including a header's undecodable bytes (aiohttp
    # hands them over as surrogate escapes).
    data = raw.encode("utf-8", "surrogatepass")
    key = secret if secret is not None else _SECRET.get()
    return hmac.new(key, data, "sha256").hexdigest()[:16]


def session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The hashed session of a request, or None. ``conversation`` may also be an object with an
    ``id`` (the Responses API's spelling); empty values count as absent."""
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, Mapping):
            value = value.get("id")
        if isinstance(value, (str, int)) and not isinstance(value, bool) and (
                text := _text(value)):
            return hash_session(text)
    value = headers.get(HEADER)
    if value:
        return hash_session(value)
    return None


def _text(value: str | int) -> str:
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except ValueError:  # over Python's 4300-digit limit for int -> str
        return hex(value)
