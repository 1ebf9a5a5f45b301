"""A request's session: the body's conversation id, else the ``x-session-id`` header, else Open
WebUI's ``x-openwebui-chat-id`` (sent on every request of a chat, its side requests included,
when the admin forwards user headers), else none.

The raw value is a client's identifier and may be anything a user typed; only its hash leaves
this module, so no log line or file name ever holds it. The hash is an HMAC-SHA256 (its first 16
hex digits) keyed by the home's secret (``session.key`` under home, 0600, made once), so a
journal's hashes cannot be matched against guessed ids without that file, and stay the same
across restarts.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BODY_FIELDS = ("conversation_id", "conversation", "session_id")
HEADER = "x-session-id"
CHAT_ID_HEADER = "x-openwebui-chat-id"
SECRET_FILE = "session.key"
SECRET_BYTES = 32


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


def hash_session(raw: str, secret: bytes) -> str:
    # surrogatepass: total over every str, including a header's undecodable bytes (aiohttp
    # hands them over as surrogate escapes).
    data = raw.encode("utf-8", "surrogatepass")
    return hmac.new(secret, data, "sha256").hexdigest()[:16]


def session_key(body: Mapping[str, Any], headers: Mapping[str, str],
                secret: bytes) -> str | None:
    """The hashed session of a request, or None. ``conversation`` may also be an object with an
    ``id`` (the Responses API's spelling); empty values count as absent."""
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, Mapping):
            value = value.get("id")
        if isinstance(value, (str, int)) and not isinstance(value, bool) and (
                text := _text(value)):
            return hash_session(text, secret)
    for name in (HEADER, CHAT_ID_HEADER):
        value = headers.get(name)
        if value:
            return hash_session(value, secret)
    return None


def _text(value: str | int) -> str:
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except ValueError:  # over Python's 4300-digit limit for int -> str
        return hex(value)
