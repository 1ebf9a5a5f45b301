"""A request's session: the body's conversation id, else the ``x-session-id`` header, else none.

The raw value is a client's identifier and may be anything a user typed; only its hash (sha256,
the first 16 hex digits) leaves this module, so no log line or file name ever holds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

BODY_FIELDS = ("conversation_id", "conversation", "session_id")
HEADER = "x-session-id"


def hash_session(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:16]


def session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The hashed session of a request, or None. ``conversation`` may also be an object with an
    ``id`` (the Responses API's spelling); empty values count as absent."""
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, Mapping):
            value = value.get("id")
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
            return hash_session(str(value))
    value = headers.get(HEADER)
    if value:
        return hash_session(value)
    return None
