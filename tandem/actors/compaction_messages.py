"""The messages of a compaction's continuation (spec: "Compaction as a continuation"): the server
asks the engine for the conversation it holds for a session, the engine asks the tiers that own
the copies.

    server --FindSessionRecord--> engine            (asks; replies SessionRecord)
    engine --FindSession--> resident, park          (asks; each replies SessionHeld)

Ownership: nothing is lent. Every reply carries copies of token ids (plain ints), never a
holding; the conversation may have moved on by the time the request built over them runs, which
costs that request its resume, never its correctness (its prompt is only tokens).
"""

from __future__ import annotations

from typing import Literal

from tandem.actors.messages import Message
from tandem.cache.namespace import SHARED

RecordWhere = Literal["slot", "park", "spill"]


class FindSessionRecord(Message):
    """Sender: the server, for a compaction request. Receiver: the engine, which answers
    `SessionRecord`: the session's conversation up to the end anchor of its last generation,
    from an idle slot holding it, else the park, else its session spill entry."""

    session: str  # the hashed session key
    namespace: str = SHARED


class SessionRecord(Message):
    """Reply to `FindSessionRecord`. ``token_ids``: the rows up to the end anchor (empty: no
    record); ``where``: which copy holds them; ``slot``: the slot, for ``slot``."""

    token_ids: list[int] = []
    where: RecordWhere | None = None
    slot: int | None = None


class FindSession(Message):
    """Sender: the engine actor. Receiver: the resident and the park, which answer
    `SessionHeld` from the holdings they have (a slot lent to a running request is skipped: its
    end is moving)."""

    session: str
    namespace: str = SHARED


class SessionHeld(Message):
    """Reply to `FindSession`. The resident: ``slot_ends``, [slot, end anchor's length] of each
    idle slot whose rows are the session's and hold an end anchor. The park: ``park_end``, the
    parked conversation's end anchor (None: the park holds none of this session), ``park_head``,
    the rows it left in place, and ``token_ids``, its rows up to its end (a copy)."""

    slot_ends: list[list[int]] = []
    park_end: int | None = None
    park_head: int = 0
    token_ids: list[int] = []
