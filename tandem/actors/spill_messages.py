"""Messages of the spill writer actor (tandem/actors/spill_writer.py).

The offer is no message: the engine's plan calls ``SessionSpill.offer`` on the loop (it reads
the index under the spill's own lock, beside a save). Saves and restores are messages: the spill
writer owns the instance and runs one save or restore at a time on its own threads.
"""

from __future__ import annotations

from typing import Any, Literal

from tandem.actors.messages import Message

# Why an entry is written: a planned stop's drain, a conversation leaving its slot (the park
# cannot hold it), one parked (the park may give it up), the rows a store restore clears.
SaveReason = Literal["drain", "evict", "park", "store_restore"]


class SpillSave(Message):
    """Sender: the engine actor, on the loop, while the slot is idle and nothing writes its rows
    (before a prefill that overwrites them, or at the drain). Receiver: the spill writer, which
    writes the conversation (``SessionSpill.save``) unless the write guard refuses it (the drain
    is always written; an eviction by the guard's level and ``tokens``). Replies `SpillSaved`
    once the rows are on the disk (or skipped): the sender may then let them be overwritten.

    Ownership: ``state`` (the slot's ``CacheState``), ``anchors`` (line -> SectionsCopy) and
    ``end`` (a tandem.io.spill.SpillEnd) are lent until the reply; ``meta`` is a
    tandem.io.spill.EntryMeta and ``entry_id`` its ``entry_id``."""

    reason: SaveReason
    slot: int
    entry_id: str
    state: Any
    valid: int
    token_ids: list[int]
    anchors: dict[int, Any]
    end: Any
    meta: Any
    # When the conversation was last used (wall seconds; None: now): a parked one written at
    # the drain is older than the slots' in place, and the next start reads the newest first.
    used_at: float | None = None
    # A prewarm's: asked before each file; True stops the save between two files and deletes
    # the entry (its rows are still the slot's), answered with skipped "stopped".
    stop: Any = None
    # The sender keeps the device still for the save (the drain, whose handler holds the
    # engine's mailbox; a prewarm, which holds the capture lock): the writer takes no grant of
    # its own, which would wait behind the sender for ever.
    locked: bool = False


class SpillSaved(Message):
    """Reply to `SpillSave`. ``skipped``: "" written; "guard" the write guard refused it;
    "budget" the entry does not fit the spill's budget; "failed" an I/O error (logged, the
    entry gone); "off": the writer has no spill. ``report``: the SaveReport when written."""

    entry_id: str
    skipped: Literal["", "guard", "budget", "failed", "off", "stopped"]
    report: Any = None
    ms: dict[str, float] = {}


class SpillRestore(Message):
    """Sender: the engine thread (through the loop) or a prewarm, while the slot is lent to the
    sender and nothing else writes it. Receiver: the spill writer, which reads the entry back
    into ``state`` (``SessionSpill.restore``: every block the rows in place do not hold, summed
    again before a row of it is written) and replies `SpillRestored`."""

    entry_id: str
    state: Any
    rows_in_place: list[int]
    line: int | None = None


class SpillRestored(Message):
    """Reply to `SpillRestore`: ``report`` a tandem.io.spill.RestoreReport, or None with
    ``failed`` the refusal (the entry deleted; the rows below ``intact_below`` untouched)."""

    entry_id: str
    report: Any = None
    failed: str = ""
    intact_below: int = 0


class GetSpillStats(Message):
    """Sender: the server (/v1/cache/stats, /metrics, /health, the console). Replies
    `SpillStats`."""


class SpillStats(Message):
    stats: dict[str, Any]


class ClearSpill(Message):
    """Sender: the server (POST /v1/cache/clear?tier=spill|all, admin). Replies `SpillCleared`
    after the save or restore under way."""


class SpillCleared(Message):
    dropped: dict[str, int]  # entries, nbytes


class DrainSpill(Message):
    """Sender: the server at shutdown, after the engine's drain saves. Replies `SpillDrained`
    once every save told before it is on the disk."""


class SpillDrained(Message):
    pass


class SpillWriterFaulted(Message):
    """Sender: the spill writer to itself, when a save, a restore or a sweep raised something
    that is no spill error (a bug); handling it re-raises that, so the supervisor stops the
    system."""

    error: str
