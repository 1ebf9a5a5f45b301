"""The resident prefix: grid anchors, the end anchor, the guest stash, the pinned head and the
parked session, over the engine's one sequence (spec: "Resident prefix", "After a long
generation", "A guest keeps no end anchor").

The composer of five pure cores, one a tier (tandem/cache/tiers: anchors, ends, stash, pin,
park), each holding its copies and checking its own invariants; here the tiers' offers are
compared and the copies moved between them and the engine. Pure logic, no asyncio and no
clock: the engine actor calls ``begin`` before a generation (it restores state and puts the
engine where the prefill resumes), ``on_chunk`` after each prefill chunk, and ``finish`` after
the generation. Every copy goes through the adapter's ``cache_state()`` and is reserved with the
memory accountant at its level before it is made. The engine's taint changes only through
``resume_at(n, taint=...)``.

Exactness: a resume at a grid anchor at or below ``taint`` is a cold grid prefill's, bit for bit;
a resume at the end anchor (or an anchor above taint) holds the greedy gate. The prompt-end
anchor is the state its prompt's prefill left, copied before the first decode, with the last
position's logits: the same prompt again forwards nothing and is that prefill's, bit for bit
(when no row under it was decoded: otherwise the greedy gate of the run that wrote them).

Namespaces (tandem/cache/namespace.py): the rows in place, and with them the anchors, the end
anchor and the stash, belong to ``namespace``, set by the request whose prefill writes them; the
pin and the park record theirs. A request of another namespace is offered none of them (it
shares no row with the rows in place, whatever their tokens), so it starts cold and the rows in
place are parked as another session's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import structlog
import torch

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.keep import End, Parked, Pinned, make_park, pin_lines, plan_park, take_pin
from tandem.cache.memory import PARK_LEVELS, Accounts, MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.holdings import (Decided, Moves, ParkHoldings, ParkOffer, ResidentHoldings,
                                   ResidentOffer, Resume, _Hits, choose, make_holdings,
                                   park_offer, park_statistics, resident_offer,
                                   resident_statistics)
from tandem.cache.tiers.anchors import Anchors
from tandem.cache.tiers.ends import Ends, PromptEnd
from tandem.cache.tiers.park import Park
from tandem.cache.tiers.pin import Pin
from tandem.cache.tiers.stash import Stash, Stashed
from tandem.models.base import CacheState, HeadRow
from tandem.tokens import common_prefix

# The holdings and offers are defined in tandem/cache/holdings.py; named here too, the
# composer's vocabulary.
__all__ = ["Decided", "Moves", "ParkHoldings", "ParkOffer", "PromptEnd", "ResidentHoldings",
           "ResidentOffer", "ResidentPrefix", "ResidentStats", "Resume", "SequenceEngine",
           "TiersLent", "choose", "make_holdings", "park_offer", "park_statistics",
           "resident_offer", "resident_statistics"]

log = structlog.get_logger()


class SequenceEngine(Protocol):
    """What the resident prefix needs of the engine (tandem.engine.Engine)."""

    token_ids: list[int]
    taint: int | None
    prefix_chunk: int
    window: int

    @property
    def length(self) -> int: ...

    def cache_state(self) -> CacheState: ...

    def settle(self) -> None: ...

    def resume_at(self, n: int, token_ids: Sequence[int] | None = None, *,
                  taint: object = ...) -> None: ...

    def trim_pending(self, n: int) -> bool: ...


# The keys of ``statistics`` that are the pin's and the park's.
PARK_STATS = ("pinned", "pinned_anchors", "pins", "pin_hits", "pin_bytes", "parked", "parks",
              "park_hits", "park_bytes")


@dataclass
class ResidentStats:
    anchors_taken: int = 0
    anchor_evictions: int = 0
    hits: int = 0
    cold: int = 0
    guests: int = 0
    guest_refused: int = 0
    pins: int = 0
    pin_hits: int = 0
    parks: int = 0
    park_hits: int = 0
    ends: int = 0
    end_hits: int = 0
    end_absorbed: int = 0  # ends not kept: the state had absorbed uncommitted tokens
    prompt_ends: int = 0
    prompt_end_hits: int = 0


class TiersLent(RuntimeError):
    """The composer was used while the tiers were with their actors."""


class ResidentPrefix:
    """The composer. Built with its own tiers (``ResidentPrefix(engine, memory, ...)``: the
    synchronous form the cache tests drive), or with none (``ResidentPrefix.lent_to(engine,
    memory)``): the resident and park actors then lend theirs for each generation (``lend``)
    and take them back after it (``give_back``)."""

    _restoring: Resume | None = None  # the resume begin restores, kept from the sheds meanwhile

    def __init__(self, engine: SequenceEngine, memory: MemoryAccountant, **knobs):
        self.engine = engine
        self.memory = memory
        self.chunk = engine.prefix_chunk
        self._tiers, self._park_tiers = make_holdings(memory, self.chunk, **knobs)
        self._decided: tuple[list[int], Decided] | None = None
        self._lent_form = False

    @classmethod
    def lent_to(cls, engine: SequenceEngine, memory: MemoryAccountant) -> "ResidentPrefix":
        composer = cls.__new__(cls)
        composer.engine = engine
        composer.memory = memory
        composer.chunk = engine.prefix_chunk
        composer._tiers = composer._park_tiers = None
        composer._decided = None
        composer._lent_form = True
        return composer

    def lend(self, resident: ResidentHoldings, park: ParkHoldings) -> None:
        """The tiers, lent by their actors for one generation."""
        assert resident.anchors.chunk == self.chunk, "tiers of another grid"
        self._tiers, self._park_tiers = resident, park
        if self._lent_form:
            # Each slot's tiers count their own part of the resident budget
            # (tandem.cache.memory.Share): the composer reserves through the lent slot's.
            mine, parks = resident.anchors.memory, park.park.memory
            self.memory = mine if mine is parks else Accounts(mine, parks)
        if resident.records is not None:
            resident.records.resident = self  # the records follow the ends they are lent with

    def give_back(self) -> tuple[ResidentHoldings, ParkHoldings]:
        lent = self._tiers, self._park_tiers
        if self._tiers is not None and self._tiers.records is not None:
            self._tiers.records.resident = None
        self._tiers = self._park_tiers = None
        self._decided = None  # made over the holdings leaving
        return lent

    def give_back_park(self) -> ParkHoldings:
        """The pin and the park go back before the generation ends (the engine actor's, once
        the prompt's restore is done: nothing after it touches them, and the next request's
        plan borrows them while this one decodes)."""
        lent, self._park_tiers = self._park_tiers, None
        if lent is None:
            raise TiersLent("the pin and the park were not lent")
        if self._lent_form:
            self.memory = self._tiers.anchors.memory  # the park's accountant is its own again
        return lent

    @property
    def holds_park(self) -> bool:
        return self._park_tiers is not None

    @property
    def holdings(self) -> ResidentHoldings:
        if self._tiers is None:
            raise TiersLent("the resident tiers are with the resident actor")
        return self._tiers

    @property
    def park_holdings(self) -> ParkHoldings:
        if self._park_tiers is None:
            raise TiersLent("the pin and the park are with the park actor")
        return self._park_tiers

    @property
    def anchor_tier(self) -> Anchors:
        return self.holdings.anchors

    @property
    def ends(self) -> Ends:
        return self.holdings.ends

    @property
    def stash_tier(self) -> Stash:
        return self.holdings.stash

    @property
    def pin_tier(self) -> Pin:
        return self.park_holdings.pin

    @property
    def park_tier(self) -> Park:
        return self.park_holdings.park

    @property
    def session(self) -> str | None:
        return self.holdings.session

    @session.setter
    def session(self, value: str | None) -> None:
        self.holdings.session = value

    @property
    def namespace(self) -> Namespace:
        return self.holdings.namespace

    @namespace.setter
    def namespace(self, value: Namespace) -> None:
        self.holdings.namespace = value

    @property
    def _hits(self) -> _Hits:
        return self.holdings.hits

    # -- the tiers' holdings, by name ------------------------------------------------------

    @property
    def anchors(self) -> dict[int, SectionsCopy]:
        return self.anchor_tier.copies

    @property
    def end(self) -> End | None:
        return self.ends.end

    @property
    def prompt_end(self) -> PromptEnd | None:
        return self.ends.prompt_end

    @property
    def pinned(self) -> Pinned | None:
        return self.pin_tier.pinned

    @property
    def parked(self) -> Parked | None:
        return self.park_tier.parked

    @property
    def stash(self) -> Stashed | None:
        return self.stash_tier.stashed

    @property
    def end_anchor(self) -> bool:
        return self.ends.end_anchor

    @end_anchor.setter
    def end_anchor(self, on: bool) -> None:
        self.ends.end_anchor = on

    @property
    def stats(self) -> ResidentStats:
        a, e, g, h = self.anchor_tier, self.ends, self.stash_tier, self._hits
        return ResidentStats(
            anchors_taken=a.taken, anchor_evictions=a.evictions, hits=h.hits, cold=h.cold,
            guests=g.guests, guest_refused=g.refused,
            **({} if self._park_tiers is None else dict(
                pins=self.pin_tier.pins, pin_hits=self.pin_tier.hits,
                parks=self.park_tier.parks, park_hits=self.park_tier.hits)),
            ends=e.kept, end_hits=h.end_hits,
            end_absorbed=e.absorbed, prompt_ends=e.prompt_kept,
            prompt_end_hits=h.prompt_end_hits)

    # -- the request's way -----------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], max_tokens: int,
              session: str | None = None, namespace: Namespace = SHARED) -> Resume:
        """Restore what serves ``prompt_ids`` best and put the engine there."""
        eng = self.engine
        prompt = list(prompt_ids)
        decided, self._decided = self._decided, None
        moves = None
        if decided is not None and decided[0] == prompt:
            plan = decided[1]
            offer, c, continuing, moves = plan.resume, plan.shared, plan.continuing, plan.moves
        else:
            offer, c, continuing = self._plan(prompt, namespace)
        if moves is None:
            moves = self.moves(prompt, max_tokens, session, namespace, offer, c, continuing,
                               eng.token_ids, eng.taint)
        else:
            # Decided on the loop over the rows it was handed: they must be the rows here.
            assert c == (common_prefix(prompt, eng.token_ids)
                         if namespace == self.namespace else 0), "moves over other rows"
        if moves.kind == "guest":
            return self._begin_guest(prompt, moves, namespace)
        if moves.kind == "pin":
            return self._swap_in_pin(prompt, moves, session, namespace)
        if moves.kind == "park":
            return self._swap_in_park(prompt, offer.start, session, namespace)
        best = offer
        # The copy the move restores stays while the park and the pin reserve their room:
        # a reserve sheds cheaper levels (the prompt-end, the anchors, the end) of these very
        # holdings, and a fuzzed memory ceiling shed the prompt-end under its own restore.
        self._restoring = best
        try:
            if moves.drop_park:
                self.park_tier.drop()
            if moves.park_above is not None:
                self._park_current(moves.park_above)
            if moves.pin_head:
                self._pin_head()
        finally:
            self._restoring = None
        if moves.kind == "move":
            self._move_to(best)
        self.session = session
        self.namespace = namespace
        self._count(best)
        if best.source == "prompt_end" and best.start == len(prompt):
            # the same prompt: its last position's logits, nothing forwarded
            return Resume(best.start, best.source, logits=self.prompt_end.logits.clone())
        return best

    def moves(self, prompt: list[int], max_tokens: int, session: str | None,
              namespace: Namespace, offer: Resume, c: int, continuing: bool,
              rows: Sequence[int], taint: int | None) -> Moves:
        """What ``begin`` does to serve ``offer`` over the rows in place ``rows`` (their
        ``taint``): pure, so that the loop decides it over lent tiers (the plan's) and the
        engine thread only carries it out."""
        length = len(rows)
        if offer.guest and offer.source == "end":
            # At the end in place (a side request going on from it): nothing to restore or
            # stash but the sections, which the end anchor holds.
            return Moves("guest", offer.start, stash_stop=offer.start, stash_sections=False)
        if offer.guest:
            start = self.anchor_tier.best(min(c, len(prompt) - 1))
            return Moves("guest", start, restore=f"anchor:{start}" if start else None,
                         stash_stop=self.stash_tier.stop(length, len(prompt), max_tokens),
                         stash_sections=not self.ends.at(length))
        other = self._other_session(session, namespace)
        if offer.source == "pin":
            # Rows both prompts share stay; the rest of the head is copied back. Rows in
            # place from taint on (decoded, or after an off-grid resume), and those of a
            # partial chunk, are not the pin's cold rows though their tokens are: the pin's
            # copies come back from the grid line under them.
            pin = self.pinned
            shared = min(common_prefix(pin.token_ids, list(rows))
                         if namespace == self.namespace else 0,
                         offer.start, offer.start if taint is None else taint)
            return Moves("pin", offer.start, restore=f"pin:{offer.start}",
                         park_above=self.anchor_tier.best(c) if other and length > c else None,
                         pin_rows_from=shared - shared % self.chunk)
        if offer.source == "park":
            park = self.parked
            at_end = park.end is not None and park.end.length == offer.start
            return Moves("park", offer.start,
                         restore="park:end" if at_end else f"park:{offer.start}",
                         park_above=park.head)
        if continuing:
            return Moves("extend", offer.start)
        # A request too long to be a guest that shares nothing is a compaction: its session's
        # park is history it replaces, and the old prompt's head is pinned.
        compaction = (namespace == self.namespace and c < self.chunk
                      and length >= self.chunk and offer.source != "prompt_end")
        drop_park = compaction and self.park_tier.holds_session(session, namespace)
        if offer.source == "prompt_end" and c > offer.start:
            # It goes on from part of the answer (a stopped stream's copy): the same
            # conversation, whose rows past that part nobody was shown. Nothing to park.
            other = False
        park_above = offer.start if other and length > offer.start else None
        pin = self.pin_tier
        pin_head = (park_above is None and compaction
                    and bool(pin_lines(self.anchors, chunk=self.chunk, pin_every=pin.pin_every,
                                       pin_max=pin.pin_max))
                    and not pin.covers(rows, self.namespace))
        restore = {"prompt_end": "prompt_end", "end": "end"}.get(
            offer.source, f"anchor:{offer.start}" if offer.start else None)
        if offer.start == length and offer.source != "prompt_end":
            restore = None  # the rows in place end there: nothing to write back
        return Moves("move", offer.start, restore=restore, drop_park=drop_park,
                     park_above=park_above, pin_head=pin_head)

    def offer(self, prompt_ids: Sequence[int], namespace: Namespace = SHARED) -> Resume:
        """Where ``begin`` would resume this prompt, with no side effect: the planner compares
        it with the other tiers' offers (a guest's start assumes its stash is granted)."""
        return self._plan(list(prompt_ids), namespace)[0]

    def _plan(self, prompt: list[int], namespace: Namespace) -> tuple[Resume, int, bool]:
        """The best resume for ``prompt``, the tokens it shares with the rows in place, and
        whether it continues them: the resident's offer, then the park's, compared."""
        rows = self.engine.token_ids
        mine = resident_offer(self.holdings, prompt, namespace, rows)
        if mine.decisive:
            return mine.resume, mine.shared, mine.continuing
        theirs = park_offer(self.park_holdings, prompt, namespace, rows, self.namespace)
        return choose(mine, theirs), mine.shared, mine.continuing

    def decided(self, prompt_ids: Sequence[int], plan: "Decided") -> None:
        """The next ``begin`` of ``prompt_ids`` takes ``plan`` (made on the loop over these very
        tiers, for this prompt) instead of comparing the offers again."""
        self._decided = (list(prompt_ids), plan)

    def _shared_rows(self, prompt: Sequence[int], namespace: Namespace) -> int:
        """The rows in place a request of ``namespace`` shares with ``prompt``: every comparison
        of the rows in place with a request's tokens goes through here."""
        if namespace != self.namespace:
            return 0
        return common_prefix(prompt, self.engine.token_ids)

    def adopt(self, n: int, token_ids: Sequence[int], taint: int | None = None,
              session: str | None = None, namespace: Namespace = SHARED) -> None:
        """An outside restore (the state store) is about to replace the rows in place with
        ``token_ids[:n]`` (rows above ``taint`` written by decoding). Called before the restore,
        while the old rows are still there: anchors stay only up to the rows both share, and
        no higher than either side's taint, since an anchor over decoded rows would otherwise
        pass for a cold prefill's; the end anchor goes with its rows. Another session's rows
        above them are parked first, as a prefill that writes over them would park them."""
        eng = self.engine
        keep = self._shared_rows(list(token_ids[:n]), namespace)
        for t in (eng.taint, taint):
            if t is not None:
                keep = min(keep, t)
        if self._other_session(session, namespace) and eng.length > keep:
            self._park_current(keep)
        self.anchors_drop_above(keep)
        # The restore writes every row under n: the prompt-end anchor's rows come back as the
        # copy's, the same tokens but not always the same bits (its prompt's last chunk was
        # partial here, and the copy's rows may follow an off-grid resume).
        self.ends.prompt_end = None
        self.ends.drop_end()
        self.session = session
        self.namespace = namespace

    def shed(self, level: str, need_nbytes: int) -> int:
        """The memory governor's call, on the engine thread between chunks or before a
        prefill: give back copies at ``level`` until ``need_nbytes`` are freed; the bytes
        freed. Anchors go cheapest loss first; the end, stash, park and pin go whole."""
        if level in PARK_LEVELS and self._park_tiers is None:
            return 0  # the park actor has them back; nobody sheds them here
        before = self.memory.held[level]
        restoring = self._restoring
        if restoring is not None and (level, restoring.source) in (("prompt_end", "prompt_end"),
                                                                   ("end", "end")):
            return 0  # the copy begin is about to restore
        if level == "anchors":
            self.anchor_tier.shed(need_nbytes, protect=(
                restoring.start if restoring is not None and restoring.source == "resident"
                else -1))
        elif level == "end":
            if self.stash is not None and self.stash.sections is None:
                self._drop_stash()  # it would restore its sections from the end anchor
            self.ends.release_end()
        elif level == "stash":
            self._drop_stash()
        elif level == "park":
            self.park_tier.drop()
        elif level == "pin":
            self.pin_tier.drop()
        elif level == "prompt_end":
            self.ends.release_prompt_end()
        return before - self.memory.held[level]

    def _drop_stash(self) -> None:
        """The guest keeps its rows and the resident rows it wrote over are lost: everything
        above the guest's start goes (its rows are the guest's now)."""
        guest = self.stash_tier
        if guest.stashed is None:
            return
        guest.drop()
        self.anchors_drop_above(self.engine.length if not guest.active else guest.start)
        self.ends.drop_end()
        if guest.active:
            self.namespace = guest.namespace

    def on_chunk(self, end: int) -> None:
        """After a prefill chunk: an anchor at every grid line the prefill passes."""
        if self.stash_tier.active or end % self.chunk:
            return
        self.anchor_tier.take(end, self.engine.cache_state())

    def on_prefill(self, logits: torch.Tensor | HeadRow) -> None:
        """After a prompt's prefill, before its first decode (nothing is pending): the
        prompt-end anchor, the sections and ``logits`` (the last position's), in the buffers
        of the last one. A guest keeps none: its rows go back after it."""
        if self.stash_tier.active or not self.ends.prompt_end_anchor:
            return
        eng = self.engine
        self.ends.keep_prompt_end(eng.token_ids, eng.cache_state(), logits)

    def finish(self, committed_ids: Sequence[int] | None = None) -> None:
        """After a generation: a guest's rows go back; otherwise the end anchor is kept, at the
        committed tokens when they are given."""
        if self.stash_tier.active:
            self._restore_stash()
            return
        if self.end_anchor:
            self.keep_end(committed_ids)

    def abort(self) -> None:
        """A generation that failed mid-way. The live state is not trusted (a forward may have
        stopped part way through writing it), the copies are: a guest's stash puts the
        resident rows back; otherwise the engine is cut back to its highest anchor (each was
        taken after a chunk that completed; one a failure interrupted is dropped first), and
        the anchors above it, the end and any stash go. Rows below the anchor were written by
        forwards that completed, so that resume is the one a later request would have made."""
        if self.stash_tier.active:
            self._restore_stash()
            return
        self.anchor_tier.drop_interrupted()
        self.stash_tier.drop()  # a guest that never began
        eng = self.engine
        line = self.anchor_tier.best(eng.length)
        self.anchors_drop_above(line)
        self.ends.drop_end()
        if line:
            self.anchors[line].restore(eng.cache_state())
        eng.resume_at(line)

    def keep_end(self, committed_ids: Sequence[int] | None = None) -> None:
        """The state at the last row forwarded, as the end anchor. A generation that stopped
        inside an accepted verify block has rows past its committed tokens: the pending commit
        is cut back to them first, and when the state already absorbed them no end is kept
        (a copy of it would answer for tokens the client never saw)."""
        eng = self.engine
        if committed_ids is not None:
            keep = common_prefix(eng.token_ids, list(committed_ids))
            if keep < eng.length and not eng.trim_pending(keep):
                self.ends.drop_end()
                self.ends.absorbed += 1
                log.info("end_anchor_absorbed", rows=eng.length, committed=keep)
                return
        eng.settle()
        self.ends.keep(eng.length, eng.cache_state())

    # -- guests ----------------------------------------------------------------------------

    def _begin_guest(self, prompt: list[int], moves: Moves, namespace: Namespace) -> Resume:
        eng = self.engine
        state = eng.cache_state()
        start, stop = moves.start, moves.stash_stop
        live_in_end = not moves.stash_sections
        at_end = start > 0 and moves.restore is None  # the live state is the end's
        nbytes = RowsCopy.nbytes_of(state, max(stop - start, 0))
        if not live_in_end:
            nbytes += SectionsCopy.nbytes_of(state)
        resume = Resume(start, "end" if at_end else "resident" if start else "cold",
                        guest=True)
        if stop > start and not self.memory.reserve("stash", nbytes):
            # No room: the guest writes over the resident rows, which are cut at its start.
            self.stash_tier.refused += 1
            log.info("guest_stash_refused", nbytes=nbytes)
            self._move_to(resume)
            self.namespace = namespace
            self._count(resume)
            return resume
        self.stash_tier.put(Stashed(
            rows=RowsCopy.take(state, start, max(stop, start)),
            sections=None if live_in_end else SectionsCopy.take(state),
            token_ids=list(eng.token_ids), taint=eng.taint,
            nbytes=nbytes if stop > start else 0))
        if start and not at_end:
            self.anchors[start].restore(state)
        eng.resume_at(start)
        self.stash_tier.begin(start, namespace)
        return resume

    def _restore_stash(self) -> None:
        eng = self.engine
        end_copy = self.end.copy if self.end is not None else None
        stash = self.stash_tier.take_back()
        if stash is None:
            return
        state = eng.cache_state()
        stash.rows.restore(state)
        (stash.sections or end_copy).restore(state)
        eng.resume_at(len(stash.token_ids), stash.token_ids, taint=stash.taint)

    # -- anchors ---------------------------------------------------------------------------

    def anchors_drop_above(self, line: int) -> None:
        """Rows above ``line`` are about to be written over: no copy of a state above it
        stays (the prompt-end anchor included; its buffers are kept for the next prompt)."""
        self.anchor_tier.drop_above(line)
        if self.prompt_end is not None and self.prompt_end.length > line:
            self.ends.prompt_end = None

    def _move_to(self, resume: Resume) -> None:
        """Put the engine at ``resume.start`` over the rows in place, restoring the copy there;
        everything above it is about to be written over."""
        eng = self.engine
        state = eng.cache_state()
        n = resume.start
        if resume.source == "prompt_end":
            # Restored even when the rows already end there: the copy is the prefill's state.
            eng.resume_at(n)
            self.prompt_end.copy.restore(state)
        elif n != eng.length:
            if resume.source == "end":
                self.end.copy.restore(state)
            elif n:
                self.anchors[n].restore(state)
            eng.resume_at(n)
        self.anchors_drop_above(n)
        if self.end is not None and self.end.length > n:
            self.ends.drop_end()

    def _count(self, resume: Resume) -> None:
        h = self._hits
        if resume.source == "end":
            h.end_hits += 1
        elif resume.source == "resident":
            h.hits += 1
        elif resume.source == "cold":
            h.cold += 1
        elif resume.source == "prompt_end":
            h.prompt_end_hits += 1

    def _other_session(self, session: str | None, namespace: Namespace) -> bool:
        if namespace != self.namespace:
            return True  # another tenant's rows are never this conversation's
        if session is not None and self.session is not None:
            return session != self.session
        # Without a session key on both sides, a prompt that parts from the rows in place
        # counts as another session.
        return True

    # -- the pinned head -------------------------------------------------------------------

    def _pin_head(self) -> None:
        eng = self.engine
        pin = self.pin_tier
        if not pin_lines(self.anchors, chunk=self.chunk, pin_every=pin.pin_every,
                         pin_max=pin.pin_max):
            return
        # The head already pinned is kept when the rows in place share it whole.
        if pin.covers(eng.token_ids, self.namespace):
            return
        pin.drop()
        pinned = take_pin(eng.cache_state(), eng.token_ids, eng.taint, self.anchors, self.memory,
                          chunk=self.chunk, pin_every=pin.pin_every, pin_max=pin.pin_max,
                          namespace=self.namespace)
        if pinned is None:
            return
        pin.put(pinned)
        log.info("head_pinned", rows=len(pinned.token_ids), anchors=len(pinned.anchors),
                 nbytes=pinned.nbytes)

    def _swap_in_pin(self, prompt: list[int], moves: Moves, session: str | None,
                     namespace: Namespace) -> Resume:
        eng, pin = self.engine, self.pinned
        state = eng.cache_state()
        line = moves.start
        if moves.park_above is not None:
            self._park_current(moves.park_above)
        shared = moves.pin_rows_from
        # Set before the first write: a restore that fails half way leaves no copy of one
        # namespace's rows under another's name (abort cuts back to its anchors).
        self.namespace = namespace
        self.anchors_drop_above(shared)
        self.ends.drop_end()
        pin.rows.restore(state, shared, line)
        pin.anchors[line].restore(state)
        eng.resume_at(line, pin.token_ids, taint=pin.taint)
        for at, copy in pin.anchors.items():
            if shared < at <= line:
                self.anchor_tier.add(at, copy, clone=True)
        self.session = session
        self.pin_tier.hits += 1
        return Resume(line, "pin")

    # -- the parked session ----------------------------------------------------------------

    def _park_current(self, head: int) -> None:
        """Park the rows in place above ``head`` (about to be written over) with the newest
        anchors and, when the rows up to it fit, the end anchor."""
        self.park_tier.drop()  # one parked session; a third one's park goes
        self._park(self.engine.cache_state(), head)

    def _park(self, state: CacheState, head: int, reuse: RowsCopy | None = None) -> int:
        """Park the rows above ``head``; with ``reuse`` (the rows of the park coming back) in
        place when they fit its buffer. Returns the row up to which the rows in place were
        swapped with ``reuse``'s (``head`` when they were not)."""
        eng = self.engine
        plan = plan_park(state, head, self.anchors, self.end, self.memory.room("park"),
                         park_anchors=self.park_tier.park_anchors, reuse=reuse)
        if plan is None or not self.memory.reserve("park", plan.nbytes):
            return head
        parked = make_park(plan, state, eng.token_ids, eng.taint, head, self.anchors, self.end,
                           session=self.session, reuse=reuse, namespace=self.namespace)
        self.park_tier.put(parked)
        log.info("session_parked", head=head, rows=len(parked.token_ids) - head,
                 anchors=len(parked.anchors), end=parked.end is not None, nbytes=parked.nbytes,
                 in_place=plan.reuse)
        return plan.stop if plan.reuse else head

    def _swap_in_park(self, prompt: list[int], point: int, session: str | None,
                      namespace: Namespace) -> Resume:
        """The parked conversation comes back and the one in place is parked as it leaves."""
        eng = self.engine
        park = self.park_tier.take_out()
        state = eng.cache_state()
        # The head [0, park.head) stays in place: rows there from the engine's taint on (a
        # decode, an off-grid resume or a tainted restore since the park was made) are not the
        # rows the park's copies were taken over, so the returning state is tainted there too.
        head_taint = eng.taint if eng.taint is not None and eng.taint < park.head else None
        # The leaving conversation is parked in the returning one's buffer when it fits, the
        # rows swapped block by block; else copied (or, with no room, simply lost).
        swapped = self._park(state, park.head, reuse=park.rows)
        self.namespace = namespace  # the park's (it offers itself to its own only), as for a pin
        if point > swapped:
            park.rows.restore(state, swapped, point)
        self.anchors_drop_above(park.head)
        self.ends.drop_end()
        source_end = park.end is not None and park.end.length == point
        (park.end.copy if source_end else park.anchors[point]).restore(state)
        taints = [t for t in (park.taint, head_taint) if t is not None and t < point]
        eng.resume_at(point, park.token_ids, taint=min(taints, default=None))
        for line, copy in park.anchors.items():
            if line <= point:
                self.anchor_tier.add(line, copy)
        if source_end and self.end_anchor:
            self.ends.adopt_buffer(point, park.end.copy, state)
        self.session = park.session if session is None else session
        return Resume(point, "park")

    # -- reporting -------------------------------------------------------------------------

    def statistics(self) -> dict:
        """The counters; the pin's and the park's only while they are lent here (PARK_STATS
        names them: the engine actor keeps the last it saw)."""
        s = self.stats
        held = self.memory.held
        out = {
            "rows_in_place": self.engine.length,
            "anchors": sorted(self.anchors), "anchor_bytes": held["anchors"],
            "anchors_taken": s.anchors_taken, "evictions": s.anchor_evictions,
            "hits": s.hits, "cold": s.cold,
            "end": self.end.length if self.end else None, "ends": s.ends, "end_hits": s.end_hits,
            "end_absorbed": s.end_absorbed,
            "prompt_end": self.prompt_end.length if self.prompt_end else None,
            "prompt_ends": s.prompt_ends, "prompt_end_hits": s.prompt_end_hits,
            "prompt_end_bytes": held["prompt_end"],
            "taint": self.engine.taint,
            "guests": s.guests, "guest_refused": s.guest_refused, "stash_bytes": held["stash"],
        }
        if self._park_tiers is None:
            return out
        out.update({
            "pinned": len(self.pinned.token_ids) if self.pinned else None,
            "pinned_anchors": sorted(self.pinned.anchors) if self.pinned else [],
            "pins": s.pins, "pin_hits": s.pin_hits, "pin_bytes": held["pin"],
            "parked": ({"head": self.parked.head, "rows": len(self.parked.token_ids),
                        "end": self.parked.end.length if self.parked.end else None}
                       if self.parked else None),
            "parks": s.parks, "park_hits": s.park_hits, "park_bytes": held["park"],
        })
        return out

    def check_invariants(self) -> None:
        self.holdings.check_invariants(self.engine.token_ids)
        if self._park_tiers is not None:
            self.park_holdings.check_invariants()
        self.memory.check_invariants()
