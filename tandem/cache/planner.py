"""The prefill planner on the engine thread: which tier a request resumes from, and the copies
taken around its prefill (spec: "A request's way", "After a long generation").

    resume = planner.begin(served, max_tokens, session)  # may raise MemoryRefused
    engine.generate(served, ..., on_chunk=planner.on_chunk, on_prefill=planner.on_prefill,
                    logits=resume.logits)
    planner.finish(served + generated, session)          # or planner.abort() on a failure

Order of preference, each taken only when it starts strictly later than the ones before it: the
resident prefix's offer (anchors, the pinned head, the parked session, the end anchor, the
prompt-end anchor: its own choice), then a state store entry. A guest's request never takes the
store: its restore would write over resident rows no stash protects.

Namespaces (tandem/cache/namespace.py): every offer is asked with the request's namespace, and
each tier offers only copies of that namespace; what the prefill writes (anchors, prefix and
session snapshots, the end) is the request's namespace's.

Around the prefill: the governor makes room for the workspace first (or refuses the request
before anything moved); grid lines go to the resident prefix (anchors) and the store (prefix
snapshots); after the generation the store takes the session snapshot, then the resident prefix
keeps its end anchor (the put runs first, as the spec's SRV-253 order has it).

Pure logic, no asyncio: the engine actor calls it on the engine thread, where every tier lives.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from tandem.cache.governor import MemoryGovernor
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.resident import ResidentPrefix, Resume
from tandem.cache.store import SessionPut, StateStore


class Planner:
    def __init__(self, resident: ResidentPrefix, store: StateStore | None = None,
                 governor: MemoryGovernor | None = None, *, shed_store: bool = True) -> None:
        """``shed_store`` False: the governor's growth gate, which runs on the engine thread
        during a prefill, never sheds the store (shedding it is an ask of the store actor;
        a planned prefill's room was made on the loop, where the store is asked)."""
        self.resident = resident
        self.engine = resident.engine
        self.store = store
        self.governor = governor
        self._prompt_len = 0
        # False while another sequence's prefill is the governor's running one (the engine
        # actor's slots): this one's end leaves the governor's prefill and reserve alone.
        self.governed = True
        # The prefill's rest is a tail in a decode batch whose governor record ended early
        # (settle_early): its chunk's end leaves the governor alone.
        self._settled = False
        if governor is not None:
            shedders = {level: partial(resident.shed, level)
                        for level in ("prompt_end", "anchors", "end", "stash", "park", "pin")}
            if store is not None and shed_store:
                shedders["store"] = store.shed
            governor.attach(resident.memory, shedders, self.engine.cost())

    def begin(self, served: Sequence[int], max_tokens: int, session: str | None,
              namespace: Namespace = SHARED, plan: Any = None) -> Resume:
        """``plan``: the PrefillPlan the loop made (tandem/actors/tier_messages.py), whose
        store entry (lent) and admitted prefix lines are taken as they are: nothing is asked
        of the store here. Without one, the store is asked (the synchronous form)."""
        if self.governor is not None and plan is None:
            # (A plan was admitted on the loop: governor.admit_prefill.)
            self.governor.before_prefill(len(served))  # raises before anything moved
        self._prompt_len = len(served)
        self._settled = False
        if plan is not None:
            if self.store is not None:
                # First: from here a failure's abort gives the admitted rooms back.
                self.store.admitted(plan.store_lines, namespace)
            resume = self._restore_planned(served, max_tokens, session, namespace, plan)
        else:
            resume = self._restore(served, max_tokens, session, namespace)
            if self.store is not None:
                self.store.plan_prefix(served, resume.start, namespace)
        if self.governor is not None and resume.start >= len(served):
            self.governor.after_prefill()  # nothing to forward: no chunk ends this prefill
        return resume

    def _restore_planned(self, served: Sequence[int], max_tokens: int, session: str | None,
                         namespace: Namespace, plan: Any) -> Resume:
        entry = plan.store_entry
        if entry is None:
            return self.resident.begin(served, max_tokens, session, namespace)
        try:
            self.resident.adopt(plan.start, entry.key_ids, entry.taint, session, namespace)
        except BaseException:
            self.store.release(entry)  # the lease goes back whatever happens
            raise
        self.store.restore(entry, served, namespace)  # releases the lease itself
        return Resume(plan.start, "store")

    def _restore(self, served: Sequence[int], max_tokens: int, session: str | None,
                 namespace: Namespace) -> Resume:
        resident, store = self.resident, self.store
        if store is not None:
            offer = resident.offer(served, namespace)
            if not offer.guest:
                start, entry = store.offer(served, namespace)
                if entry is not None and start > offer.start:
                    try:
                        resident.adopt(start, entry.key_ids, entry.taint, session, namespace)
                    except BaseException:
                        store.release(entry)  # the lease goes back whatever happens
                        raise
                    store.restore(entry, served, namespace)  # releases the lease itself
                    return Resume(start, "store")
                if entry is not None:
                    store.release(entry)  # the resident prefix serves it as well or better
        return resident.begin(served, max_tokens, session, namespace)

    def on_chunk(self, end: int) -> None:
        self.resident.on_chunk(end)
        if self.store is not None:
            self.store.on_chunk(end)
        if self.governor is not None and not self._settled:
            self.governor.observe()
            if end >= self._prompt_len:
                self.governor.after_prefill()

    def settle_early(self) -> None:
        """The rest of this prefill is a short tail that runs in the decode batch (a few rows
        over memory the plan backed): the governor's record of it ends here, so that the next
        request's prefill may be admitted while the tail waits for its batch."""
        if self.governor is not None and not self._settled:
            self.governor.after_prefill()
        self._settled = True

    def on_prefill(self, logits) -> None:
        """After the prompt's prefill, before its first decode: the prompt-end anchor."""
        self.resident.on_prefill(logits)

    def finish(self, committed_ids: Sequence[int] | None, session: str | None,
               namespace: Namespace = SHARED) -> None:
        """After the generation: the session snapshot of the committed tokens (None: none is
        taken), then the resident prefix's end."""
        if self.store is not None:
            self.store.end_prefill()
            if committed_ids is not None:
                self.store.put_session(committed_ids, session, namespace)
        self.resident.finish(committed_ids)
        if self.governor is not None and self.governed:
            self.governor.after_prefill()
            self.governor.after_request()

    def ended(self, committed_ids: Sequence[int], session: str | None,
              namespace: Namespace = SHARED, *, session_put: bool = True) -> SessionPut | None:
        """``finish``'s first half for a planned generation, which asks nothing: the prefill's
        unused rooms go back and the session put is prepared (or declined); the loop asks the
        store to admit it, then ``settle`` runs. ``session_put`` False: none is prepared (a
        side request keeps nothing)."""
        if self.store is None:
            return None
        self.store.end_prefill()
        if not session_put:
            return None
        return self.store.session_put(committed_ids, session, namespace)

    def settle(self, put: SessionPut | None, verdict: str,
               committed_ids: Sequence[int] | None) -> None:
        """``finish``'s second half: the session snapshot cloned into the room the store
        reserved (told), then the resident prefix's end (the put first, as SRV-253 has it)."""
        if put is not None:
            self.store.put_admitted(put, verdict)
        self.resident.finish(committed_ids)
        if self.governor is not None and self.governed:
            self.governor.after_prefill()
            self.governor.after_request()

    def abort(self) -> None:
        if self.store is not None:
            self.store.end_prefill()
        self.resident.abort()
        if self.governor is not None and self.governed:
            self.governor.after_prefill()
            self.governor.after_request()

    def check_invariants(self, alone: bool = True) -> None:
        """``alone``: no other sequence's generation runs beside this one (the store's rooms
        are all filled or given back)."""
        self.resident.check_invariants()
        if self.store is not None:
            self.store.check_invariants(alone)
