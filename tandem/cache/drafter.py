"""The lookup drafter: draft tokens for speculative decoding by matching the context's tail,
first in the context itself (prompt lookup: the most recent earlier occurrence of the longest
suffix), then in the persistent suffix store.

Pure logic, no asyncio. Made for one generation at a time: `start(prompt_ids)` indexes the
prompt, and every `propose(context, k)` after it passes the same context grown by the tokens
accepted since (the caller's list; it is read, never copied or changed). Only the positions added
since the last call are indexed, so a call costs the same at a 32k context as at a short one.
"""

from __future__ import annotations

from typing import Sequence

from tandem.cache.suffix import PersistentSuffixStore
from tandem.models.image_keys import KEY_BASE, has_keys

MAX_CANDIDATES = 64  # most recent occurrences of the min_ngram tail compared for a longer match


class LookupDrafter:
    def __init__(self, store: PersistentSuffixStore | None = None, *, min_ngram: int = 2,
                 max_ngram: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.store = store
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        # The min_ngram tokens ending at e (exclusive) -> every such e, ascending. Holds the ends
        # e <= indexed_upto; a lookup at context length L indexes up to L - 1, so each end has a
        # token after it and the tail itself (ending at L) is never its own match.
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed_upto = 0
        self.lookups = 0
        self.hits_context = 0
        self.hits_store = 0
        self.misses = 0

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Forget the last generation and index this prompt (at prefill, off the decode path)."""
        self._ends = {}
        self._indexed_upto = 0
        self._index(prompt_ids, len(prompt_ids) - 1)

    def _index(self, context: Sequence[int], upto: int) -> None:
        ends, n = self._ends, self.min_ngram
        for e in range(max(self._indexed_upto + 1, n), upto + 1):
            key = tuple(context[e - n:e])
            found = ends.get(key)
            if found is None:
                ends[key] = [e]
            else:
                found.append(e)
        self._indexed_upto = max(self._indexed_upto, upto)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow context; [] when nothing matches."""
        if k <= 0:
            return []
        self.lookups += 1
        if len(context) - 1 < self._indexed_upto:  # not the context this drafter was started on
            self.start(())
        draft = self._from_context(context, k)
        if draft:
            self.hits_context += 1
        elif self.store is not None and not has_keys(context[-self.max_ngram:]) and (
                draft := self.store.lookup(context, k, min_ngram=self.min_ngram,
                                           max_ngram=self.max_ngram)):
            self.hits_store += 1
        else:
            self.misses += 1
        # A prompt with images holds their key ids (tandem.models.image_keys): a draft stops
        # before one, so no image row is ever forwarded as a generated token, and the store
        # (vocabulary ids only) is never asked about a tail that holds one.
        for i, t in enumerate(draft):
            if t >= KEY_BASE:
                return draft[:i]
        return draft

    def _from_context(self, context: Sequence[int], k: int) -> list[int]:
        length = len(context)
        if length < self.min_ngram + 1:
            return []
        self._index(context, length - 1)
        ends = self._ends.get(tuple(context[length - self.min_ngram:]))
        if not ends:
            return []
        longest = min(self.max_ngram, length - 1)
        best_end, best_n = 0, 0
        for end in reversed(ends[-MAX_CANDIDATES:]):  # most recent first: it wins a tie
            n = self.min_ngram
            while n < longest and n < end and context[end - 1 - n] == context[length - 1 - n]:
                n += 1
            if n > best_n:
                best_end, best_n = end, n
                if n == longest:
                    break
        return list(context[best_end:best_end + k])

    def statistics(self) -> dict:
        return {"lookups": self.lookups, "hits_context": self.hits_context,
                "hits_store": self.hits_store, "misses": self.misses}
