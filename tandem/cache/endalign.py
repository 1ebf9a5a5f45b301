"""The end alignment: does a client's copy of a conversation continue the rows at the end anchor?

The engine's rows up to the end anchor are the last request's prompt followed by what the model
generated. The client sends the conversation back as text, which tandem's template renders and
the tokenizer encodes again, so the copy parts from the rows inside the answer:

* re-tokenising text rarely reproduces the generated token boundaries;
* opencode re-serialises a tool call's JSON compactly (``{"a":"b"}`` for ``{"a": "b"}``) and
  the template trims the reasoning and the content;
* tokens the server forced into the rows and never showed (a reasoning budget's hidden close
  phrase: the record's *hidden spans*) are missing from the copy, and the template's whitespace
  next to them is not the rows';
* Open WebUI sends an answer back without its reasoning, which the template renders as
  ``<think>\\n\\n</think>\\n\\n`` + the answer.

:func:`align` tries, in order:

``exact``
    the prompt starts with every row: it is served as it is.
``glue``
    the non-whitespace bytes of the rows, the hidden spans left out, are the start of the
    prompt's non-whitespace bytes, and that match ends at a prompt token boundary.
``calls``
    the glue, with every tool call (``<tool_call>`` ... ``</tool_call>``, in either form) compared
    by its parsed value (:func:`tandem.models.toolcalls.call_value`) rather than its bytes: a
    Qwen3.5 template renders a call the model wrote as ``<parameter=force>\\ntrue`` back as
    ``True`` (Python's spelling of the client's JSON ``true``), a number ``5.0`` as ``5``, a
    JSON escape as its character; the rows' call and the copy's are the same call.
``reasoning``
    the same, with the reasoning of a generation region (rows ``[start, think_close)``) left out
    where the copy does not hold it; the ``<think>`` and ``</think>`` tags are special tokens whose
    bytes are their text and must still match, as must every other non-whitespace byte.

A generation that called a tool from inside its unclosed reasoning (Qwen3.5 does) has no
``</think>`` in the rows, and the template writes one before the call when it renders the answer
back: the region's ``think_close`` is then its ``<tool_call>`` row (``closed_by_call``), before
which the rows read as holding ``</think>``.

A generation that thought and never closed its reasoning (``max_tokens`` or a client's stop
came first) wrote nothing but reasoning: its whole region is left out where the copy lacks it
(Open WebUI sends such an answer back as an empty message, ``<think>\\n\\n</think>\\n\\n``).
The copy's ``</think>`` then follows the rows, and the whitespace before it is served as the
template writes it after a reasoning (one ``\\n``), so that the prompt is the one the template
renders for a client that sends the cut reasoning back.

When the copy aligns, the engine is served the rows' own tokens up to the end anchor (the
context it had, hidden tokens and reasoning included) followed by the prompt's tokens after the
matched part: ``served = record.rows + prompt[cut:]``.

Pure: no torch, no asyncio. The per-record byte streams are computed once, lazily, and cached
on the record (and carried forward by :meth:`EndRecord.extend`), so a 100k-token record aligns
in tens of milliseconds.
"""

from __future__ import annotations

import codecs
import json
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from tandem.models.toolcalls import call_value
from tandem.tokens import common_prefix

WHITESPACE = b" \t\n\r"
"""The bytes the alignment ignores (what the template's trims and JSON re-spelling change)."""

THINK_CLOSE_ID = 248069
"""``</think>`` in the Qwen3.5/3.6 vocabulary."""
THINK_OPEN_ID = 248068
"""``<think>`` in the Qwen3.5/3.6 vocabulary."""
CALL_OPEN_ID = 248058
"""``<tool_call>`` in the Qwen3.5/3.6 vocabulary."""
CALL_OPEN = b"<tool_call>"
CALL_CLOSE = b"</tool_call>"
THINK_CLOSE = b"</think>"

TokenBytes = Callable[[int], "bytes | None"]
# ``split(token_id, rest)``: the tokens of ``rest``, the bytes of the copy's token ``token_id``
# after the rows end inside it, or None where they cannot stand for it (a special token, bytes
# that are no text).
SplitToken = Callable[[int, bytes], "list[int] | None"]


