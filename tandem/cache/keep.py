"""What the resident prefix keeps of a conversation its rows leave: the pinned head and the
parked session (spec: "A compaction", "Another session"). Here the copies are chosen, sized and
taken; the resident prefix decides when, and swaps them back in.

- The pinned head: the old prompt's rows up to its longest pin line (every ``pin_every`` grid
  lines, up to ``pin_max`` of them) with those anchors, when a compaction replaces the prompt.
- The parked session: the rows another session's request writes over, above the head both
  share, with the newest anchors and, when the rows up to it fit, the end anchor. When a parked
  conversation comes back, the leaving one is parked in its buffer if it fits, the rows swapped
  in place block by block, so the machine never holds both copies at once.

Pure logic over the adapter's copies (copies.py), no asyncio; every copy is reserved at its
memory level before it is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import SHARED, Namespace
from tandem.devices import host_clone
from tandem.models.base import CacheState
from tandem.models.rows import rows_written
from tandem.tokens import common_prefix


@dataclass
class End:
    length: int
    copy: SectionsCopy


@dataclass
class Pinned:
    token_ids: list[int]  # the head's tokens, rows [0, len)
    rows: RowsCopy
    anchors: dict[int, SectionsCopy]
    taint: int | None
    nbytes: int
    namespace: Namespace = SHARED  # of the rows it was pinned from

    def offer(self, prompt: Sequence[int], limit: int) -> int:
        """The longest pinned anchor the prompt reaches, or 0."""
        cp = common_prefix(list(prompt), self.token_ids)
        return max((line for line in self.anchors if line <= min(cp, limit)), default=0)


@dataclass
class Parked:
    session: str | None
    token_ids: list[int]  # the parked conversation's rows, [0, len)
    head: int  # rows [0, head) were left in place and must be there to come back
    rows: RowsCopy  # rows [head, len)
    anchors: dict[int, SectionsCopy]
    end: End | None
    taint: int | None
    nbytes: int
    namespace: Namespace = SHARED  # of the parked rows (the head's too: it was in place)

    def offer(self, rows_in_place: Sequence[int], prompt: Sequence[int], limit: int) -> int:
        """Where the prompt resumes from the park (its end, else its longest anchor), or 0
        when the shared head is no longer in place."""
        if list(rows_in_place[:self.head]) != self.token_ids[:self.head]:
            return 0
        cp = min(common_prefix(list(prompt), self.token_ids), limit)
        if self.end is not None and self.end.length <= cp:
            return self.end.length
        return max((line for line in self.anchors if line <= cp), default=0)


def clone(copy: SectionsCopy) -> SectionsCopy:
    return SectionsCopy({k: host_clone(t) for k, t in copy.tensors.items()})


def pin_lines(anchors: dict[int, SectionsCopy], *, chunk: int, pin_every: int,
              pin_max: int) -> list[int]:
    """The anchored lines a pin keeps: every ``pin_every`` grid lines, ``pin_max`` at most."""
    return sorted(line for line in anchors
                  if line % (pin_every * chunk) == 0 and line <= pin_every * pin_max * chunk)


def take_pin(state: CacheState, token_ids: list[int], taint: int | None,
             anchors: dict[int, SectionsCopy], memory: MemoryAccountant, *, chunk: int,
             pin_every: int, pin_max: int, namespace: Namespace = SHARED) -> Pinned | None:
    """Pin the head up to the longest pin line whose rows and anchors fit the pin budget, or
    None when none does (or nothing is anchored on a pin line)."""
    keepers = pin_lines(anchors, chunk=chunk, pin_every=pin_every, pin_max=pin_max)
    budget = memory.room("pin")
    nbytes = 0
    while keepers:
        head = keepers[-1]
        nbytes = RowsCopy.nbytes_of(state, head) + len(keepers) * SectionsCopy.nbytes_of(state)
        if nbytes <= budget:
            break
        keepers.pop()
    if not keepers or not memory.reserve("pin", nbytes):
        return None
    return Pinned(token_ids=list(token_ids[:head]), rows=RowsCopy.take(state, 0, head),
                  anchors={line: clone(anchors[line]) for line in keepers},
                  taint=taint if taint is not None and taint < head else None, nbytes=nbytes,
                  namespace=namespace)


SWAP_BLOCK = 256  # rows a park swap moves at a time: the swap's peak beyond both copies


@dataclass(frozen=True)
class ParkPlan:
    stop: int  # rows [head, stop) are parked
    anchors: list[int]
    keep_end: bool
    nbytes: int
    reuse: bool  # in the buffer of the park coming back, swapped in place


def plan_park(state: CacheState, head: int, anchors: dict[int, SectionsCopy], end: End | None,
              budget: int, *, park_anchors: int, reuse: RowsCopy | None = None) -> ParkPlan | None:
    """What a park of the rows above ``head`` keeps: the newest ``park_anchors`` anchors, up to
    the end anchor when the rows up to it fit ``budget`` (one anchor fewer then), else up to
    the highest anchor that fits; None when nothing fits. ``reuse``: the rows of a park coming
    back; when the new rows fit its buffer (and the buffer fits the budget), the two are
    swapped in place instead of copied, so the machine never holds both at once."""
    per_anchor = SectionsCopy.nbytes_of(state)
    above = sorted(line for line in anchors if line > head)
    end = end if end is not None and end.length > head else None
    stop, keep_end, kept, nbytes = None, False, [], 0
    if end is not None:
        kept = above[-(park_anchors - 1):] if park_anchors > 1 else []
        nbytes = RowsCopy.nbytes_of(state, end.length - head) + per_anchor * (len(kept) + 1)
        if nbytes <= budget:
            stop, keep_end = end.length, True
    if stop is None:
        while above:
            kept = above[-park_anchors:]
            nbytes = RowsCopy.nbytes_of(state, above[-1] - head) + per_anchor * len(kept)
            if nbytes <= budget:
                stop = above[-1]
                break
            above.pop()
    if stop is None:
        return None
    kept = [line for line in kept if line <= stop]
    if reuse is not None and reuse.start == head and stop <= reuse.stop:
        in_place = nbytes - RowsCopy.nbytes_of(state, stop - head) + reuse.nbytes
        if in_place <= budget:
            return ParkPlan(stop, kept, keep_end, in_place, reuse=True)
    return ParkPlan(stop, kept, keep_end, nbytes, reuse=False)


def swap_rows(state: CacheState, buffer: RowsCopy, start: int, stop: int) -> None:
    """Exchange rows [start, stop) in place with ``buffer``'s, ``SWAP_BLOCK`` rows at a time."""
    rows_written(state.views, start)
    for a in range(start, stop, SWAP_BLOCK):
        b = min(stop, a + SWAP_BLOCK)
        for name, view in state.views.items():
            rows = view.rows(a, b)
            held = buffer.tensors[name].narrow(view.token_axis, a - buffer.start, b - a)
            moving = rows.clone()
            rows.copy_(held)
            held.copy_(moving)


def make_park(plan: ParkPlan, state: CacheState, token_ids: list[int], taint: int | None,
              head: int, anchors: dict[int, SectionsCopy], end: End | None, *,
              session: str | None, reuse: RowsCopy | None = None,
              namespace: Namespace = SHARED) -> Parked:
    """The park ``plan`` chose, its room already reserved. With ``plan.reuse``, rows [head,
    stop) are swapped with ``reuse``'s: the engine then holds the returning park's rows there."""
    if plan.reuse:
        swap_rows(state, reuse, head, plan.stop)
        rows = RowsCopy(head, plan.stop, reuse.tensors)  # the whole buffer, as reserved
    else:
        rows = RowsCopy.take(state, head, plan.stop)
    return Parked(session=session, token_ids=list(token_ids[:plan.stop]), head=head, rows=rows,
                  anchors={line: clone(anchors[line]) for line in plan.anchors},
                  end=End(end.length, clone(end.copy)) if plan.keep_end else None,
                  taint=taint if taint is not None and taint < plan.stop else None,
                  nbytes=plan.nbytes, namespace=namespace)
