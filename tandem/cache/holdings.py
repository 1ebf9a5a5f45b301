"""The tiers' holdings and their offers: what the resident actor and the park actor own, and
the pure functions that say where their copies resume a prompt (spec: "Resident prefix").

Pure data and pure functions, no engine and no asyncio: a tier's actor answers its offer with
these over its own holdings, and the composer (tandem/cache/resident.py) uses the same ones when
it holds the tiers itself, so the two can never decide differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import msgspec
import torch

from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.tiers.anchors import Anchors
from tandem.cache.tiers.ends import Ends
from tandem.cache.tiers.park import Park
from tandem.cache.tiers.pin import Pin
from tandem.cache.tiers.stash import Stash
from tandem.cache.vocabulary import Source, Tier, tier_of
from tandem.models.base import HeadRow
from tandem.tokens import common_prefix


@dataclass(frozen=True)
class Resume:
    """Where a request's prefill starts and what served the rows below it."""

    start: int  # rows in place the prefill resumes at, in the served prompt's positions
    source: Source  # resident-tier sources, or store (the planner's)
    guest: bool = False
    # prompt_end: the prompt's last position's logits, or its HeadRow (a copy the request
    # owns); the engine samples the first token from them and forwards nothing.
    logits: torch.Tensor | HeadRow | None = field(default=None, compare=False, repr=False)

    @property
    def tier(self) -> Tier:
        return tier_of(self.source)


class Moves(msgspec.Struct, frozen=True):
    """What ``begin`` does to serve a request (``ResidentPrefix.moves``, decided before it):

    - ``kind``: ``extend`` the rows in place; ``move`` to an anchor, the end, the prompt end or
      row 0 over them; swap in the ``pin`` or the ``park``; or run a ``guest`` over a stash;
    - ``restore``: the copy written back (``anchor:<line>``, ``end``, ``prompt_end``,
      ``pin:<line>``, ``park:<line>``, ``park:end``; None: none);
    - ``park_above``: the rows in place above this row are parked as the conversation leaves
      (None: they are not; for a park swap, the returning park's head);
    - ``drop_park``: a compaction drops its session's park; ``pin_head``: it pins the old head;
    - ``pin_rows_from``: a pin swap copies the pin's rows back from this row;
    - ``stash_stop``, ``stash_sections``: a guest's stash holds rows [start, stop), and the
      sections too unless the end anchor holds the live state."""

    kind: Literal["extend", "move", "pin", "park", "guest"]
    start: int
    restore: str | None = None
    park_above: int | None = None
    drop_park: bool = False
    pin_head: bool = False
    pin_rows_from: int = 0
    stash_stop: int = 0
    stash_sections: bool = True


@dataclass
class _Hits:
    """The composer's own counters: which offer served each request."""

    hits: int = 0
    cold: int = 0
    end_hits: int = 0
    prompt_end_hits: int = 0


@dataclass
class ResidentHoldings:
    """What the resident actor owns: the anchors, the ends, the stash, and whose the rows in
    place are (their session and namespace), with the counters of which offer served."""

    anchors: Anchors
    ends: Ends
    stash: Stash
    session: str | None = None
    namespace: Namespace = SHARED
    hits: _Hits = field(default_factory=_Hits)
    # The end records (tandem/cache/endrecords.py) beside the ends, when copies are aligned.
    records: object = None

    def clear(self) -> None:
        """Every copy goes and its memory back (a clear of the caches; nothing is lent):
        the anchors, the end and prompt-end anchors with their buffers, the stash, the end
        records, and whose the rows are."""
        self.anchors.drop_above(0)
        self.ends.release_end()
        self.ends.release_prompt_end()
        self.stash.drop()
        if self.records is not None:
            self.records.clear()
        self.session, self.namespace = None, SHARED

    def check_invariants(self, token_ids: list[int]) -> None:
        self.anchors.check_invariants(len(token_ids))
        self.ends.check_invariants(token_ids, self.stash.active)
        self.stash.check_invariants()


@dataclass
class ParkHoldings:
    """What the park actor owns: the pinned head and the parked session."""

    pin: Pin
    park: Park

    def clear(self) -> None:
        """The pinned head and the parked conversation go, and their memory back."""
        self.park.drop()
        self.pin.drop()

    def check_invariants(self) -> None:
        self.pin.check_invariants()
        self.park.check_invariants()


def make_holdings(memory: MemoryAccountant, chunk: int, *, guest_max: int = 8192,
                  keep_newest: int = 4, end_anchor: bool = True, stash_margin: int = 512,
                  pin_every: int = 4, pin_max: int = 8, park_anchors: int = 4,
                  prompt_end_anchor: bool = True,
                  park_memory: MemoryAccountant | None = None
                  ) -> tuple[ResidentHoldings, ParkHoldings]:
    """The five tiers over ``chunk``-row grid lines, their copies held to ``memory`` (the pin's
    and the park's to ``park_memory`` when the park keeps its own accounts)."""
    parks = memory if park_memory is None else park_memory
    return (ResidentHoldings(
        Anchors(memory, chunk=chunk, keep_newest=keep_newest, pin_every=pin_every,
                pin_max=pin_max),
        Ends(memory, end_anchor=end_anchor, prompt_end_anchor=prompt_end_anchor),
        Stash(memory, guest_max=guest_max, stash_margin=stash_margin)),
        ParkHoldings(Pin(parks, chunk=chunk, pin_every=pin_every, pin_max=pin_max),
                     Park(parks, park_anchors=park_anchors)))


# -- the tiers' offers, as their actors make them ------------------------------------------


