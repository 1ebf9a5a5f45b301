"""A slot's conversation as a spill entry, and an entry back as a slot's conversation (issue 16,
parts 1 and 2: what the engine actor writes and reads; tandem/io/spill.py writes the files).

Pure glue, no asyncio: the engine actor calls ``slot_entry`` over a slot's holdings (lent, the
slot idle) to build what a `SpillSave` carries, ``spill_offer`` on the loop to weigh an entry
against the tiers in RAM, and ``adopt_entry`` on the engine thread once ``SessionSpill.restore``
wrote an entry's rows and sections into the slot.

What an entry holds of the holdings: the rows ``[0, length)`` in place, their token ids and
taint, the grid anchors (the newest 4; the spill picks them), the end anchor when it is at the
end of the rows, with its end record (hidden spans and alignment regions, tandem.cache.endalign)
as the end's metadata, the session key's digest and the namespace. An entry without a session
key is named after the entry it continues (else its own rows), so a conversation saved again is
the same entry (and written incrementally).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import structlog

from tandem.cache.copies import SectionsCopy
from tandem.cache.endalign import Alignment, EndRecord, Region
from tandem.cache.namespace import Namespace
from tandem.io.spill import EntryMeta, SpillEnd, SpillOffer, session_digest
from tandem.tokens import common_prefix

log = structlog.get_logger("tandem.spill")

# Bytes a second a restore reads and decodes at, before this process measured one (the
# codec's decode on two cores here; the weigh of a read against the prefill it saves).
RESTORE_RATE_PRIOR = 1.0e9
NotServed = Literal["end_no_align", "anchors_below", "slow", "short"]


@dataclass(frozen=True)
class SlotEntry:
    """What a `SpillSave` of one slot carries (the state, anchors and end lent)."""

    entry_id: str
    state: Any  # the slot's CacheState
    valid: int
    token_ids: list[int]
    anchors: dict[int, SectionsCopy]
    end: SpillEnd | None
    meta: EntryMeta


def entry_session(session: str | None, token_ids: Sequence[int], namespace: Namespace,
                  entries: Mapping[str, Any], grid: int) -> str:
    """The digest an entry is named by: the session key's; without one, the entry of the
    namespace this conversation continues (its rows and these part less than a grid line
    before the shorter one's end: a later turn, or the same one answered again), else one of
    these rows' own."""
    if session is not None:
        return session_digest(session)
    tokens = [int(t) for t in token_ids]
    best, best_n = None, 0
    for m in entries.values():
        if m.namespace != namespace:
            continue
        n = common_prefix(m.token_ids, tokens)
        if n > best_n and n >= min(len(m.token_ids), len(tokens)) - grid:
            best, best_n = m.session, n
    if best is not None:
        return best
    digest = hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()
    return session_digest("rows:" + digest)


def record_meta(record: EndRecord | None, length: int) -> dict | None:
    """An end record as the end's JSON metadata (its rows are the entry's tokens up to it)."""
    if record is None or len(record.rows) != length:
        return None
    return {"hidden": [list(h) for h in record.hidden],
            "regions": [[r.start, r.think_close, r.stop, r.closed_by_call]
                        for r in record.regions]}


def meta_record(meta: Any, rows: Sequence[int]) -> EndRecord | None:
    """The end record back from an entry's end metadata; None when there is none or it does not
    describe ``rows`` (a foreign or damaged field costs the alignment, never a wrong one)."""
    if not isinstance(meta, dict):
        return None
    try:
        return EndRecord(list(rows), [tuple(h) for h in meta.get("hidden", [])],
                         [Region(int(a), None if b is None else int(b), int(c), bool(d))
                          for a, b, c, d in meta.get("regions", [])])
    except (TypeError, ValueError):
        return None


def slot_entry(holdings: Any, state: Any, token_ids: Sequence[int], length: int,
               taint: int | None, grid: int, entries: Mapping[str, Any]) -> SlotEntry | None:
    """The conversation in a slot as an entry (``entries``: the spill's, which a conversation
    without a session key is matched against): None when it holds no row."""
    if length <= 0:
        return None
    tokens = [int(t) for t in token_ids[:length]]
    namespace = holdings.namespace
    # The session key the server hashed (never the client's text): the next start gives the
    # slot it reads the entry into back to that session, so its next turn is placed there.
    meta = EntryMeta(entry_session(holdings.session, tokens, namespace, entries, grid), namespace,
                     taint=taint if taint is not None and taint < length else None,
                     extra={"session": holdings.session} if holdings.session else None)
    anchors = {line: copy for line, copy in holdings.anchors.copies.items() if line <= length}
    end = None
    e = holdings.ends.end
    if e is not None and 0 < e.length <= length:
        record = None
        records = holdings.records
        if records is not None:
            record = records.end_record(e, namespace, namespace)
        end = SpillEnd(e.length, dict(e.copy.tensors), record_meta(record, e.length))
    return SlotEntry(meta.entry_id, state, length, tokens, anchors, end, meta)


def weigh(offer: SpillOffer | None, start: int, prompt_len: int, chunk: int,
          prefill_rate: float, restore_rate: float,
          other: int = 0) -> tuple[bool, NotServed | None]:
    """Whether the entry is worth reading for a prompt the tiers in RAM resume at ``start``
    and another tier off RAM (the disk's files) at ``other``: it resumes more than a chunk
    past RAM and past the other, and its read costs less than the prefill it saves over the
    better of the two. The second value says why an entry that shares more than a chunk past
    RAM does not serve."""
    if offer is None or offer.matched <= start + chunk:
        return False, None
    if offer.line <= start + chunk:
        why: NotServed = ("end_no_align" if offer.end_length is not None
                          and not offer.end_reached and offer.matched >= offer.end_length - chunk
                          else "anchors_below")
        return False, why
    if offer.line >= prompt_len:
        # Nothing would be left to forward (the first token needs the last one's logits):
        # the prompt ends where the entry would resume.
        return False, "short"
    beyond = max(start, other)
    if offer.line <= beyond:
        return False, "anchors_below"
    read_s = offer.read_nbytes / max(restore_rate, 1.0)
    saved_s = (offer.line - beyond) / max(prefill_rate, 1.0)
    if read_s >= saved_s:
        return False, "slow"
    return True, None


def align_offer(spill: Any, prompt: list[int], namespace: Namespace,
                align: Callable[[EndRecord, list[int]], Alignment | None]
                ) -> tuple[SpillOffer | None, Alignment | None]:
    """The spill's best offer for the client's copy: as it came, or, when the copy parts from an
    entry before its end, aligned on that entry's own tokens, end and regions (a copy without
    its reasoning or hidden spans resumes at the entry's end, as in RAM)."""
    offer = spill.offer(prompt, namespace)
    if offer is None or offer.end_reached or offer.end_length is None:
        return offer, None
    rows = spill.token_ids(offer.entry_id)
    if rows is None:
        return offer, None
    record = meta_record(offer.end_meta, rows[:offer.end_length])
    if record is None:
        return offer, None
    alignment = align(record, prompt)
    if alignment is None:
        return offer, None
    again = spill.offer(alignment.served, namespace)
    if again is None or again.entry_id != offer.entry_id or not again.end_reached:
        return offer, None
    return again, alignment


def adopt_entry(holdings: Any, engine: Any, report: Any, session: str | None,
                namespace: Namespace, in_place: int, *, end_anchor: bool = True) -> None:
    """On the engine thread, after ``SessionSpill.restore`` wrote the entry's rows and the
    sections at ``report.line`` into the slot: the engine resumes there, the slot's anchors are
    the entry's at or below it, the end anchor (and its record) the entry's when the restore
    stopped at it. Rows below ``in_place`` stayed (their taint is the engine's)."""
    state = engine.cache_state()
    taints = [t for t in (report.taint,
                          engine.taint if engine.taint is not None and engine.taint < in_place
                          else None) if t is not None]
    # Anchors over the rows both share stay, no higher than either side's taint (an anchor
    # over decoded rows would pass for a cold prefill's), as an outside restore's adopt does.
    keep = min([in_place, report.line] + [t for t in (engine.taint, report.taint)
                                          if t is not None])
    holdings.anchors.drop_above(keep)
    holdings.ends.drop_end()
    holdings.ends.prompt_end = None
    engine.resume_at(report.line, report.token_ids, taint=min(taints, default=None))
    for line, copy in sorted(report.anchors.items()):
        if line <= report.line and line not in holdings.anchors:
            holdings.anchors.add(line, copy)
    holdings.session = session
    holdings.namespace = namespace
    end = report.end
    if end is not None and end.length == report.line and end_anchor:
        holdings.ends.adopt_buffer(end.length, SectionsCopy(dict(end.sections)), state)
        records = holdings.records
        record = meta_record(end.meta, report.token_ids[:end.length])
        if records is not None and record is not None:
            records.adopt(record, namespace)
