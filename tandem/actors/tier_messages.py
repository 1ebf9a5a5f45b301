"""The messages of the prefill plan: the tiers' offers, the plan the engine thread executes, the
fences of open write jobs, and what the engine thread tells the tiers (spec: "A request's way").

    engine actor --OfferTiers--> resident, park      (asks; each lends its holdings)
    engine actor: PrefillPlan (built on the loop, handed to the engine thread)
    engine thread --AnchorWritten--> resident         (tells, as the prefill passes grid lines)
    engine actor --GenerationEnded--> resident, park  (tells; the holdings come back)

Ownership: a tier's holdings (its copies and their bookkeeping, tandem/cache/holdings.py) are
lent to the engine from the offer until `GenerationEnded`; meanwhile the tier neither reads nor
evicts them, and answers statistics from what it last saw.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.actors.messages import Message
from tandem.cache.namespace import SHARED
from tandem.cache.holdings import Moves
from tandem.cache.vocabulary import Source


class OfferTiers(Message):
    """Sender: the engine actor, when a job gets the engine. Receiver: the resident and the
    park. Replies `ResidentOffered` / `ParkOffered`. ``rows``: the tokens of the rows in place
    as the last generation left them; ``rows_namespace``: theirs (the park's offer needs it)."""

    request_id: str
    prompt_ids: list[int]
    rows: list[int]
    namespace: str = SHARED
    rows_namespace: str = SHARED
    # Slots (tandem/cache/slots.py), for the resident's placement: every slot's rows in place
    # (empty: one slot, ``rows``), the request's session key, and the parked conversation's
    # slot, where the park's offer resumes the prompt over that slot's rows, and its session.
    slot_rows: list[list[int]] = []
    session: str | None = None
    park_slot: int | None = None
    park_point: int = 0
    park_session: str | None = None
    side: bool = False  # a side request (tandem/server/side.py): placed and kept as slots.py says
    own_slot: bool = False  # a side request placed in its session's slot (idle work)
    # A peek (POST /v1/cache/peek): the offer and the loan as a request's, counted nowhere
    # (no placement, use or loan is counted), given back with a GenerationEnded as ever.
    peek: bool = False


class ResidentOffered(Message):
    """Reply to `OfferTiers` from the resident: where its copies resume the prompt, and its
    holdings, lent until `GenerationEnded` (``decisive``: no other tier may beat the offer)."""

    request_id: str
    start: int
    source: Source
    guest: bool
    shared: int
    continuing: bool
    decisive: bool
    rows_namespace: str
    holdings: Any = None  # tandem.cache.resident.ResidentHoldings, lent
    slot: int = 0  # the slot placed in, whose holdings are lent
    placed: str = "only"  # the placement rule that chose it (tandem.cache.slots.Why)
    guest_ok: bool = True  # False: placed as no guest (it goes on from a guest's prompt)


class ParkOffered(Message):
    """Reply to `OfferTiers` from the park: the pinned head's and the parked session's offers
    (0: none), and its holdings, lent until `GenerationEnded`."""

    request_id: str
    pin_point: int
    park_point: int
    holdings: Any = None  # tandem.cache.resident.ParkHoldings, lent
    park_session: str | None = None  # the parked conversation's session key


class Fence(msgspec.Struct, frozen=True):
    """An open write job over a copy the plan touches (a disk or spill write in flight): the
    engine thread waits for ``done`` before it writes into ``buffer``. ``job_id`` names it in
    the trace."""

    job_id: str
    buffer: str  # the copy's name: "anchor:<line>", "end", "park", ...
    done: Any = None  # a threading.Event the writer sets


class PrefillPlan(Message):
    """Sender: the engine actor, on the loop. Receiver: the engine thread (recorded in the
    trace as ``<engine>.thread``), which executes it and asks nobody.

    Where the prefill resumes and from which tier, the tiers' offers it was decided over, the
    grid lines the resident anchors as the prefill passes them (the buffers are the lent
    holdings'), and the fences of open write jobs (none until a writer exists)."""

    request_id: str
    prompt_tokens: int  # of the served prompt
    start: int
    source: Source
    guest: bool
    shared: int
    continuing: bool
    resident_offer: int  # the resident's start
    pin_offer: int
    park_offer: int
    anchor_lines: list[int]
    # What the resident does to get there (the copy it restores, the leaving conversation's
    # park, the compaction's pin, a guest's stash), decided here over the lent holdings; None
    # when the store's entry serves (the resident adopts the restore instead).
    moves: Moves | None = None
    aligned: str | None = None  # how the client's copy met an end (tandem.cache.endalign)
    # The rows served when the alignment changed them (None: the client's prompt), and the
    # alignment itself (tandem.cache.endalign.Alignment: what the thread reports of it).
    served: list[int] | None = None
    alignment: Any = None
    store_offer: int = 0  # where the store's longest entry resumed (0: none)
    store_entry: Any = None  # the store's entry, lent, when it serves (source "store")
    # The prefix lines the prefill snapshots, each admitted by the store on the loop:
    # "reserved" (cloned at the line and inserted, or cancelled), "held" or "refused".
    store_lines: dict[int, str] = {}
    # The disk tier: the lines whose sections are staged as the prefill passes them, what the
    # prefill writes (tandem.io.admission.DiskPlan) and the offer it resumes from (a
    # tandem.io.tier.DiskOffer: the files above the resident's start; source "disk").
    disk_lines: list[int] = []
    disk_plan: Any = None
    disk_offer: Any = None
    # The session spill's offer it resumes from (a tandem.io.spill.SpillOffer: the entry read
    # over the rows in place; source "spill"), and the RAM resume the resident puts the engine
    # at first (its start and source).
    spill_offer: Any = None
    spill_base: int = 0
    spill_base_source: str = "cold"
    session_put: bool = False  # the store is asked to admit a session snapshot after the decode
    keep_end: bool = False  # the end anchor is kept at the committed tokens (no guest)
    fences: list[Fence] = []
    workspace_nbytes: int = 0  # the prefill's workspace the governor admitted (0: no governor)
    resident: Any = None  # the lent ResidentHoldings
    park: Any = None  # the lent ParkHoldings


class ClearHoldings(Message):
    """Sender: the engine actor (a clear of the caches, while no generation runs). Receiver: a
    tier actor, which drops every copy it holds and answers `HoldingsCleared` (``busy`` when
    its holdings are lent: nothing is dropped)."""


class HoldingsCleared(Message):
    busy: bool = False
    nbytes: int = 0  # the bytes the copies held


class AnchorWritten(Message):
    """Sender: the engine thread, as its prefill writes the anchor at ``line`` into the lent
    holdings. Receiver: the resident (a tell: the thread never waits on it)."""

    request_id: str
    line: int


class GenerationEnded(Message):
    """Sender: the engine actor, once its thread is done with the job. Receiver: the resident
    and the park: what was lent comes back (``holdings``), with the rows in place now (the
    resident checks its invariants over them). ``outcome``: finished, failed, or not_run (the
    plan was refused before the thread ran)."""

    request_id: str
    outcome: str
    rows: list[int]
    holdings: Any = None


class LendSlot(Message):
    """Sender: the engine actor, while no generation runs in ``slot`` (a planned stop writes its
    conversation to the spill; a start reads one back into it). Receiver: the resident, which
    lends that slot's holdings (`SlotLent`) until a `GenerationEnded` of ``request_id``."""

    request_id: str
    slot: int


class SlotLent(Message):
    holdings: Any = None  # tandem.cache.resident.ResidentHoldings, lent; None: lent already


class GetTierStats(Message):
    """Sender: the server (/v1/cache/stats, the console). Replies `TierStats`."""


class TierStats(Message):
    stats: dict[str, Any]
    lent_to: str | None = None  # the request holding the tier's copies now
