"""The resident prefix: grid anchors, the end anchor, the guest stash, the pinned head and the
parked session, over the engine's one sequence (spec: "Resident prefix", "After a long
generation", "A guest keeps no end anchor").

Pure logic, no asyncio and no clock: the engine actor calls ``begin`` before a generation (it
restores state and puts the engine where the prefill resumes), ``on_chunk`` after each prefill
chunk, and ``finish`` after the generation. Every copy goes through the adapter's
``cache_state()`` and is reserved with the memory accountant at its level before it is made.

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

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import structlog
import torch

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.keep import (End, Parked, Pinned, clone, make_park, pin_lines, plan_park,
                               take_pin)
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.vocabulary import Source, Tier, tier_of
from tandem.models.base import CacheState
from tandem.tokens import common_prefix

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

    def resume_at(self, n: int, token_ids: Sequence[int] | None = None) -> None: ...

    def trim_pending(self, n: int) -> bool: ...


@dataclass(frozen=True)
class Resume:
    """Where a request's prefill starts and what served the rows below it."""

    start: int  # rows in place the prefill resumes at, in the served prompt's positions
    source: Source  # resident-tier sources, or store (the planner's)
    guest: bool = False
    # prompt_end: the prompt's last position's logits (a copy the request owns); the engine
    # samples the first token from them and forwards nothing.
    logits: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def tier(self) -> Tier | None:
        return tier_of(self.source)


@dataclass
class PromptEnd:
    """The prompt-end anchor: the sections after a prompt's prefill, before any decode, and the
    last position's logits. Its rows are not copied: they are the rows in place [0, length),
    which decoding only appends past. Valid while the rows in place start with ``token_ids``
    and no row under ``length`` was written since (every path that writes below a line drops
    the copies above it: anchors_drop_above)."""

    token_ids: list[int]
    copy: SectionsCopy
    logits: torch.Tensor

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class _Stash:
    rows: RowsCopy
    sections: SectionsCopy | None  # None when the end anchor already holds the live state
    token_ids: list[int]
    taint: int | None
    nbytes: int


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
    counters: dict = field(default_factory=dict)