@dataclass(frozen=True)
class ResidentOffer:
    """The resident's offer for a prompt: ``decisive`` when no other tier may beat it (the
    same prompt again, or a guest)."""

    resume: Resume
    shared: int  # rows in place the prompt shares (0 for another namespace's)
    continuing: bool  # the prompt extends the rows in place
    decisive: bool


@dataclass(frozen=True)
class ParkOffer:
    pin_point: int
    park_point: int


@dataclass(frozen=True)
class Decided:
    """A request's resume, decided over the tiers' offers (the plan's)."""

    resume: Resume
    shared: int
    continuing: bool
    moves: Moves | None = None  # decided with it (None: begin decides them)


def resident_offer(held: ResidentHoldings, prompt: Sequence[int], namespace: Namespace,
                   rows: Sequence[int], *, side: bool = False,
                   guest_ok: bool = True) -> ResidentOffer:
    """Where the resident's own copies resume ``prompt`` over the rows in place ``rows``.
    ``guest_ok`` False: a short prompt is no guest over those rows, it replaces them (a
    conversation that goes on from an earlier guest, tandem/cache/slots.py).
    ``side``: a side request (tandem/server/side.py) is a guest whatever its length, and
    keeps nothing: not even a repeat's prompt-end anchor serves it, since that move would
    drop the end anchor above it. One that goes on from the rows in place at their end
    anchor (the compaction preparer's continuation) resumes there as a guest: the live state
    is the end's, and the stash puts the end's sections back after it."""
    prompt = list(prompt)
    length = len(rows)
    limit = len(prompt) - 1  # at least one token is forwarded: the logits come from it
    # Another namespace's rows share nothing with the prompt, so no extension, end anchor or
    # anchor of theirs is offered.
    c = common_prefix(prompt, list(rows)) if namespace == held.namespace else 0
    continuing = c >= length and length <= limit
    if side:
        if continuing and length and held.ends.at(length) and not held.stash.active:
            return ResidentOffer(Resume(length, "end", guest=True), c, continuing, True)
        start = held.anchors.best(min(c, limit))
        return ResidentOffer(Resume(start, "resident" if start else "cold", guest=True), c,
                             continuing, True)
    pe = held.ends.prompt_end
    if (pe is not None and len(prompt) == pe.length <= c and not held.stash.active
            and prompt == pe.token_ids):
        # The same prompt again (a regenerate, a retry): nothing to forward, and no other
        # offer reaches past ``limit``. Before the guest test: a repeat is no guest.
        return ResidentOffer(Resume(pe.length, "prompt_end"), c, continuing, True)
    if guest_ok and not continuing and held.stash.is_guest(len(prompt), length):
        start = held.anchors.best(min(c, limit))
        return ResidentOffer(Resume(start, "resident" if start else "cold", guest=True), c,
                             continuing, True)
    # Candidates in the rows in place: the live state (extension), the end anchor, anchors.
    best = Resume(0, "cold")
    end = held.ends.end
    if continuing and length:
        best = Resume(length, "end" if held.ends.at(length) else "resident")
    else:
        if end is not None and end.length <= min(c, limit):
            best = Resume(end.length, "end")
        line = held.anchors.best(min(c, limit))
        if line > best.start:
            best = Resume(line, "resident")
        # A prompt that goes on from the last prompt and some of its answer, but not all of
        # it: a copy of an answer the client stopped (the rows hold tokens decoded after its
        # last chunk) or edited. The state that prompt's prefill left is in place under the
        # answer's rows; what is forwarded from it, off the grid, holds the greedy gate, as a
        # resume at the end anchor does. A prompt that parts right at the last prompt's end
        # shares no decoded row and resumes on the grid, bit for bit.
        if pe is not None and best.start < pe.length < c and not held.stash.active:
            best = Resume(pe.length, "prompt_end")
    return ResidentOffer(best, c, continuing, False)


def park_offer(held: ParkHoldings, prompt: Sequence[int], namespace: Namespace,
               rows: Sequence[int], rows_namespace: Namespace) -> ParkOffer:
    """Where the pinned head and the parked session resume ``prompt``."""
    limit = len(prompt) - 1
    return ParkOffer(held.pin.offer(list(prompt), limit, namespace),
                     held.park.offer(rows, rows_namespace, prompt, limit, namespace))


def choose(mine: ResidentOffer, theirs: ParkOffer) -> Resume:
    """The resident's offer unless the pin or the park starts strictly later (the pin first
    when both reach as far)."""
    if mine.decisive:
        return mine.resume
    best = mine.resume
    if theirs.pin_point > best.start and theirs.pin_point >= theirs.park_point:
        return Resume(theirs.pin_point, "pin")
    if theirs.park_point > best.start:
        return Resume(theirs.park_point, "park")
    return best


def resident_statistics(held: ResidentHoldings) -> dict:
    """What the resident holds, for its actor's report."""
    a, e, g = held.anchors, held.ends, held.stash
    return {"anchors": a.lines(), "anchors_taken": a.taken, "evictions": a.evictions,
            "end": e.end.length if e.end else None,
            "prompt_end": e.prompt_end.length if e.prompt_end else None,
            "stash": g.stashed is not None, "guests": g.guests,
            "held_bytes": {level: a.memory.held[level]
                           for level in ("anchors", "end", "prompt_end", "stash")}}


def park_statistics(held: ParkHoldings) -> dict:
    """What the park holds, for its actor's report."""
    pin, park = held.pin.pinned, held.park.parked
    return {"pinned": len(pin.token_ids) if pin else None,
            "parked": ({"head": park.head, "rows": len(park.token_ids)} if park else None),
            "pins": held.pin.pins, "parks": held.park.parks,
            "held_bytes": {level: held.pin.memory.held[level] for level in ("pin", "park")}}
