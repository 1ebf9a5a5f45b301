"""The engine actor's side of a compaction's continuation (spec: "Compaction as a continuation"):
the record of a session's conversation, the rows up to the end anchor of its last generation.

A part of ``EngineActor`` (tandem/actors/engine_actor.py), kept apart as the spill's is: it
runs on the loop, in the handler of `FindSessionRecord`, and asks the tiers that own the copies
(`FindSession`); nothing is lent and nothing moves. The places are tried in the order a plan
resumes them cheapest: an idle slot holding the session (the plan extends it in place), the
park (swapped back, when the head it left is still in its slot), the session spill entry (read
back over the rows in place). The server builds its prompt over these tokens; the plan then
finds that copy by the tokens alone, as for any other request.
"""

from __future__ import annotations

from typing import Any

import structlog

from tandem.actors.compaction_messages import (FindSession, FindSessionRecord, SessionHeld,
                                               SessionRecord)
from tandem.actors.runtime import ActorStopped
from tandem.io.spill import entry_id, session_digest

log = structlog.get_logger("tandem.compaction")

FIND_ASK_S = 30.0  # a tier's answer is a scan of its holdings; past this it is stuck


class EngineCompaction:
    """The session record's lookup of the engine actor (a mixin)."""

    async def _session_record(self, msg: FindSessionRecord) -> SessionRecord:
        if self._tiers is None:
            return SessionRecord()  # caches off: nothing is held to continue
        resident, park = self._tiers
        find = FindSession(msg.session, msg.namespace)
        busy = self._busy_slots()
        held = await self._ask_tier(resident, find)
        best: tuple[int, int] | None = None
        for slot, end in (held.slot_ends if held is not None else ()):
            rows = self._slot_rows[slot]
            # The rows the loop last saw in the slot reach its end anchor, and no request is
            # writing over them now.
            if slot not in busy and 0 < end <= len(rows) and (best is None or end > best[1]):
                best = (slot, end)
        if best is not None:
            slot, end = best
            return SessionRecord(list(self._slot_rows[slot][:end]), "slot", slot)
        held = await self._ask_tier(park, find)
        if held is not None and held.park_end is not None and self._park_head_in_place(held):
            return SessionRecord(list(held.token_ids), "park")
        spill = self.spill
        if spill is not None:
            m = spill.entries().get(entry_id(session_digest(msg.session), msg.namespace))
            if m is not None and m.end is not None and 0 < m.end.file.stop <= len(m.token_ids):
                return SessionRecord(list(m.token_ids[:m.end.file.stop]), "spill")
        return SessionRecord()

    def _park_head_in_place(self, held: SessionHeld) -> bool:
        """The park swaps its conversation back only over the head it left in its slot."""
        if held.park_head == 0:
            return True
        slot = self._park_slot
        if slot is None or slot in self._busy_slots():
            return False
        return list(self._slot_rows[slot][:held.park_head]) == held.token_ids[:held.park_head]

    async def _ask_tier(self, tier: Any, msg: FindSession) -> SessionHeld | None:
        try:
            return await tier.ask(msg, FIND_ASK_S, sender=self)
        except (ActorStopped, TimeoutError) as exc:
            log.warning("session_record_unanswered", tier=tier.name, error=type(exc).__name__)
            return None
