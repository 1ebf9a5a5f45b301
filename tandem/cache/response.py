"""The response cache (spec: "Response cache"): an identical greedy request, the same prompt ids
and the same parameters, answered from memory without the engine. Greedy output is a function
of its input, so this is memoisation, not an approximation; a sampled request is never answered
from it. Off by default (knob ``response_cache``), so that a benchmark can never be pointed at
a dictionary by accident.

Pure logic: the server looks a request up before it asks the engine and stores what the engine
sent for a generation that ran to its end. The key is every input that shapes the output: the
prompt ids the client's request rendered to, the sampling parameters (stop ids, the reasoning
budget, forced ids, the logprobs asked for) and the stop strings, and the request's cache
namespace (its salt's digest, tandem/cache/namespace.py), so that one tenant is never answered
from another's requests. Its digest only picks the entry; the stored prompt and parameters are
compared element by element before an answer is given. An answer that carried logprobs keeps
them and replays them; one without is never replayed to a request that asks for them (the
logprobs fields are in the parameters, so in the key).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from tandem.cache.namespace import SHARED, Namespace

ENTRY_OVERHEAD_NBYTES = 512  # the entry's objects beside its token arrays


@dataclass(frozen=True)
class CachedResponse:
    """What the engine sent: every generated token (with its hidden flag) and its last event's
    fields (a GenerationFinished as builtins); for a request that asked for them, each token's
    logprobs and the prompt's (tandem.logprobs.TokenLogprob), replayed as they came."""

    tokens: tuple[tuple[int, bool], ...]
    finished: dict[str, Any]
    logprobs: tuple[Any, ...] | None = None  # one a token, or None when not asked for
    prompt_logprobs: tuple[Any, ...] | None = None

    def logprobs_nbytes(self) -> int:
        """What the entries hold: a token id and a float each, and the same per top pair."""
        entries = [e for e in (self.logprobs or ()) + (self.prompt_logprobs or ())
                   if e is not None]
        return sum(16 * (1 + len(e.top)) + 64 for e in entries)


@dataclass
class _Entry:
    prompt_ids: list[int]
    params: bytes
    response: CachedResponse
    nbytes: int


class ResponseCache:
    def __init__(self, budget_nbytes: int):
        self.budget_nbytes = budget_nbytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # digest -> entry, LRU first
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.sampled = 0  # lookups skipped: a sampled request is never answered from memory
        self.stores = 0
        self.evictions = 0
        self.too_big = 0

    @staticmethod
    def _params_key(params: Any, stops: Sequence[str], namespace: Namespace) -> bytes:
        return msgspec.json.encode({"params": params, "stops": list(stops),
                                    "namespace": namespace})

    @staticmethod
    def _digest(prompt_ids: Sequence[int], params_key: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(array("q", prompt_ids).tobytes())
        h.update(params_key)
        return h.digest()

    @staticmethod
    def greedy(params: Any) -> bool:
        return params.temperature == 0 or params.top_k == 1

    def lookup(self, prompt_ids: Sequence[int], params: Any, stops: Sequence[str] = (),
               namespace: Namespace = SHARED) -> CachedResponse | None:
        """The stored response of this exact greedy request in ``namespace``, or None."""
        if not self.greedy(params):
            self.sampled += 1
            return None
        key = self._params_key(params, stops, namespace)
        entry = self._entries.get(self._digest(prompt_ids, key))
        if entry is None or entry.params != key or entry.prompt_ids != list(prompt_ids):
            self.misses += 1
            return None
        self._entries.move_to_end(self._digest(prompt_ids, key))
        self.hits += 1
        return entry.response

    def put(self, prompt_ids: Sequence[int], params: Any, stops: Sequence[str],
            response: CachedResponse, namespace: Namespace = SHARED) -> bool:
        if not self.greedy(params):
            return False
        key = self._params_key(params, stops, namespace)
        nbytes = 8 * (len(prompt_ids) + 2 * len(response.tokens)) + len(key) \
            + response.logprobs_nbytes() + ENTRY_OVERHEAD_NBYTES
        if nbytes > self.budget_nbytes:
            self.too_big += 1
            return False
        digest = self._digest(prompt_ids, key)
        old = self._entries.pop(digest, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self._entries and self.nbytes + nbytes > self.budget_nbytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1
        self._entries[digest] = _Entry(list(prompt_ids), key, response, nbytes)
        self.nbytes += nbytes
        self.stores += 1
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def statistics(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes,
                "budget_bytes": self.budget_nbytes, "hits": self.hits, "misses": self.misses,
                "sampled": self.sampled, "stores": self.stores, "evictions": self.evictions,
                "too_big": self.too_big}

    def check_invariants(self) -> None:
        assert self.nbytes == sum(e.nbytes for e in self._entries.values())
        assert self.nbytes <= self.budget_nbytes
