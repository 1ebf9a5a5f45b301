"""The engine actor's side of idle work (issue 17, part 3): the compaction preparer's
continuation runs as a `Generate` with ``idle`` set, and yields to everything else.

A part of ``EngineActor`` (tandem/actors/engine_actor.py), kept apart as engine_spill.py is;
every method runs on the loop.

- Any other `Generate` accepted, and a `Drain`, cancel every idle job at once (``_yield_idle``):
  one waiting fails ``cancelled`` before it runs; one running stops at its next prefill chunk
  (``stop_prefill``, tandem.engine) or decode step. It is a guest, so the slot's rows, anchors
  and end anchor are what they were (the stash puts them back).
- An idle `Generate` is refused while any other job is known or the engine drains: idle work
  never waits in the queue ahead of a request.
- ``last_request_s`` (the actor clock's) is when the last other `Generate` was accepted, and
  ``request_hooks`` are called with it, so the preparer knows when the engine went idle.
- `ListConversations`: each idle slot's conversation up to its end anchor, read from its
  holdings lent for the moment (the resident's `LendSlot`) while nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.actors.engine_messages import (ConversationInPlace, ConversationsListed, Generate,
                                           GenerationRejected)


class EngineIdle:
    """Idle work's methods and state of the engine actor (a mixin: ``EngineActor`` calls
    ``_init_idle`` from its constructor)."""

    def _init_idle(self) -> None:
        self.last_request_s: float | None = None
        self.request_hooks: list[Callable[[Generate], None]] = []
        self.idle_cancelled = 0  # idle jobs a request or a drain cancelled

    def _refuse_idle(self, msg: Generate) -> GenerationRejected | None:
        """An idle Generate that would wait behind (or beside) other work is refused."""
        if msg.idle and (self._jobs or self._draining):
            return GenerationRejected(msg.request_id, "queue_full", 0.0)
        return None

    def _request_came(self, msg: Generate) -> None:
        """On the loop, for each accepted Generate: a request that is not idle work stops
        every idle job, at once."""
        if msg.idle:
            return
        self.last_request_s = self.clock.monotonic()
        self._yield_idle()
        for hook in self.request_hooks:
            hook(msg)

    def _yield_idle(self) -> None:
        for job in [j for j in self._jobs.values() if j.idle]:
            if not job.cancel.is_set():
                self.idle_cancelled += 1
            self._cancel(job.request_id)

    async def _list_conversations(self) -> ConversationsListed:
        if self._tiers is None:
            return ConversationsListed()
        if self._jobs or self._lock.holder is not None:
            return ConversationsListed(busy=True)
        out: list[ConversationInPlace] = []
        for slot in range(self.parallel):
            rows = self._slot_rows[slot]
            if self.engines[slot] is None or not rows:
                continue
            request_id = f"list-conversations-{slot}"
            holdings: Any = await self._lend_slot(request_id, slot)
            if holdings is None:
                continue
            try:
                end = holdings.ends.end
                if end is not None and end.length <= len(rows) and not holdings.stash.active:
                    out.append(ConversationInPlace(slot, holdings.session,
                                                   str(holdings.namespace),
                                                   list(rows[:end.length])))
            finally:
                self._return_slot(request_id, slot, holdings)
        return ConversationsListed(conversations=out)