def token_splitter(encode_text: Callable[[str], list[int]],
                   special_ids: Iterable[int]) -> SplitToken:
    """The ``split`` of a tokenizer: an ordinary token's rest encoded as text."""
    specials = frozenset(special_ids)

    def split(token_id: int, rest: bytes) -> list[int] | None:
        if token_id in specials:
            return None
        try:
            text = rest.decode("utf-8")
        except UnicodeDecodeError:
            return None  # the rows end inside a character
        return list(encode_text(text))

    return split
Mode = Literal["exact", "glue", "calls", "reasoning"]


@dataclass(frozen=True)
class Region:
    """One generation in row positions: ``start`` the first generated row, ``think_close`` the
    row of its first ``</think>`` (None: the generation never closed its reasoning), ``stop``
    one past its last row. ``closed_by_call``: the generation, thinking, wrote a
    ``<tool_call>`` before any ``</think>``; ``think_close`` is that call's row, where the
    rendered copy has a ``</think>`` the rows lack."""

    start: int
    think_close: int | None
    stop: int
    closed_by_call: bool = False

    @classmethod
    def of_generation(cls, start: int, generated: Sequence[int],
                      think_close_id: int = THINK_CLOSE_ID, *, thinking: bool = False,
                      call_open_id: int = CALL_OPEN_ID) -> Region:
        """The region of ``generated`` (the tokens of one generation that are in the rows)
        written from row ``start`` on; ``thinking``: it began inside an open ``<think>``."""
        generated = list(generated)
        close = generated.index(think_close_id) if think_close_id in generated else None
        if thinking and call_open_id in generated:
            call = generated.index(call_open_id)
            if close is None or call < close:
                return cls(start, start + call, start + len(generated), True)
        return cls(start, None if close is None else start + close, start + len(generated))

    def shifted(self, by: int) -> Region:
        return Region(self.start + by, None if self.think_close is None else self.think_close + by,
                      self.stop + by, self.closed_by_call)


@dataclass
class _Side:
    """Rows as non-whitespace bytes: ``nonws`` each row's, ``offsets[i]`` where row i's start
    (``offsets[len(nonws)] == len(data)``), ``data`` the concatenation."""

    nonws: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])
    data: bytes = b""

    def extend(self, tail: list[bytes]) -> None:
        ends = accumulate(map(len, tail), initial=self.offsets[-1])
        next(ends)  # the first is the last offset already in
        self.nonws.extend(tail)
        self.offsets.extend(ends)
        self.data = self.data + b"".join(tail)

    def copy(self) -> "_Side":
        return _Side(list(self.nonws), list(self.offsets), self.data)


def _decoder(state: tuple[bytes, int], errors: str = "strict") -> codecs.IncrementalDecoder:
    d = codecs.getincrementaldecoder("utf-8")(errors=errors)
    d.setstate(state)
    return d


