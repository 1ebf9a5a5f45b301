"""The image caps (issue 19, part 5): past ``max_images`` images, or ``max_image_tokens`` of their
rows, a conversation's oldest images are left out, each replaced by one fixed text.

They are left out in steps of half the cap, never one at a time. A chat UI resends every image
every turn; leaving out exactly the excess would move the first left-out image one turn later
each turn, so the prompt would part from the last one at its first image and no cache could
resume it. With steps, the left-out set moves once every half a cap of new images: between the
moves the prompt's head up to the first image still sent is the same text turn after turn, and
the session resumes there.

    count cap C, N images:  k = 0 while N <= C, else ceil((N - C) / (C // 2)) * (C // 2)
    token cap T, each image's tokens t_i: the excess E = sum(t) - T is rounded up to a
        multiple of T // 2, and k is the fewest oldest images whose tokens reach it

Both are functions of what the request carries, so a replay, a restart and the peek leave out
the same images. A left-out image is never decoded, so an old image's bytes cost nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from tandem.server.images import ImagePart

LEFT_OUT_TEXT = "[an earlier image, left out]"


def left_out_by_count(n_images: int, max_images: int) -> int:
    """How many of the oldest of ``n_images`` images are left out under a cap of ``max_images``."""
    if max_images < 1:
        raise ValueError("max_images must be at least 1")
    if n_images <= max_images:
        return 0
    step = max(1, max_images // 2)
    steps = -(-(n_images - max_images) // step)
    return min(n_images, steps * step)


def left_out_by_tokens(tokens: Sequence[int], max_tokens: int) -> int:
    """How many of the oldest images (their row counts in order) are left out under a cap of
    ``max_tokens`` image rows."""
    if max_tokens < 1:
        raise ValueError("max_image_tokens must be at least 1")
    excess = sum(tokens) - max_tokens
    if excess <= 0:
        return 0
    step = max(1, max_tokens // 2)
    goal = -(-excess // step) * step
    dropped = 0
    for k, t in enumerate(tokens, start=1):
        dropped += t
        if dropped >= goal:
            return k
    return len(tokens)


def leave_out(messages: Sequence[Any], parts: Sequence[ImagePart], k: int) -> list[Any]:
    """A copy of ``messages`` with the first ``k`` of ``parts`` (as image_parts found them)
    replaced by the fixed text part; the client's messages are left as they were."""
    if k <= 0:
        return list(messages)
    out = copy.deepcopy(list(messages))
    for part in parts[:k]:
        i, j = _indices(part.where)
        out[i]["content"][j] = {"type": "text", "text": LEFT_OUT_TEXT}
    return out


def _indices(where: str) -> tuple[int, int]:
    # "messages[i].content[j]", as images.image_parts writes it
    head, _, tail = where.partition("].content[")
    return int(head[len("messages["):]), int(tail[:-1])
