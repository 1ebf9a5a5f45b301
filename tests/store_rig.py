"""The planner over a real engine (resident prefix, state store, optional governor), driven as
the engine actor drives it."""

from __future__ import annotations

import torch

from resident_rig import CHUNK, budgets
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED
from tandem.cache.planner import Planner
from tandem.cache.resident import ResidentPrefix, Resume
from tandem.cache.store import StateStore, StoreCore, token_hash
from tandem.engine import Engine, SamplingParams

MiB = 1 << 20


class StoreRig:
    def __init__(self, model, window: int = 2048, *, store_nbytes: int = 64 * MiB,
                 entry_nbytes: int = 16 * MiB, boundaries: int = 1, hash_fn=token_hash,
                 governor=None, session_trim: bool = False, **budget_over):
        self.model = model
        self.engine = Engine(model, window=window, prefix_chunk=CHUNK)
        # No park by default: a parked conversation would offer what the store offers.
        over = {"park": 0, "pin": 0, **budget_over}
        self.memory = MemoryAccountant({**budgets(**over), "store": store_nbytes})
        self.resident = ResidentPrefix(self.engine, self.memory)
        # The core answers directly here; in the server the store actor does (tandem/actors/store.py).
        self.core = StoreCore(self.memory, entry_nbytes=entry_nbytes, hash_fn=hash_fn)
        self.store = StateStore(self.engine, self.core, entry_nbytes=entry_nbytes,
                                boundaries=boundaries, hash_fn=hash_fn,
                                session_trim=session_trim)
        self.planner = Planner(self.resident, self.store, governor)

    def prefill(self, prompt: list[int], session: str | None = None,
                keep_session: bool = False,
                namespace: str = SHARED) -> tuple[Resume, torch.Tensor]:
        """A prefill alone; its state is kept as a session snapshot only when asked."""
        resume = self.planner.begin(prompt, 16, session, namespace)
        logits = self.engine.prefill(prompt, on_chunk=self.planner.on_chunk)
        self.planner.finish(self.engine.token_ids if keep_session else None, session,
                            namespace)
        self.planner.check_invariants()
        return resume, logits

    def turn(self, prompt: list[int], session: str | None = None,
             max_tokens: int = 16, namespace: str = SHARED,
             **generate) -> tuple[Resume, list[int]]:
        """One turn; ``generate`` passes a drafter (draft, draft_max) and stop tokens."""
        stops = tuple(generate.pop("stop_token_ids", ()))
        resume = self.planner.begin(prompt, max_tokens, session, namespace)
        result = self.engine.generate(prompt, SamplingParams(max_tokens=max_tokens,
                                                             stop_token_ids=stops),
                                      on_chunk=self.planner.on_chunk,
                                      on_prefill=self.planner.on_prefill,
                                      logits=resume.logits, **generate)
        self.planner.finish(list(prompt) + result.token_ids, session, namespace)
        self.planner.check_invariants()
        return resume, result.token_ids