@dataclass
class _Streams:
    """A record's rows as non-whitespace bytes, the view ``align`` reads (``nonws``,
    ``offsets``, ``data``: the rows' own bytes, or where those are not UTF-8, as a client
    received them), built row by row as the record grows: ``raw`` the rows'
    own, ``shown`` each row's share of an incremental UTF-8 decoder's output (U+FFFD for what
    it could not decode, without the final flush), ``strict`` the strict decoder's state after
    the rows (None once their bytes are not UTF-8), ``lenient`` the replacing one's.

    ``shown`` covers the first ``shown_rows`` of ``ids`` (the rows so far) and is caught up
    only when it is read: rows that are UTF-8 with every character whole read ``raw``, and
    decoding each row's bytes again, one row at a time, was a third of a 16k-token record's
    streams (which the loop builds when a new prompt is offered against a record)."""

    tb: TokenBytes
    cache: dict[int, bytes]
    raw: _Side = field(default_factory=_Side)
    shown: _Side = field(default_factory=_Side)
    strict: tuple[bytes, int] | None = (b"", 0)
    lenient: tuple[bytes, int] = (b"", 0)
    nonws: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])
    data: bytes = b""
    ids: list[int] = field(default_factory=list)
    shown_rows: int = 0
    raw_of: dict[int, bytes] = field(default_factory=dict)  # a token's bytes, as ``cache``

    def copy(self) -> "_Streams":
        return _Streams(self.tb, self.cache, self.raw.copy(), self.shown.copy(), self.strict,
                        self.lenient, self.nonws, self.offsets, self.data, list(self.ids),
                        self.shown_rows, self.raw_of)

    def grow(self, ids: Sequence[int]) -> None:
        """Rows ``ids`` after those in: the work is theirs alone, not the whole record's.
        Each distinct token's bytes are asked for once (a 17k-token record holds a few
        thousand): the loop builds a new record's streams when a prompt is first offered
        against it, on that request's way to its first token."""
        tb, raw_of, cache = self.tb, self.raw_of, self.cache
        for t in set(ids).difference(raw_of):
            b = raw_of[t] = tb(t) or b""
            cache[t] = b.translate(None, WHITESPACE)  # as _nonws_list keeps them
        raw = [raw_of[t] for t in ids]
        nonws = [cache[t] for t in ids]
        self.ids.extend(ids)
        self.raw.extend(nonws)
        if self.strict is not None:
            strict = _decoder(self.strict)
            try:
                strict.decode(b"".join(raw))
                self.strict = strict.getstate()
            except UnicodeDecodeError:
                self.strict = None
        if self.strict is not None and not self.strict[0]:  # UTF-8, every character whole
            self.nonws, self.offsets, self.data = self.raw.nonws, self.raw.offsets, self.raw.data
            return
        lenient = _decoder(self.lenient, "replace")
        behind = self.ids[self.shown_rows:]
        behind_raw = raw if len(behind) == len(raw) else [raw_of[t] for t in behind]
        self.shown.extend([lenient.decode(b).encode("utf-8").translate(None, WHITESPACE)
                           for b in behind_raw])
        self.lenient, self.shown_rows = lenient.getstate(), len(self.ids)
        flush = lenient.decode(b"", final=True).encode("utf-8").translate(None, WHITESPACE)
        shown = self.shown
        if not flush or not shown.nonws:
            self.nonws, self.offsets, self.data = shown.nonws, shown.offsets, shown.data
            return
        self.nonws = shown.nonws[:-1] + [shown.nonws[-1] + flush]
        self.offsets = shown.offsets[:-1] + [shown.offsets[-1] + len(flush)]
        self.data = shown.data + flush


