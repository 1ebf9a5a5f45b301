"""The tower's cache (issue 19, part 4): the vision tower's output for an image, kept by the digest
of its preprocessed patches and grid, so a conversation that resends its image every turn (Open
WebUI does) runs the tower once.

The key is the digest the prompt's key_ids are made from (PreprocessedImage.digest): the same
pixels under another URL hit, the same URL with new pixels misses. An entry is the tower's rows
for the image (a tensor ``[tokens, hidden]``); the cache holds at most ``budget_nbytes`` of them
(``image_cache_mb``), least recently used out first. An entry larger than the whole budget is not
kept. It is the engine thread's: the tower runs there and only there, so it takes no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class TowerCache:
    def __init__(self, budget_nbytes: int) -> None:
        if budget_nbytes < 0:
            raise ValueError("the tower cache's budget must be >= 0")
        self.budget_nbytes = budget_nbytes
        self._rows: OrderedDict[str, Any] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.refused = 0  # entries larger than the whole budget

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, digest: str) -> bool:
        return digest in self._rows

    def get(self, digest: str) -> Any | None:
        """The rows kept for ``digest`` (now the most recent), or None; counts a hit or a miss."""
        rows = self._rows.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self._rows.move_to_end(digest)
        self.hits += 1
        return rows

    def put(self, digest: str, rows: Any) -> bool:
        """Keep ``rows`` for ``digest``, dropping the least recently used to make room; False when
        they alone are over the budget (nothing is dropped for them)."""
        size = _nbytes(rows)
        if size > self.budget_nbytes:
            self.refused += 1
            return False
        old = self._rows.pop(digest, None)
        if old is not None:
            self.nbytes -= _nbytes(old)
        while self._rows and self.nbytes + size > self.budget_nbytes:
            _, dropped = self._rows.popitem(last=False)
            self.nbytes -= _nbytes(dropped)
            self.evictions += 1
        self._rows[digest] = rows
        self.nbytes += size
        return True

    def clear(self) -> int:
        """Drop every entry; how many there were (POST /v1/cache/clear)."""
        n = len(self._rows)
        self._rows.clear()
        self.nbytes = 0
        return n

    def statistics(self) -> dict[str, int]:
        return {"entries": len(self._rows), "nbytes": self.nbytes,
                "budget_nbytes": self.budget_nbytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "refused": self.refused}


def _nbytes(rows: Any) -> int:
    if hasattr(rows, "element_size") and hasattr(rows, "nelement"):
        return int(rows.element_size() * rows.nelement())
    return int(rows.nbytes)


class ImagePlacer:
    """A prompt's images placed for its prefill, on the engine thread: the tower runs (or its
    cache answers) only for the images whose rows the prefill forwards, so a prompt resumed past
    an image never encodes it. ``runs`` and ``hits`` count this prompt's tower runs and cache
    hits (the journal's)."""

    def __init__(self, inputs: Sequence[Any], support: Any, cache: TowerCache | None) -> None:
        self.inputs = list(inputs)  # image_keys.ImageInput, in prompt order
        self.support = support  # vision.ImageSupport
        self.cache = cache
        self.runs = 0
        self.hits = 0

    def place(self, key_ids: Sequence[int], start: int) -> Any:
        """vision.PromptImages of the prompt ``key_ids`` (its image rows the images' keys) for
        a prefill of rows [start, len): the rows of every image that reaches past ``start``
        (None for the others, never read), the positions of all of them."""
        from tandem.models import image_keys, vision
        from tandem.models.base import ModelError

        s = self.support
        if s is None:
            raise ModelError("this model reads no images: it has no vision tower")
        merge = s.processor.merge_size
        real = image_keys.real_ids(key_ids, s.image_token_id)
        spans = vision.image_spans(real, [tuple(i.grid) for i in self.inputs], s.image_token_id,
                                   merge)
        embeds = []
        for span, image in zip(spans, self.inputs):
            if key_ids[span.start] != image.key or key_ids[span.stop - 1] != image.key:
                raise ValueError("an image's rows do not carry its key")
            embeds.append(self._rows(image) if span.stop > start else None)
        positions, delta = vision.rope_positions(len(key_ids), spans, merge)
        return vision.PromptImages(spans=spans, embeds=embeds, positions=positions, delta=delta)

    def _rows(self, image: Any) -> Any:
        rows = self.cache.get(image.digest) if self.cache is not None else None
        if rows is not None:
            self.hits += 1
            return rows
        import torch

        with torch.inference_mode():
            rows = self.support.tower.encode(image.pixel_values, tuple(image.grid))
        self.runs += 1
        if self.cache is not None:
            self.cache.put(image.digest, rows)
        return rows
