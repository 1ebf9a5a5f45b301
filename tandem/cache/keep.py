"""What the resident prefix keeps of a conversation its rows leave: the pinned head and the
parked session (spec: "A compaction", "Another session"). Here the copies are chosen, sized and
taken; the resident prefix decides when, and swaps them back in.

- The pinned head: the old prompt's rows up to its longest pin line (every ``pin_every`` grid
  lines, up to ``pin_max`` of them) with those anchors, when a compaction replaces the prompt.
- The parked session: the rows another session's request writes over, above the head both
  share, with the newest anchors and, when the rows up to it fit, the end anchor.

Pure logic over the adapter's copies (copies.py), no asyncio; every copy is reserved at its
memory level before it is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.memory import MemoryAccountant
from tandem.models.base import CacheState
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
    return SectionsCopy({k: t.clone() for k, t in copy.tensors.items()})


def pin_lines(anchors: dict[int, SectionsCopy], *, chunk: int, pin_every: int,
              pin_max: int) -> list[int]:
    """The anchored lines a pin keeps: every ``pin_every`` grid lines, ``pin_max`` at most."""
    return sorted(line for line in anchors
                  if line % (pin_every * chunk) == 0 and line <= pin_every * pin_max * chunk)


def take_pin(state: CacheState, token_ids: list[int], taint: int | None,
             anchors: dict[int, SectionsCopy], memory: MemoryAccountant, *, chunk: int,
             pin_every: int, pin_max: int) -> Pinned | None:
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
                  taint=taint if taint is not None and taint < head else None, nbytes=nbytes)


def take_park(state: CacheState, token_ids: list[int], taint: int | None, head: int,
              anchors: dict[int, SectionsCopy], end: End | None, memory: MemoryAccountant, *,
              session: str | None, park_anchors: int) -> Parked | None:
    """Park the rows above ``head`` with the newest ``park_anchors`` anchors, up to the end
    anchor when the rows up to it fit the park budget (one anchor fewer then), else up to the
    highest anchor that fits; None when nothing fits."""
    budget = memory.room("park")
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
    if stop is None or not memory.reserve("park", nbytes):
        return None
    return Parked(session=session, token_ids=list(token_ids[:stop]), head=head,
                  rows=RowsCopy.take(state, head, stop),
                  anchors={line: clone(anchors[line]) for line in kept if line <= stop},
                  end=End(end.length, clone(end.copy)) if keep_end else None,
                  taint=taint if taint is not None and taint < stop else None, nbytes=nbytes)