@dataclass
class EndRecord:
    """What the server keeps beside the end anchor: ``rows`` the token ids in place up to it,
    ``hidden`` the spans ``[start, stop)`` of tokens the server forced in and the client never
    saw, ``regions`` every generation in those rows (a conversation's accumulate turn after
    turn). Treat as immutable: :meth:`extend` and :meth:`after_turn` return new records."""

    rows: list[int]
    hidden: list[tuple[int, int]] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    _streams: _Streams | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rows = list(self.rows)
        self.hidden = sorted((int(a), int(b)) for a, b in self.hidden if b > a)
        self.regions = sorted(self.regions, key=lambda r: r.start)
        n = len(self.rows)
        for a, b in self.hidden:
            if not 0 <= a < b <= n:
                raise ValueError(f"hidden span [{a}, {b}) is outside the {n} rows")
        for r in self.regions:
            if not 0 <= r.start <= r.stop <= n or (
                    r.think_close is not None and not r.start <= r.think_close < r.stop):
                raise ValueError(f"{r} is outside the {n} rows")

    @property
    def hidden_tokens(self) -> int:
        return sum(b - a for a, b in self.hidden)

    def extend(self, new_rows_tail: Sequence[int], new_region: Region | None = None,
               new_hidden: Iterable[tuple[int, int]] = ()) -> EndRecord:
        """The record of the next end anchor when a turn resumed at this one: these rows, then
        ``new_rows_tail`` (what the turn forwarded and generated). ``new_region`` and
        ``new_hidden`` are in row positions of the new record (the new generation starts at or
        after ``len(self.rows)``). The old spans and regions are kept; the byte streams already
        computed are carried forward."""
        rec = EndRecord(self.rows + list(new_rows_tail), self.hidden + list(new_hidden),
                        self.regions + ([new_region] if new_region is not None else []))
        if self._streams is not None:
            rec._streams = self._streams.copy()
        return rec

    @classmethod
    def after_turn(cls, previous: EndRecord | None, served: Sequence[int],
                   generated: Sequence[int], *, hidden_in_generated: Iterable[int] = (),
                   think_close_id: int = THINK_CLOSE_ID,
                   served_hidden: Iterable[tuple[int, int]] = ()) -> EndRecord:
        """The record of a turn's end anchor. ``served``: the prompt the engine ran;
        ``generated``: the generated tokens that are in the rows (the last one is not when the
        generation ended by its length); ``hidden_in_generated``: positions in ``generated`` the
        server forced and hid (:attr:`ReasoningBudget.hidden_positions`); ``served_hidden``:
        spans of ``served`` the server put in that the client never sent (a router's note).

        When ``served`` starts with the previous record's rows (an exact or aligned resume) the
        previous spans and regions are kept; otherwise those wholly inside the prefix the two
        share are kept."""
        served = list(served)
        generated = list(generated)
        start = len(served)
        # A turn with no generated row in the rows (max_tokens 1: its one token is not in
        # them) has an empty region, which says nothing: it is left out, or a prompt sent
        # again and again would grow its record by one region a request.
        region = (Region.of_generation(start, generated, think_close_id,
                                       thinking=_opens_reasoning(served, think_close_id))
                  if generated else None)
        new = [region] if region is not None else []
        hidden = list(served_hidden) + _runs(start + p for p in hidden_in_generated)
        if previous is not None:
            n = len(previous.rows)
            if len(served) >= n and served[:n] == previous.rows:
                return previous.extend(served[n:] + generated, region,
                                       [h for h in hidden if h[0] >= n])
            shared = common_prefix(previous.rows, served)
            hidden = [h for h in previous.hidden if h[1] <= shared] + [
                h for h in hidden if h[1] > shared]
            regions = [r for r in previous.regions if r.stop <= shared]
            return cls(served + generated, hidden, regions + new)
        return cls(served + generated, hidden, new)

    # -- the byte streams -----------------------------------------------------------------

    def streams(self, token_bytes: TokenBytes) -> _Streams:
        s = self._streams
        if s is None or s.tb != token_bytes:
            s = _Streams(token_bytes, {})
        if len(s.raw.nonws) < len(self.rows):
            s.grow(self.rows[len(s.raw.nonws):])
        self._streams = s
        return s


@dataclass(frozen=True)
class Alignment:
    """``served``: the prompt the engine runs, ``record.rows + prompt[cut:]`` (with, where the
    rows end inside a token of the copy, the tokens of that token's rest between them);
    ``cut``: where the client's prompt goes on after the rows; ``mode``: the pass that aligned
    it;
    ``replayed_hidden``: hidden tokens served that the copy lacked; ``replayed_reasoning``:
    reasoning tokens (not hidden) served that the copy lacked."""

    served: list[int]
    cut: int
    mode: Mode
    replayed_hidden: int = 0
    replayed_reasoning: int = 0


def align(record: EndRecord, prompt: Sequence[int], token_bytes: TokenBytes, *,
          allow_glue: bool = True, allow_reasoning: bool = True,
          split: SplitToken | None = None) -> Alignment | None:
    """Whether ``prompt`` (the client's copy, tokenized) continues ``record``'s rows, and the
    prompt to serve so that the engine resumes at the end anchor; None when no pass aligns it.
    ``token_bytes(id)``: a token's bytes (a special token's text; None counts as no bytes).
    ``allow_glue``/``allow_reasoning``: off switches for the second and third pass.
    ``split``: where the rows end inside a token of the copy (an answer cut by ``max_tokens``
    inside a word: the rows end ` besondere`, the copy reads ` besonder` `el` `icas`), that
    token's rest re-encoded is served after the rows; None: such a copy does not align."""
    rows = record.rows
    n = len(rows)
    prompt = prompt if isinstance(prompt, list) else list(prompt)
    d = common_prefix(rows, prompt)
    if d == n:
        return Alignment(rows + prompt[n:], n, "exact")
    if not allow_glue:
        return None
    streams = record.streams(token_bytes)
    calls = CALL_OPEN in streams.nonws[max(0, _call_start(streams.nonws, d)):]
    passes = [(False, False)] + ([(False, True)] if calls else [])
    if allow_reasoning and (any(r.think_close is not None for r in record.regions)
                            or _unclosed(record)):
        passes += [(True, False)] + ([(True, True)] if calls else [])
    for reasoning_pass, values in passes:
        found = _align_pass(record, streams, prompt, d, token_bytes, reasoning=reasoning_pass,
                            values=values, split=split)
        if found is not None:
            cut, hidden, reasoning, rest = found
            mode: Mode = "reasoning" if reasoning else "calls" if values else "glue"
            return Alignment(rows + rest + prompt[cut:], cut, mode, hidden, reasoning)
    return None


