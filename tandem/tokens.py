"""Token-id sequence helpers shared by the engine, the caches and the server."""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share (slices compared a block at a time:
    prompts of 100k tokens are compared on every request)."""
    n = min(len(a), len(b))
    i, step = 0, 4096
    while i < n:
        j = min(n, i + step)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n