class ResidentPrefix:
    def __init__(self, engine: SequenceEngine, memory: MemoryAccountant, *,
                 guest_max: int = 8192, keep_newest: int = 4, end_anchor: bool = True,
                 stash_margin: int = 512, pin_every: int = 4, pin_max: int = 8,
                 park_anchors: int = 4, prompt_end_anchor: bool = True):
        self.engine = engine
        self.memory = memory
        self.chunk = engine.prefix_chunk
        self.guest_max = guest_max
        self.keep_newest = keep_newest
        self.end_anchor = end_anchor
        self.stash_margin = stash_margin
        self.pin_every, self.pin_max = pin_every, pin_max
        self.park_anchors = park_anchors
        self.anchors: dict[int, SectionsCopy] = {}
        self.end: End | None = None
        self._end_buffer: SectionsCopy | None = None  # the same buffers turn after turn
        self.prompt_end_anchor = prompt_end_anchor
        self.prompt_end: PromptEnd | None = None
        # The prompt-end anchor's buffers (sections, logits), refilled prompt after prompt.
        self._prompt_end_buffer: tuple[SectionsCopy, torch.Tensor] | None = None
        self.pinned: Pinned | None = None
        self.parked: Parked | None = None
        self.stash: _Stash | None = None
        self.session: str | None = None  # of the rows in place
        self.namespace: Namespace = SHARED  # of the rows in place, their anchors, end and stash
        self._guest_namespace: Namespace = SHARED  # of the guest's rows while one runs
        self.stats = ResidentStats()
        self._guest_active = False
        self._guest_start = 0
        self._writing: int | None = None  # the anchor a copy is being written into

    # -- the request's way -----------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int], max_tokens: int,
              session: str | None = None, namespace: Namespace = SHARED) -> Resume:
        """Restore what serves ``prompt_ids`` best and put the engine there."""
        eng = self.engine
        prompt = list(prompt_ids)
        offer, c, continuing = self._plan(prompt, namespace)
        if offer.guest:
            return self._begin_guest(prompt, max_tokens, min(c, len(prompt) - 1), namespace)
        if offer.source == "pin":
            return self._swap_in_pin(prompt, offer.start, session, namespace)
        if offer.source == "park":
            return self._swap_in_park(prompt, offer.start, session, namespace)
        best = offer

        if not continuing:
            # A request too long to be a guest that shares nothing is a compaction: its
            # session's park is history it replaces, and the old prompt's head is pinned.
            compaction = (namespace == self.namespace and c < self.chunk
                          and eng.length >= self.chunk and best.source != "prompt_end")
            if (compaction and session is not None and self.parked is not None
                    and self.parked.session == session and self.parked.namespace == namespace):
                self._drop_park()
            if self._other_session(session, namespace) and eng.length > best.start:
                self._park_current(best.start)
            elif compaction:
                self._pin_head()
            self._move_to(best)
        self.session = session
        self.namespace = namespace
        self._count(best)
        if best.source == "prompt_end":
            return Resume(best.start, best.source, logits=self.prompt_end.logits.clone())
        return best

    def offer(self, prompt_ids: Sequence[int], namespace: Namespace = SHARED) -> Resume:
        """Where ``begin`` would resume this prompt, with no side effect: the planner compares
        it with the other tiers' offers (a guest's start assumes its stash is granted)."""
        return self._plan(list(prompt_ids), namespace)[0]

    def _plan(self, prompt: list[int], namespace: Namespace) -> tuple[Resume, int, bool]:
        """The best resume for ``prompt``, the tokens it shares with the rows in place, and
        whether it continues them."""
        eng = self.engine
        limit = len(prompt) - 1  # at least one token is forwarded: the logits come from it
        # Another namespace's rows share nothing with the prompt (_shared_rows), so no
        # extension, end anchor or anchor of theirs is offered.
        c = self._shared_rows(prompt, namespace)
        continuing = c >= eng.length and eng.length <= limit
        pe = self.prompt_end
        if (pe is not None and len(prompt) == pe.length <= c and not self._guest_active
                and prompt == pe.token_ids):
            # The same prompt again (a regenerate, a retry): nothing to forward, and no other
            # offer reaches past ``limit``. Before the guest test: a repeat is no guest.
            return Resume(pe.length, "prompt_end"), c, continuing
        if not continuing and self._is_guest(prompt, c):
            start = self._best_anchor(min(c, limit))
            return Resume(start, "resident" if start else "cold", guest=True), c, continuing

        # Candidates in the rows in place: the live state (extension), the end anchor, anchors.
        best = Resume(0, "cold")
        if continuing and eng.length:
            best = Resume(eng.length, "end" if self._end_at(eng.length) else "resident")
        else:
            if self.end is not None and self.end.length <= min(c, limit):
                best = Resume(self.end.length, "end")
            line = self._best_anchor(min(c, limit))
            if line > best.start:
                best = Resume(line, "resident")
        pin_point = self._pin_offer(prompt, limit, namespace)
        park_point = self._park_offer(prompt, limit, namespace)
        if pin_point > best.start and pin_point >= park_point:
            return Resume(pin_point, "pin"), c, continuing
        if park_point > best.start:
            return Resume(park_point, "park"), c, continuing
        return best, c, continuing

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
        self.prompt_end = None
        self.end = None
        self.session = session
        self.namespace = namespace

    def shed(self, level: str, need_nbytes: int) -> int:
        """The memory governor's call, on the engine thread between chunks or before a
        prefill: give back copies at ``level`` until ``need_nbytes`` are freed; the bytes
        freed. Anchors go cheapest loss first; the end, stash, park and pin go whole."""
        held = self.memory.held
        before = held[level]
        if level == "anchors":
            while held["anchors"] > before - need_nbytes and self.anchors:
                if not self._evict_one(protect=-1):
                    self._drop_anchor(min(self.anchors))
        elif level == "end":
            if self.stash is not None and self.stash.sections is None:
                self._drop_stash()  # it would restore its sections from the end anchor
            self.end = None
            if self._end_buffer is not None:
                self.memory.release("end", self._end_buffer.nbytes)
                self._end_buffer = None
        elif level == "stash":
            self._drop_stash()
        elif level == "park":
            self._drop_park()
        elif level == "pin":
            self._drop_pin()
        elif level == "prompt_end":
            self._drop_prompt_end()
        return before - held[level]

    def _drop_stash(self) -> None:
        """The guest keeps its rows and the resident rows it wrote over are lost: everything
        above the guest's start goes (its rows are the guest's now)."""
        if self.stash is None:
            return
        self.memory.release("stash", self.stash.nbytes)
        self.stash = None
        self.anchors_drop_above(self.engine.length if not self._guest_active else
                                self._guest_start)
        self.end = None
        if self._guest_active:
            self.namespace = self._guest_namespace

    def on_chunk(self, end: int) -> None:
        """After a prefill chunk: an anchor at every grid line the prefill passes."""
        if self._guest_active or end % self.chunk:
            return
        self._take_anchor(end)

    def on_prefill(self, logits: torch.Tensor) -> None:
        """After a prompt's prefill, before its first decode (nothing is pending): the
        prompt-end anchor, the sections and ``logits`` (the last position's), in the buffers
        of the last one. A guest keeps none: its rows go back after it."""
        if self._guest_active or not self.prompt_end_anchor:
            return
        eng = self.engine
        state = eng.cache_state()
        self.prompt_end = None  # a copy cut short is not the state at any prompt's end
        buffer = self._prompt_end_buffer
        if buffer is None:
            nbytes = SectionsCopy.nbytes_of(state) + logits.numel() * logits.element_size()
            if not self.memory.reserve("prompt_end", nbytes):
                return
            buffer = self._prompt_end_buffer = (SectionsCopy.take(state), logits.clone())
        else:
            buffer[0].copy_from(state)
            buffer[1].copy_(logits)
        self.prompt_end = PromptEnd(list(eng.token_ids), *buffer)
        self.stats.prompt_ends += 1

    def _drop_prompt_end(self) -> None:
        self.prompt_end = None
        if self._prompt_end_buffer is not None:
            copy, logits = self._prompt_end_buffer
            self.memory.release("prompt_end",
                                copy.nbytes + logits.numel() * logits.element_size())
            self._prompt_end_buffer = None

    def finish(self, committed_ids: Sequence[int] | None = None) -> None:
        """After a generation: a guest's rows go back; otherwise the end anchor is kept, at the
        committed tokens when they are given."""
        if self._guest_active:
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
        if self._guest_active:
            self._restore_stash()
            return
        if self._writing in self.anchors:
            self._drop_anchor(self._writing)
        self._writing = None
        if self.stash is not None:
            self.memory.release("stash", self.stash.nbytes)  # a guest that never began
            self.stash = None
        eng = self.engine
        line = self._best_anchor(eng.length)
        self.anchors_drop_above(line)
        self.end = None
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
                self.end = None
                self.stats.end_absorbed += 1
                log.info("end_anchor_absorbed", rows=eng.length, committed=keep)
                return
        eng.settle()
        state = eng.cache_state()
        if self.end is None:
            if self._end_buffer is None:
                if not self.memory.reserve("end", SectionsCopy.nbytes_of(state)):
                    return
                self._end_buffer = SectionsCopy.take(state)
            else:
                self._end_buffer.copy_from(state)
        else:
            self.end.copy.copy_from(state)
        self.end = End(eng.length, self._end_buffer)
        self.stats.ends += 1

    # -- guests ----------------------------------------------------------------------------

    def _is_guest(self, prompt: list[int], c: int) -> bool:
        return (len(prompt) <= self.guest_max and 4 * len(prompt) < self.engine.length)

    def _begin_guest(self, prompt: list[int], max_tokens: int, c: int,
                     namespace: Namespace) -> Resume:
        eng = self.engine
        state = eng.cache_state()
        start = self._best_anchor(c)
        stop = min(eng.length, len(prompt) + max_tokens + 2 * self.stash_margin)
        live_in_end = self.end is not None and self.end.length == eng.length
        nbytes = RowsCopy.nbytes_of(state, max(stop - start, 0))
        if not live_in_end:
            nbytes += SectionsCopy.nbytes_of(state)
        if stop > start and not self.memory.reserve("stash", nbytes):
            # No room: the guest writes over the resident rows, which are cut at its start.
            self.stats.guest_refused += 1
            log.info("guest_stash_refused", nbytes=nbytes)
            self._move_to(Resume(start, "resident" if start else "cold"))
            self.namespace = namespace
            self._count(Resume(start, "resident" if start else "cold"))
            return Resume(start, "resident" if start else "cold", guest=True)
        self.stash = _Stash(rows=RowsCopy.take(state, start, max(stop, start)),
                            sections=None if live_in_end else SectionsCopy.take(state),
                            token_ids=list(eng.token_ids), taint=eng.taint,
                            nbytes=nbytes if stop > start else 0)
        if start:
            self.anchors[start].restore(state)
        eng.resume_at(start)
        self._guest_active = True
        self._guest_start = start
        self._guest_namespace = namespace
        self.stats.guests += 1
        return Resume(start, "resident" if start else "cold", guest=True)

    def _restore_stash(self) -> None:
        eng, stash = self.engine, self.stash
        self._guest_active = False
        if stash is None:
            return
        state = eng.cache_state()
        stash.rows.restore(state)
        (stash.sections or self.end.copy).restore(state)
        eng.resume_at(len(stash.token_ids), stash.token_ids)
        eng.taint = stash.taint
        self.memory.release("stash", stash.nbytes)
        self.stash = None

    # -- anchors ---------------------------------------------------------------------------

    def _best_anchor(self, limit: int) -> int:
        lines = [line for line in self.anchors if line <= limit]
        return max(lines, default=0)

    def _protected(self) -> set[int]:
        newest = sorted(self.anchors)[-self.keep_newest:]
        keepers = {line for line in self.anchors
                   if line % (self.pin_every * self.chunk) == 0
                   and line <= self.pin_every * self.pin_max * self.chunk}
        return set(newest) | keepers

    def _take_anchor(self, line: int) -> None:
        state = self.engine.cache_state()
        if line in self.anchors:
            self._writing = line  # a copy cut short is not the state at its line
            self.anchors[line].copy_from(state)
            self._writing = None
            return
        nbytes = SectionsCopy.nbytes_of(state)
        while not self.memory.reserve("anchors", nbytes):
            if not self._evict_one(protect=line):
                return
        self.anchors[line] = SectionsCopy.take(state)
        self.stats.anchors_taken += 1

    def _evict_one(self, protect: int) -> bool:
        """Drop the unprotected anchor whose loss costs least: the one nearest the anchor
        below it (the re-read it adds is that gap)."""
        keep = self._protected() | {protect}
        lines = sorted(self.anchors)
        candidates = [(line - (lines[i - 1] if i else 0), line)
                      for i, line in enumerate(lines) if line not in keep]
        if not candidates:
            return False
        _, line = min(candidates)
        self._drop_anchor(line)
        self.stats.anchor_evictions += 1
        return True

    def _drop_anchor(self, line: int) -> None:
        copy = self.anchors.pop(line)
        self.memory.release("anchors", copy.nbytes)

    def anchors_drop_above(self, line: int) -> None:
        """Rows above ``line`` are about to be written over: no copy of a state above it
        stays (the prompt-end anchor included; its buffers are kept for the next prompt)."""
        for above in [x for x in self.anchors if x > line]:
            self._drop_anchor(above)
        if self.prompt_end is not None and self.prompt_end.length > line:
            self.prompt_end = None

    def _end_at(self, n: int) -> bool:
        return self.end is not None and self.end.length == n

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
            self.end = None

    def _count(self, resume: Resume) -> None:
        s = self.stats
        if resume.source == "end":
            s.end_hits += 1
        elif resume.source == "resident":
            s.hits += 1
        elif resume.source == "cold":
            s.cold += 1
        elif resume.source == "prompt_end":
            s.prompt_end_hits += 1

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
        if not pin_lines(self.anchors, chunk=self.chunk, pin_every=self.pin_every,
                         pin_max=self.pin_max):
            return
        if self.pinned is not None:
            # The head already pinned is kept when the rows in place share it whole.
            if (self.pinned.namespace == self.namespace and common_prefix(
                    self.pinned.token_ids, eng.token_ids) >= len(self.pinned.token_ids)):
                return
            self._drop_pin()
        pinned = take_pin(eng.cache_state(), eng.token_ids, eng.taint, self.anchors, self.memory,
                          chunk=self.chunk, pin_every=self.pin_every, pin_max=self.pin_max,
                          namespace=self.namespace)
        if pinned is None:
            return
        self.pinned = pinned
        self.stats.pins += 1
        log.info("head_pinned", rows=len(pinned.token_ids), anchors=len(pinned.anchors),
                 nbytes=pinned.nbytes)

    def _drop_pin(self) -> None:
        if self.pinned is not None:
            self.memory.release("pin", self.pinned.nbytes)
            self.pinned = None

    def _pin_offer(self, prompt: list[int], limit: int, namespace: Namespace) -> int:
        pin = self.pinned
        return pin.offer(prompt, limit) if pin is not None and pin.namespace == namespace else 0

    def _swap_in_pin(self, prompt: list[int], line: int, session: str | None,
                     namespace: Namespace) -> Resume:
        eng, pin = self.engine, self.pinned
        state = eng.cache_state()
        c = self._shared_rows(prompt, namespace)
        if self._other_session(session, namespace) and eng.length > c:
            self._park_current(self._best_anchor(c))
        # Rows both prompts share stay; the rest of the head is copied back.
        # Rows in place from taint on (decoded, or after an off-grid resume), and those of a
        # partial chunk, are not the pin's cold rows though their tokens are: the pin's copies
        # come back from the grid line under them.
        shared = min(self._shared_rows(pin.token_ids, namespace), line,
                     line if eng.taint is None else eng.taint)
        shared -= shared % self.chunk
        # Set before the first write: a restore that fails half way leaves no copy of one
        # namespace's rows under another's name (abort cuts back to its anchors).
        self.namespace = namespace
        self.anchors_drop_above(shared)
        self.end = None
        pin.rows.restore(state, shared, line)
        pin.anchors[line].restore(state)
        eng.resume_at(line, pin.token_ids)
        eng.taint = pin.taint if pin.taint is not None and pin.taint < line else None
        for at, copy in pin.anchors.items():
            if shared < at <= line and self.memory.reserve("anchors", copy.nbytes):
                self.anchors[at] = clone(copy)
        self.session = session
        self.stats.pin_hits += 1
        return Resume(line, "pin")

    # -- the parked session ----------------------------------------------------------------

    def _park_current(self, head: int) -> None:
        """Park the rows in place above ``head`` (about to be written over) with the newest
        anchors and, when the rows up to it fit, the end anchor."""
        eng = self.engine
        state = eng.cache_state()
        if self.parked is not None:
            self._drop_park()  # one parked session; a third one's park goes
        self._park(state, head)

    def _park(self, state: CacheState, head: int, reuse: RowsCopy | None = None) -> int:
        """Park the rows above ``head``; with ``reuse`` (the rows of the park coming back) in
        place when they fit its buffer. Returns the row up to which the rows in place were
        swapped with ``reuse``'s (``head`` when they were not)."""
        eng = self.engine
        plan = plan_park(state, head, self.anchors, self.end, self.memory.room("park"),
                         park_anchors=self.park_anchors, reuse=reuse)
        if plan is None or not self.memory.reserve("park", plan.nbytes):
            return head
        parked = make_park(plan, state, eng.token_ids, eng.taint, head, self.anchors, self.end,
                           session=self.session, reuse=reuse, namespace=self.namespace)
        self.parked = parked
        self.stats.parks += 1
        log.info("session_parked", head=head, rows=len(parked.token_ids) - head,
                 anchors=len(parked.anchors), end=parked.end is not None, nbytes=parked.nbytes,
                 in_place=plan.reuse)
        return plan.stop if plan.reuse else head

    def _drop_park(self) -> None:
        if self.parked is not None:
            self.memory.release("park", self.parked.nbytes)
            self.parked = None

    def _park_offer(self, prompt: list[int], limit: int, namespace: Namespace) -> int:
        park = self.parked
        if park is None or park.namespace != namespace:
            return 0
        if park.head and self.namespace != namespace:
            return 0  # its head must be in place, and another namespace's rows are not it
        return park.offer(self.engine.token_ids, prompt, limit)

    def _swap_in_park(self, prompt: list[int], point: int, session: str | None,
                      namespace: Namespace) -> Resume:
        """The parked conversation comes back and the one in place is parked as it leaves."""
        eng = self.engine
        park = self.parked
        self.parked = None
        self.memory.release("park", park.nbytes)
        state = eng.cache_state()
        # The leaving conversation is parked in the returning one's buffer when it fits, the
        # rows swapped block by block; else copied (or, with no room, simply lost).
        swapped = self._park(state, park.head, reuse=park.rows)
        self.namespace = namespace  # the park's (it offers itself to its own only), as for a pin
        if point > swapped:
            park.rows.restore(state, swapped, point)
        self.anchors_drop_above(park.head)
        self.end = None
        source_end = park.end is not None and park.end.length == point
        (park.end.copy if source_end else park.anchors[point]).restore(state)
        eng.resume_at(point, park.token_ids)
        eng.taint = park.taint if park.taint is not None and park.taint < point else None
        for line, copy in park.anchors.items():
            if line <= point and self.memory.reserve("anchors", copy.nbytes):
                self.anchors[line] = copy
        if source_end and self.end_anchor:
            if self._end_buffer is None and self.memory.reserve("end", park.end.copy.nbytes):
                self._end_buffer = park.end.copy
            elif self._end_buffer is not None:
                self._end_buffer.copy_from(state)
            if self._end_buffer is not None:
                self.end = End(point, self._end_buffer)
        self.session = park.session if session is None else session
        self.stats.park_hits += 1
        return Resume(point, "park")

    # -- reporting -------------------------------------------------------------------------

    def statistics(self) -> dict:
        s = self.stats
        held = self.memory.held
        return {
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
            "pinned": len(self.pinned.token_ids) if self.pinned else None,
            "pinned_anchors": sorted(self.pinned.anchors) if self.pinned else [],
            "pins": s.pins, "pin_hits": s.pin_hits, "pin_bytes": held["pin"],
            "parked": ({"head": self.parked.head, "rows": len(self.parked.token_ids),
                        "end": self.parked.end.length if self.parked.end else None}
                       if self.parked else None),
            "parks": s.parks, "park_hits": s.park_hits, "park_bytes": held["park"],
        }

    def check_invariants(self) -> None:
        eng = self.engine
        for line in self.anchors:
            assert line % self.chunk == 0 and 0 < line <= eng.length, (line, eng.length)
        if self.end is not None and not self._guest_active:
            assert self.end.length <= eng.length, (self.end.length, eng.length)
        held = self.memory.held
        assert held["anchors"] == sum(c.nbytes for c in self.anchors.values()), "anchor bytes"
        assert held["pin"] == (self.pinned.nbytes if self.pinned else 0), "pin bytes"
        assert held["park"] == (self.parked.nbytes if self.parked else 0), "park bytes"
        assert held["stash"] == (self.stash.nbytes if self.stash else 0), "stash bytes"
        buffer = self._prompt_end_buffer
        assert held["prompt_end"] == (0 if buffer is None else buffer[0].nbytes
                                      + buffer[1].numel() * buffer[1].element_size()), \
            "prompt_end bytes"
        pe = self.prompt_end
        if pe is not None:
            assert buffer is not None and pe.copy is buffer[0], "prompt_end outside its buffer"
            if not self._guest_active:
                assert eng.token_ids[:pe.length] == pe.token_ids, "prompt_end rows moved"
        if self.stash is None:
            assert not self._guest_active
        self.memory.check_invariants()