# ---------------------------------------------------------------------------------------------


def _may_start_with(prompt: list[int], s: int, chunk: bytes, cache: dict[int, bytes],
                    token_bytes: TokenBytes, probe: int = 64) -> bool:
    """False when ``prompt[s:]``'s non-whitespace bytes cannot start with ``chunk``: their first
    bytes, up to ``probe`` of them, read a few tokens at a time, already differ from its
    first. A copy of another conversation (placement asks every slot's end, a 16k-token
    prompt against each) is then refused without its whole stream: on a warm 16k request
    the streams of the other slots' prompts took a third of the event loop's time."""
    want = chunk[:probe]
    got = b""
    at, step = s, 8
    while len(got) < len(want) and at < len(prompt):
        got += b"".join(_nonws_list(prompt[at:at + step], cache, token_bytes))
        at, step = at + step, step * 2
    m = min(len(got), len(want))
    return got[:m] == want[:m]


def _nonws_list(ids: Sequence[int], cache: dict[int, bytes], token_bytes: TokenBytes) -> list[bytes]:
    get = cache.get
    out = [get(t) for t in ids]
    if None in out:
        for i, b in enumerate(out):
            if b is None:
                t = ids[i]
                b = get(t)
                if b is None:
                    b = cache[t] = (token_bytes(t) or b"").translate(None, WHITESPACE)
                out[i] = b
    return out


def _unclosed(record: EndRecord) -> list[Region]:
    """The regions that began inside an open ``<think>`` and wrote no ``</think>`` and no call:
    every row of theirs is reasoning."""
    rows = record.rows
    return [r for r in record.regions
            if r.think_close is None and not r.closed_by_call and r.stop > r.start
            and _opens_reasoning(rows[max(0, r.start - 4):r.start], THINK_CLOSE_ID)]


def _opens_reasoning(served: Sequence[int], think_close_id: int) -> bool:
    """Whether a prompt ends inside an open ``<think>`` (its last think tag, among the last
    few tokens, is ``<think>``): the generation after it starts with reasoning."""
    for t in reversed(served[-4:]):
        if t == think_close_id:
            return False
        if t == THINK_OPEN_ID:
            return True
    return False


def _call_start(nonws: Sequence[bytes], s: int) -> int:
    """The row of the ``<tool_call>`` that row ``s`` is inside (its ``</tool_call>`` not
    before ``s``), else ``s``: a call is compared whole, from its opening tag."""
    for i in range(min(s, len(nonws)) - 1, -1, -1):
        b = nonws[i]
        if b == CALL_CLOSE:
            return s
        if b == CALL_OPEN:
            return i
    return s


def _call_values(ids: Sequence[int], nonws: Sequence[bytes],
                 token_bytes: TokenBytes) -> dict[int, bytes]:
    """The bytes to compare in place of each whole tool call in ``ids``: the opening tag and
    the body nothing, the closing tag the call's value (name and arguments, JSON with sorted
    keys); a call that does not parse keeps its bytes."""
    out: dict[int, bytes] = {}
    opened: int | None = None
    for k, b in enumerate(nonws):
        if b == CALL_OPEN:
            opened = k
        elif b == CALL_CLOSE and opened is not None:
            body = b"".join(token_bytes(t) or b"" for t in ids[opened + 1:k])
            value = call_value(body.decode("utf-8", errors="replace"))
            if value is not None:
                for j in range(opened, k):
                    out[j] = b""
                out[k] = b"\x00call" + json.dumps(value, sort_keys=True,
                                                   ensure_ascii=False).encode() + b"\x00"
            opened = None
    return out


