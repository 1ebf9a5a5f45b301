"""The disk tier's keys: a chain of hashes along a prompt's grid lines.

``key(b)`` names the prefix ``tokens[:b]`` at a grid line ``b``: ``H(key(b - G), namespace,
tokens[b - G:b])`` from a root that holds the grid and the namespace (the cache salt's digest).
A row depends only on the tokens before it, so two prompts that share their first ``b`` tokens
share every key up to ``b``, and a prompt that extends another has the other's keys as its
first ones: it writes only its new chunks. The chunk file of rows ``[b - G, b)`` and the anchor
file of the state at ``b`` are both named by ``key(b)``.

A key is the hex of a sha256 and nothing else: no file name, log line or header carries a
token or the salt.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NewType, Sequence

from tandem.cache.namespace import Namespace

Key = NewType("Key", str)
"""The hex sha256 of a prefix on the grid, in its namespace."""

KEY_HEX = 64


def root_key(grid: int, namespace: Namespace) -> bytes:
    h = hashlib.sha256(b"tandem disk chain\0")
    h.update(grid.to_bytes(8, "little"))
    h.update(namespace.encode())
    return h.digest()


def next_key(previous: bytes, namespace: Namespace, token_ids: Sequence[int]) -> bytes:
    h = hashlib.sha256(previous)
    h.update(namespace.encode())
    h.update(b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(token_ids: Sequence[int], grid: int, namespace: Namespace,
               stop: int | None = None) -> list[Key]:
    """``key(G), key(2G), ...`` up to the last line at or below ``stop`` (default: the prompt's
    length); ``result[i]`` names the prefix of ``(i + 1) * grid`` tokens."""
    if grid <= 0:
        raise ValueError("the grid must be positive")
    n = len(token_ids) if stop is None else min(stop, len(token_ids))
    keys: list[Key] = []
    k = root_key(grid, namespace)
    for b in range(grid, n + 1, grid):
        k = next_key(k, namespace, token_ids[b - grid:b])
        keys.append(Key(k.hex()))
    return keys


def is_key(text: str) -> bool:
    return len(text) == KEY_HEX and all(c in "0123456789abcdef" for c in text)
