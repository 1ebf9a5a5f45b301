"""key_ids (issue 19, part 3): a prompt's image rows as ids that name the image, not the
placeholder.

Every image's prompt rows are the same placeholder token (``<|image_pad|>``), so a cache keyed
on the token ids would answer a prompt with another image's state. The engine and every cache
(the resident prefix and its anchors, the park, the state store, the disk tier, the spill, the
response cache, the end records) therefore see the prompt's **key ids**: the token ids with each
image's placeholder rows replaced by one key of that image. Only the model's forward sees the
placeholder again (``real_ids``), with the tower's rows in its place.

The rule: an image's key is

    KEY_BASE + (first 38 bits of its digest << 24) + (merged grid height << 12) + merged width

with ``KEY_BASE = 2**62``: above every vocabulary id (a vocabulary is under 2**31), within
int64 (the disk tier's and the spill's token ids). The digest (PreprocessedImage.digest) is a
sha256 over the grid and the preprocessed patches, so the same pixels under another URL have
the same key and new pixels under the same URL another. Every row of the image carries the key.

The key holds the merged grid, so the rotary offset the images leave (``rope_delta``) is a
function of the ids alone: a copy of the rows (an anchor, a store entry, a disk chunk, a spill
entry) carries the offset of the text after them as part of its token ids, and a resume at an
anchor past an image, or the compaction's continuation at an end anchor, turns its next rows
as the prompt with the image did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

KEY_BASE = 1 << 62
SIDE_BITS = 12  # a merged side under 4,096 rows (131,072 pixels at patch 16, merge 2)
HASH_BITS = 38
MAX_SIDE = (1 << SIDE_BITS) - 1


def image_key(digest: str, grid: Sequence[int], merge_size: int) -> int:
    """The key id of an image: its digest's first bits and its merged grid (see the module)."""
    t, h, w = (int(v) for v in grid)
    gh, gw = h // merge_size, w // merge_size
    if t != 1 or not (0 < gh <= MAX_SIDE and 0 < gw <= MAX_SIDE):
        raise ValueError(f"an image grid {tuple(grid)} has no key (one frame, merged sides "
                         f"1 to {MAX_SIDE})")
    bits = int(digest[:16], 16) >> (64 - HASH_BITS)
    return KEY_BASE + (bits << (2 * SIDE_BITS)) + (gh << SIDE_BITS) + gw


def is_key(token_id: int) -> bool:
    return token_id >= KEY_BASE


def key_sides(key: int) -> tuple[int, int]:
    """The merged grid (height, width) a key carries."""
    low = key - KEY_BASE
    return (low >> SIDE_BITS) & MAX_SIDE, low & MAX_SIDE


def key_ids(token_ids: Sequence[int], keys: Sequence[int], image_token_id: int) -> list[int]:
    """``token_ids`` (placeholders expanded: each image's rows in a row) with image k's rows
    replaced by ``keys[k]``; each image's row count is read from its key's grid."""
    out = list(token_ids)
    i, n = 0, len(out)
    for k, key in enumerate(keys):
        gh, gw = key_sides(key)
        count = gh * gw
        while i < n and out[i] != image_token_id:
            i += 1
        if i + count > n or any(out[j] != image_token_id for j in range(i, i + count)):
            raise ValueError(f"the prompt holds too few image rows for image {k}")
        out[i:i + count] = [key] * count
        i += count
    if image_token_id in out[i:]:
        raise ValueError("the prompt holds more image rows than its images fill")
    return out


def has_keys(ids: Sequence[int]) -> bool:
    return bool(ids) and max(ids) >= KEY_BASE


def real_ids(ids: Sequence[int], image_token_id: int) -> list[int]:
    """The ids the model embeds: every key back to the placeholder."""
    return [image_token_id if t >= KEY_BASE else t for t in ids]


def rope_delta(ids: Sequence[int]) -> int:
    """The rotary offset past ``ids`` (vision.rope_positions' delta): a row at index
    i >= len(ids) turns at i + delta. Each whole image of a merged gh x gw grid advances the
    positions by max(gh, gw) for its gh * gw rows; an image cut short by the end of ``ids``
    counts nothing (no text follows a part of an image)."""
    if not has_keys(ids):
        return 0
    delta, i, n = 0, 0, len(ids)
    while i < n:
        key = ids[i]
        if key < KEY_BASE:
            i += 1
            continue
        j = i
        while j < n and ids[j] == key:
            j += 1
        gh, gw = key_sides(key)
        whole = (j - i) // (gh * gw)  # the same image twice in a row is one run
        delta += whole * (max(gh, gw) - gh * gw)
        i = j
    return delta


def text_runs(ids: Sequence[int]) -> list[list[int]]:
    """``ids`` cut at every image row: the runs of vocabulary ids alone (what the suffix store
    may keep: it never receives placeholder rows)."""
    runs, run = [], []
    for t in ids:
        if t >= KEY_BASE:
            if run:
                runs.append(run)
                run = []
        else:
            run.append(t)
    if run:
        runs.append(run)
    return runs


class ImageInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt as the engine takes it (the route preprocessed it): its key, the
    digest the tower's cache keys it by, its patch grid and its patches. Never logged."""

    key: int
    digest: str
    grid: tuple[int, int, int]
    pixel_values: Any  # numpy float32 [t * h * w, patch_dim]

    @property
    def num_tokens(self) -> int:
        gh, gw = key_sides(self.key)
        return gh * gw