def _runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted positions as [start, stop) runs."""
    spans: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def _align_pass(record: EndRecord, streams: _Streams, prompt: list[int], d: int,
                token_bytes: TokenBytes, reasoning: bool, values: bool = False,
                split: SplitToken | None = None
                ) -> tuple[int, int, int, list[int]] | None:
    """One byte-stream pass; (cut, hidden tokens replayed, reasoning tokens replayed, the
    tokens served between the rows and ``prompt[cut:]``) or None. ``values``: tool calls
    compared by value (the ``calls`` pass); ``split``: as for :func:`align`.

    Rows ``[0, s)`` are the prompt's own tokens (s at most the first differing token), so spans
    and regions wholly before ``s`` are in the copy as they are, and only the streams from ``s``
    on are compared."""
    rows = record.rows
    n = len(rows)
    hidden = [(a, b) for a, b in record.hidden if b > d]
    thinks = [(r.start, r.think_close) for r in record.regions
              if reasoning and r.think_close is not None and r.think_close > d
              and r.think_close > r.start]
    open_end = None  # the start of an unclosed reasoning the rows end in
    if reasoning:
        for r in _unclosed(record):
            if r.stop > d:
                thinks.append((r.start, r.stop))
                if r.stop == n:
                    open_end = r.start
        thinks.sort()
    s = min([d] + [a for a, _ in hidden] + [a for a, _ in thinks])
    if values:
        s = _call_start(streams.nonws, s)
    off, data = streams.offsets, streams.data
    # Rows where the copy renders a </think> the rows lack (a call made while thinking).
    implied = {r.think_close for r in record.regions
               if r.closed_by_call and r.think_close is not None and r.think_close >= s}
    swapped = (_call_values(rows[s:], streams.nonws[s:], token_bytes) if values else {})
    swapped = {s + k: v for k, v in swapped.items()}

    def chunk_of(a: int, b: int) -> bytes:
        head = THINK_CLOSE if a in implied else b""
        if not swapped:
            return head + data[off[a]:off[b]]
        nonws = streams.nonws
        return head + b"".join(swapped.get(i, nonws[i]) for i in range(a, b))

    # The rows from s as pieces: (region index or -1, start row, stop row), hidden rows left out.
    cuts = {s, n} | implied
    for a, b in hidden + thinks:
        cuts.add(a)
        cuts.add(b)
    points = sorted(cuts)
    parts: list[tuple[int, list[bytes], int]] = []  # (think index or -1, bytes, rows)
    replay_hidden = sum(b - a for a, b in hidden)
    for a, b in zip(points, points[1:]):
        if any(h0 <= a and b <= h1 for h0, h1 in hidden):
            continue
        tag = next((i for i, (t0, t1) in enumerate(thinks) if t0 <= a and b <= t1), -1)
        chunk = chunk_of(a, b)
        if parts and parts[-1][0] == tag:
            parts[-1][1].append(chunk)
            parts[-1] = (tag, parts[-1][1], parts[-1][2] + (b - a))
        else:
            parts.append((tag, [chunk], b - a))
    pieces = [(tag, b"".join(chunks), count) for tag, chunks, count in parts]
    if not values and pieces and pieces[0][0] < 0 and pieces[0][1] \
            and not _may_start_with(prompt, s, pieces[0][1], streams.cache, token_bytes):
        return None  # the copy parts from the rows at once: its whole byte stream unread

    tail = _nonws_list(prompt[s:], streams.cache, token_bytes)
    if values:
        for k, v in _call_values(prompt[s:], tail, token_bytes).items():
            tail[k] = v
    pdata = b"".join(tail)
    pos = 0
    replay_reasoning = 0
    left_out = False  # the last piece is reasoning the copy left out
    for tag, chunk, count in pieces:
        left_out = False
        if pdata.startswith(chunk, pos):
            pos += len(chunk)
        elif tag >= 0:
            replay_reasoning += count  # the copy leaves this region's reasoning out
            left_out = True
        else:
            return None
    if reasoning and replay_reasoning == 0:
        return None  # the glue pass has said so already
    if left_out and open_end is not None and thinks[pieces[-1][0]][0] == open_end:
        # The rows end in a reasoning the copy left out: the copy must close its empty think
        # block right there (a copy whose reasoning differs is not this conversation).
        if not pdata.startswith(THINK_CLOSE, pos):
            return None
        if streams.nonws[n - 1]:
            closed = _close_after(rows, prompt, s, pos, open_end, streams.cache, token_bytes,
                                  split)
            if closed is not None:
                return closed[0], replay_hidden, replay_reasoning, closed[1]
    # The match must end at a prompt token boundary, or inside a token whose rest ``split``
    # re-encodes.
    if pos == 0:
        cut = s
    else:
        cum = list(accumulate(map(len, tail)))
        k = bisect_left(cum, pos)
        cut = s + k + 1
        if cum[k] != pos:
            rest = _rest_of(prompt[s + k], pos - (cum[k] - len(tail[k])), token_bytes, split)
            if rest is None:
                return None
            return cut, replay_hidden, replay_reasoning, rest
    # Whitespace-only tokens the rows end with: the copy's same whitespace is not served twice.
    trail = bytearray()
    i = n
    while i > s and not streams.nonws[i - 1]:
        i -= 1
    for t in rows[i:]:
        trail += token_bytes(t) or b""
    have = bytearray()
    while cut < len(prompt) and trail:
        t = prompt[cut]
        raw = token_bytes(t) or b""
        if raw.translate(None, WHITESPACE) or not bytes(trail).startswith(bytes(have + raw)):
            break
        have += raw
        cut += 1
    return cut, replay_hidden, replay_reasoning, []


def _close_after(rows: list[int], prompt: list[int], s: int, pos: int, start: int,
                 cache: dict[int, bytes], token_bytes: TokenBytes,
                 split: SplitToken | None) -> tuple[int, list[int]] | None:
    """Where the rows end inside a reasoning the copy left out (it begins at row ``start``,
    after ``<think>`` and whitespace) and the copy goes on, after ``pos`` of its
    non-whitespace bytes from ``s`` (its ``<think>``), with whitespace and ``</think>``: (the
    copy's ``</think>`` token, the tokens of the whitespace served before it). The template
    writes ``<think>\\n`` + the reasoning + ``\\n</think>``; the copy's whitespace there also
    holds what the rows have between ``<think>`` and ``start``, so that much of it is left
    out. None where the copy does not go on so, or ``split`` cannot encode the rest (the
    copy's whitespace is served as it is then)."""
    k = start
    while k > 0 and not _nonws_list((rows[k - 1],), cache, token_bytes)[0]:
        k -= 1
    if k == 0 or rows[k - 1] != THINK_OPEN_ID:
        return None
    cut, seen = s, 0
    while seen < pos:  # the copy's token after its last matched byte, its <think>
        seen += len(_nonws_list((prompt[cut],), cache, token_bytes)[0])
        cut += 1
    if seen != pos or cut == 0 or prompt[cut - 1] != THINK_OPEN_ID:
        return None
    j = cut
    while j < len(prompt) and not _nonws_list((prompt[j],), cache, token_bytes)[0]:
        j += 1
    if j == len(prompt) or (token_bytes(prompt[j]) or b"") != THINK_CLOSE:
        return None
    have = b"".join(token_bytes(t) or b"" for t in rows[k:start])
    copy_ws = b"".join(token_bytes(t) or b"" for t in prompt[cut:j])
    if not copy_ws.startswith(have):
        return None
    rest = copy_ws[len(have):]
    if not rest:
        return j, []
    if split is None:
        return None
    tokens = split(prompt[cut], rest)
    return (j, tokens) if tokens else None


def _rest_of(token_id: int, matched: int, token_bytes: TokenBytes,
             split: SplitToken | None) -> list[int] | None:
    """The tokens of a copy's token after its first ``matched`` non-whitespace bytes (the rows
    end there), or None when ``split`` cannot make them."""
    if split is None:
        return None
    raw = token_bytes(token_id) or b""
    i = seen = 0
    while seen < matched:
        if raw[i] not in WHITESPACE:
            seen += 1
        i += 1
    rest = split(token_id, raw[i:])
    return rest if rest else None
