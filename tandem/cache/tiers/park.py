"""The parked session (spec: "Another session"): the rows another session's request writes
over, above the head both share, with the newest anchors and, when the rows up to it fit, the
end anchor. One session is parked at a time (tandem/cache/keep.py plans and takes the copies)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.cache.keep import Parked
from tandem.cache.memory import MemoryAccountant
from tandem.cache.namespace import Namespace

LEVEL = "park"


class Park:
    def __init__(self, memory: MemoryAccountant, *, park_anchors: int) -> None:
        self.memory = memory
        self.park_anchors = park_anchors
        self.parked: Parked | None = None
        self.parks = 0
        self.hits = 0

    def offer(self, rows_in_place: Sequence[int], rows_namespace: Namespace,
              prompt: Sequence[int], limit: int, namespace: Namespace) -> int:
        park = self.parked
        if park is None or park.namespace != namespace:
            return 0
        if park.head and rows_namespace != namespace:
            return 0  # its head must be in place, and another namespace's rows are not it
        return park.offer(rows_in_place, prompt, limit)

    def holds_session(self, session: str | None, namespace: Namespace) -> bool:
        park = self.parked
        return (park is not None and session is not None and park.session == session
                and park.namespace == namespace)

    def put(self, parked: Parked) -> None:
        """A park its bytes were reserved for (the one before it was taken out first)."""
        assert self.parked is None, "one parked session at a time"
        self.parked = parked
        self.parks += 1

    def take_out(self) -> Parked | None:
        """The parked session comes back: it leaves the tier (its bytes are released)."""
        park, self.parked = self.parked, None
        if park is not None:
            self.memory.release(LEVEL, park.nbytes)
            self.hits += 1
        return park

    def drop(self) -> None:
        if self.parked is not None:
            self.memory.release(LEVEL, self.parked.nbytes)
            self.parked = None

    def check_invariants(self) -> None:
        park = self.parked
        assert self.memory.held[LEVEL] == (park.nbytes if park else 0), "park bytes"
        if park is not None:
            assert park.rows.start == park.head <= park.rows.stop, "park rows"
            assert len(park.token_ids) == park.rows.stop, "park rows and tokens"
            for line in park.anchors:
                assert line <= len(park.token_ids), line
            if park.end is not None:
                assert park.head < park.end.length <= len(park.token_ids), "park end"
