"""The end records beside the resident prefix's ends (spec: "The end anchor", "The park keeps
the end anchor too").

An end anchor holds the state at the end of the last answer; its *record* (endalign.EndRecord)
holds what the rows there are: their tokens, where each generation sits and the hidden spans a
client's copy lacks. The record in place follows the end in place, and a parked conversation's
record follows the parked end, so a copy of either conversation aligns to its end. Engine thread
only, like the resident prefix whose ends it follows.

A record is the namespace's of the rows it describes (tandem/cache/namespace.py): the record in
place the rows in place's, the parked record the park's, each recent one the turn's. A copy is
aligned only with its own namespace's records: another's would serve a tenant the rows (the
answers, the hidden spans) of another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from tandem.cache.endalign import Alignment, EndRecord, SplitToken, align
from tandem.cache.namespace import SHARED, Namespace
from tandem.cache.resident import ResidentPrefix
from tandem.models.image_keys import has_keys


RECENT = 8  # records of the last turns kept for the state store's session snapshots


class EndRecords:
    def __init__(self, resident: ResidentPrefix | None,
                 token_bytes: Callable[[int], bytes | None], *, allow_reasoning: bool = True,
                 holds: Callable[[list[int], Namespace], bool] | None = None,
                 store_backed: bool = False, split: SplitToken | None = None) -> None:
        """``holds(rows, namespace)``: whether the state store holds a session snapshot of
        exactly these rows in that namespace (None: no store). A client's copy that aligns
        with a recent turn's record is served as that record's rows only when it does, so the
        store resumes it there. ``store_backed``: a store exists, asked by the caller of
        ``align_in_place`` (the loop) rather than through ``holds``.

        ``resident``: the composer whose ends the records follow; records kept in the
        resident's holdings are bound to the composer they are lent to (ResidentPrefix.lend)."""
        self.resident = resident
        self.token_bytes = token_bytes
        self.allow_reasoning = allow_reasoning
        self.holds = holds
        self.store_backed = store_backed or holds is not None
        self.split = split  # tandem.cache.endalign.align's: a copy's token the rows end inside
        self.record: EndRecord | None = None  # of the end in place
        self._record_namespace: Namespace = SHARED  # of the rows ``record`` was made over
        self.parked_record: EndRecord | None = None  # of the parked end
        # The last turns' records, newest last: their rows are what a session snapshot of
        # that turn is keyed by, once the end in place and the park have moved on.
        self.recent: deque[tuple[Namespace, EndRecord]] = deque(maxlen=RECENT)
        self.alignments: dict[str, int] = {}  # how copies met an end, by mode
        self.replays = 0  # turns whose copy lacked hidden spans that were put back
        self.stored = 0  # copies aligned with a stored session's rows

    def align(self, prompt: list[int], namespace: Namespace = SHARED) -> Alignment | None:
        """The client's copy met against the end in place (or, failing that, the parked
        conversation's end), of the request's ``namespace``: the prompt to serve so that the
        engine resumes there (hidden spans put back, re-tokenised text and stripped reasoning
        aligned), or None to serve the copy as it came."""
        alignment, recent = self.align_in_place(prompt, namespace)
        if alignment is not None or self.holds is None:
            return alignment
        for candidate, rows in recent:
            if self.holds(rows, namespace):
                return self.aligned_to_store(candidate)
        return None

    def align_in_place(self, prompt: list[int], namespace: Namespace = SHARED, *,
                       count: bool = True
                       ) -> tuple[Alignment | None, Iterator[tuple[Alignment, list[int]]]]:
        """``align``'s first half, which asks nobody: the alignment with an end in place or
        parked (counted), else the recent turns' alignments, newest first, each with the rows
        the store must hold as a session snapshot for it to be served
        (``aligned_to_store`` once the store said it does). The recent ones are made as they
        are read: a caller that stops at the first the store holds aligns no further.
        ``count`` False: nothing is counted (a peek's)."""
        resident = self.resident
        candidates = []
        if self.end_record(resident.end, resident.namespace, namespace) is not None:
            candidates.append(self.record)
        parked = resident.parked
        if parked is not None and parked.end is not None and self.parked_record is not None \
                and parked.end.length == len(self.parked_record.rows) \
                and parked.namespace == namespace:
            candidates.append(self.parked_record)
        for record in candidates:
            alignment = self._align(record, prompt)
            if alignment is not None:
                return (self._count(alignment) if count else alignment), iter(())
        if not self.store_backed:
            return None, iter(())
        return None, self._recent_alignments(prompt, namespace, candidates)

    def _recent_alignments(self, prompt: list[int], namespace: Namespace,
                           tried: list[EndRecord]) -> Iterator[tuple[Alignment, list[int]]]:
        """The recent turns whose ends have gone (a third conversation took the park): their
        session snapshots may still be in the store."""
        for record_namespace, record in reversed(list(self.recent)):
            if record_namespace != namespace or any(record is t for t in tried):
                continue
            alignment = self._align(record, prompt)
            if alignment is not None:
                yield alignment, record.rows

    def aligned_to_store(self, alignment: Alignment) -> Alignment:
        self.stored += 1
        return self._count(alignment)

    def end_record(self, end: object, rows_namespace: Namespace,
                   namespace: Namespace) -> EndRecord | None:
        """The record of the end in place (``end``, an End or None, over rows of
        ``rows_namespace``) for a request of ``namespace``: None when it describes no such end."""
        record = self.record
        if end is None or record is None or end.length != len(record.rows) \
                or rows_namespace != namespace:
            return None
        return record

    def aligns_at_end(self, end: object, rows_namespace: Namespace, prompt: list[int],
                      namespace: Namespace) -> bool:
        """Whether ``prompt`` aligns with the end in place (placement asks it of each slot's
        holdings, which are not lent; nothing is counted)."""
        record = self.end_record(end, rows_namespace, namespace)
        return record is not None and self._align(record, prompt) is not None

    def _align(self, record: EndRecord, prompt: list[int]) -> Alignment | None:
        alignment = align(record, prompt, self.token_bytes, allow_reasoning=self.allow_reasoning,
                          split=self.split)
        if alignment is not None and len(alignment.served) > len(record.rows):
            return alignment
        return None

    def _count(self, alignment: Alignment) -> Alignment:
        self.alignments[alignment.mode] = self.alignments.get(alignment.mode, 0) + 1
        if alignment.replayed_hidden:
            self.replays += 1
        return alignment

    def follow_park(self, parked_before: object, swapped_in: bool) -> None:
        """After a request: a park of the rows in place takes the current record along; a swap
        brings the parked one back."""
        parked = self.resident.parked
        if parked is parked_before:
            return
        leaving = self.record
        if swapped_in:
            self.record = self.parked_record
            self._record_namespace = self.resident.namespace  # the park's, now in place
        if parked is not None and parked.end is not None and leaving is not None \
                and len(leaving.rows) == parked.end.length:
            self.parked_record = leaving
        else:
            self.parked_record = None

    def remember(self, served: list[int], generated: Sequence[int],
                 hidden_in_generated: Sequence[int]) -> None:
        """After a turn that kept its end: the record of the rows up to it. A turn whose rows
        hold images (key ids: tandem.models.image_keys) keeps none: a copy is never aligned
        with it, so a request with images replays no hidden span and its rows are never read
        as text."""
        resident, engine = self.resident, self.resident.engine
        if resident.end is None or resident.end.length != engine.length \
                or has_keys(engine.token_ids):
            self.record = None
            return
        in_rows = list(generated[:engine.length - len(served)])
        previous = self._continued(engine.token_ids, resident.namespace)
        self.record = EndRecord.after_turn(previous, served, in_rows,
                                           hidden_in_generated=hidden_in_generated)
        self._record_namespace = resident.namespace
        if self.store_backed:  # only a store's session snapshots are keyed by them
            self._keep_recent(resident.namespace, self.record)

    def _keep_recent(self, namespace: Namespace, record: EndRecord) -> None:
        """The newest turn's record among the recent ones. The same turn again (a chat UI's
        title and tags requests resend the conversation, a client retries, a prompt is sent
        twice) replaces its older copy rather than filling the deque with it: a copy that
        aligns with no end is aligned with every recent record on each request (16k tokens
        compared eight times over, a few ms of the loop's). Same rows and hidden spans is the
        same turn: the store keys its snapshot by the rows, and the newer record, the latest
        turn's regions with it, is the one kept."""
        for i, (kept_namespace, kept) in enumerate(self.recent):
            if kept_namespace == namespace and len(kept.rows) == len(record.rows) \
                    and kept.hidden == record.hidden and kept.rows == record.rows:
                del self.recent[i]
                break
        self.recent.append((namespace, record))

    def _continued(self, rows: list[int], namespace: Namespace) -> EndRecord | None:
        """The longest record the rows in place start with: the one in place, or a recent
        turn's (a copy aligned with it and the store restored its session snapshot, while the
        record in place was another conversation's). Its regions and hidden spans carry over
        into the new record: without them a copy that leaves out the reasoning or the hidden
        spans of the earlier turns aligns with the end no more, only with the older turn's
        record, whose snapshot the store then restores whole and re-reads the rest from."""
        candidates = [(self._record_namespace, self.record), *self.recent]
        best: EndRecord | None = None
        for record_namespace, record in candidates:
            if record is None or record_namespace != namespace:
                continue
            n = len(record.rows)
            if (best is None or n > len(best.rows)) and rows[:n] == record.rows:
                best = record
        return best

    def align_record(self, record: EndRecord, prompt: list[int]) -> Alignment | None:
        """The copy met against a record from elsewhere (a spill entry's end); counted only
        once served (``count``)."""
        return self._align(record, prompt)

    def count(self, alignment: Alignment) -> Alignment:
        return self._count(alignment)

    def adopt(self, record: EndRecord, namespace: Namespace) -> None:
        """The record of an end read back from elsewhere (the session spill) into place."""
        self.record = record
        self._record_namespace = namespace

    def forget(self) -> None:
        """A failed forward: the rows in place are not trusted, nor what recorded them."""
        self.record = self.parked_record = None

    def clear(self) -> None:
        """A clear of the caches: no record of an end, parked or recent, stays."""
        self.forget()
        self.recent.clear()
