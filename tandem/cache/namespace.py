"""The cache namespace of a request: which tenant's cached state it may be served from.

A request's ``cache_salt`` (a request field, as vLLM has it) names a tenant. Every cached copy
of state (the rows in place and the resident prefix's anchors, end, stash, pin and park, the
state store's entries, the response cache's answers, and every tier built later: disk, spill)
records the namespace it was computed in, and a copy is offered only to a request of the same
namespace: an offer across namespaces is a miss, so the request is served cold and learns
nothing (neither ``cached_tokens`` nor its time to first token) of another tenant's prompts.

Requests without a salt share one namespace, ``SHARED``, among themselves. The salt itself is
a secret of the client: it never leaves the server's request handling. Only its digest is
kept, as a key, beside the copies, and no log line or journal row carries either.
"""

from __future__ import annotations

import hashlib
from typing import NewType

Namespace = NewType("Namespace", str)
"""The sha256 (hex) of a request's cache salt; ``SHARED`` for a request with none."""

SHARED = Namespace("")


def namespace_of(cache_salt: str | None) -> Namespace:
    """The namespace of a request with this ``cache_salt`` (None: the shared one). The digest
    is domain-separated, so it is no plain sha256 of the salt a client could look up."""
    if cache_salt is None:
        return SHARED
    digest = hashlib.sha256(b"tandem cache salt\0" + cache_salt.encode("utf-8", "surrogatepass"))
    return Namespace(digest.hexdigest())
