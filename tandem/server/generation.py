"""One request's generation seen from the server: ask the engine, read its events, turn tokens
into text, cut at stop strings, notice a client that left, and account for it all once.

    run = Run(state, request, route="chat", prompt_ids=ids, params=params, stops=["\\n\\n"])
    await run.start()                 # 503 when the engine will not take it
    try:
        async for text in run.texts(): ...
    finally:
        run.close(status)             # cancels an unfinished generation, writes the journal row
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from aiohttp import web

from tandem.actors import ActorStopped, MailboxFull
from tandem.actors.engine_messages import (
    CancelGeneration,
    Generate,
    GenerationFailed,
    GenerationFinished,
    GenerationParams,
    GenerationRejected,
    GenerationStarted,
    PrefillAdmitted,
    PromptLogprobs,
    PromptMarks,
    TokenGenerated,
)
from tandem.cache.namespace import namespace_of
from tandem.cache.vocabulary import Source, tier_of
from tandem.cache.response import CachedResponse
from tandem.logprobs import TokenLogprob
from tandem.server.errors import ApiError
from tandem.server.journal import RequestRow
from tandem.server.state import ServerState

log = structlog.get_logger("tandem.server")

CANCEL_WAIT_S = 30.0  # after a stop string: how long the engine may take to reach a token
CLIENT_GONE = 499  # the status a journal row records for a client that left (nginx's)


class ClientGone(Exception):
    """The client closed its connection; the generation is cancelled."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class StopStrings:
    """Cuts generated text at the first stop string, holding back an end that may begin one.

    Incremental, so that a token costs the length of its delta per stop string, never a stop's
    length squared: each stop string has a KMP automaton whose state is the longest end of the
    text so far that begins it (the part to hold back), and only the text not yet emitted is
    kept. No stop string can begin in the emitted text (it never ends in a beginning of one),
    so a full match is looked for in the kept text alone, from where a match that ends in the
    new delta can start.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)  # per stop: its longest beginning the text ends with
        self._pending = ""  # what is held back, not yet emitted
        self.matched = False

    def feed(self, delta: str) -> str:
        if self.matched:
            return ""  # nothing after a stop string is ever emitted
        if not self.stops:
            return delta
        old = len(self._pending)
        pending = self._pending + delta
        cut = -1
        for s in self.stops:
            i = pending.find(s, max(0, old - len(s) + 1))
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.matched = True
            self._pending = ""
            return pending[:cut]
        hold = 0
        for k, s in enumerate(self.stops):
            self._state[k] = _advance(s, self._fail[k], self._state[k], delta)
            hold = max(hold, self._state[k])
        keep = len(pending) - min(hold, len(pending))
        self._pending = pending[keep:]
        return pending[:keep]

    def flush(self) -> str:
        if self.matched:
            return ""
        out, self._pending = self._pending, ""
        return out


def _failure(s: str) -> list[int]:
    """KMP's failure function: for each i, the length of the longest proper beginning of
    s[:i + 1] that is also its end."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def _advance(s: str, fail: list[int], state: int, text: str) -> int:
    """The automaton's state after ``text``: the longest end of everything read that begins s
    (a full match falls back to its longest proper border; the caller has cut before that)."""
    for c in text:
        while state and s[state] != c:
            state = fail[state - 1]
        if s[state] == c:
            state += 1
        if state == len(s):
            state = fail[state - 1]
    return state


class Run:
    def __init__(self, state: ServerState, request: web.Request, *, route: str, request_id: str,
                 prompt_ids: list[int], params: GenerationParams, stops: list[str],
                 session: str | None, arrived_s: float, cache_salt: str | None = None,
                 marks: PromptMarks | None = None, side: bool = False,
                 images: Any = None,
                 client_prompt_tokens: int | None = None, compaction: dict | None = None,
                 prepared: Any = None, head_parts: tuple[int, int] | None = None,
                 n: int = 1) -> None:
        self.state = state
        self.n = n  # choices (tandem/server/choices.py reads more than one)
        self.marks = marks  # a chat prompt's parts, for the disk tier's head
        self.side = side  # a side request (tandem/server/side.py)
        self.request = request
        self.route = route
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        # A compaction's continuation (tandem/server/compaction.py) runs other ids than the
        # client's prompt: usage counts the client's, and what was forwarded against it.
        self.client_prompt_tokens = (len(prompt_ids) if client_prompt_tokens is None
                                     else client_prompt_tokens)
        self.compaction = compaction  # how a compaction request was served (None: not one)
        # The compaction preparer's summary that answers it (tandem.cache.prepared).
        self.prepared = prepared
        # A chat prompt's leading system and tools tokens (the usage split); None: a text prompt.
        self.head_parts = head_parts
        # The chat's images (tandem.server.image_prompt.PromptImageSet): prompt_ids are then
        # its key ids; None: a prompt without images.
        self.images = images
        self.params = params
        self.session = session
        # Only the salt's digest is kept: the salt never reaches the engine, a log or the
        # journal.
        self.namespace = namespace_of(cache_salt)
        self.arrived_s = arrived_s
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._held: list = []  # events ``admitted`` read past, for ``texts``
        self._decoder = state.tokenizer.stream_decoder()
        self._stops = StopStrings(stops)
        self.started = False  # the engine accepted it
        self.ended = False  # the engine sent its last event
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.result: GenerationFinished | None = None
        self.ttft_ms: float | None = None
        # What the client was sent, for a recording: the visible token ids and text.
        self.token_ids: list[int] = []
        self.text = ""
        self._closed = False
        self._generated: list[tuple[int, bool]] = []  # every engine token, for the response cache
        self._generated_logprobs: list[TokenLogprob | None] = []  # theirs, for the same
        self.from_memory = False  # answered by the response cache, the engine never asked
        # With params.logprobs: the entry of each token in token_ids; ``take_logprobs`` hands
        # out the ones a stream has not sent yet.
        self.logprobs: list[TokenLogprob] = []
        self._logprobs_sent = 0
        # With params.prompt_logprobs: entry i scores prompt token i + 1 (PromptLogprobs).
        self.prompt_logprobs: list[TokenLogprob] | None = None

    # -- the engine ------------------------------------------------------------------------

    def _answer_from_memory(self) -> bool:
        """An identical greedy request answered before: its events, replayed into our queue."""
        cache = self.state.response_cache
        hit = None if cache is None else cache.lookup(self.prompt_ids, self.params,
                                                       self._stops.stops, self.namespace)
        if hit is None:
            return False
        put = self._events.put_nowait
        put(GenerationStarted(self.request_id, len(self.prompt_ids), 0.0))
        put(PrefillAdmitted(self.request_id))
        if hit.prompt_logprobs is not None:
            put(PromptLogprobs(self.request_id, list(hit.prompt_logprobs)))
        entries = hit.logprobs or (None,) * len(hit.tokens)
        for index, ((token_id, hidden), entry) in enumerate(zip(hit.tokens, entries)):
            put(TokenGenerated(self.request_id, token_id, index, hidden, entry))
        put(msgspec.structs.replace(hit.finished, request_id=self.request_id))
        self.started = self.from_memory = True
        return True

    def _remember(self, msg: GenerationFinished) -> None:
        cache = self.state.response_cache
        if cache is None or self.from_memory or msg.finish_reason not in ("stop", "length"):
            return
        cache.put(self.prompt_ids, self.params, self._stops.stops, CachedResponse(
            tuple(self._generated), msgspec.structs.replace(
                msg, cache_source="response", reused_tokens=len(self.prompt_ids),
                reread_tokens=0, prefill_ms=0.0, guest=False, aligned=None, end_replayed=0,
                drafted=0, accepted=0, tower_runs=0, tower_hits=0),
            logprobs=(tuple(self._generated_logprobs) if self.params.logprobs is not None
                      else None),
            prompt_logprobs=(None if self.prompt_logprobs is None
                             else tuple(self.prompt_logprobs))), self.namespace)

    def _answer_prepared(self) -> bool:
        """A compaction answered from the summary written ahead: its tokens replayed into our
        queue (cut at the request's max_tokens, as a greedy run of it would stop there)."""
        answer = self.prepared
        if answer is None:
            return False
        limit = self.params.max_tokens
        tokens = list(answer.token_ids[:limit])
        reason = "length" if len(answer.token_ids) > limit else answer.finish_reason
        put = self._events.put_nowait
        put(GenerationStarted(self.request_id, len(self.prompt_ids), 0.0))
        put(PrefillAdmitted(self.request_id))
        for index, token_id in enumerate(tokens):
            put(TokenGenerated(self.request_id, token_id, index, False, None))
        put(GenerationFinished(self.request_id, reason, len(self.prompt_ids), len(tokens),
                               reused_tokens=len(self.prompt_ids), prefill_ms=0.0,
                               decode_ms=0.0, decode_tok_s=0.0, cache_source="prepared",
                               reread_tokens=0))
        self.started = self.from_memory = True
        return True

    async def start(self) -> None:
        if self._answer_prepared() or self._answer_from_memory():
            return
        msg = Generate(self.request_id, self.prompt_ids, self.params, reply_to=self._events,
                       images=self.images.inputs if self.images else [],
                       session=self.session, namespace=self.namespace, marks=self.marks,
                       side=self.side, n=self.n)
        try:
            reply = await self.state.engine.ask(msg, self.state.ask_timeout_s, sender="server")
        except TimeoutError:
            raise ApiError(503, "the engine is overloaded; retry later", code="overloaded",
                           retry_after_s=_retry_after(self.state)) from None
        except ActorStopped:
            raise ApiError(503, "the engine has stopped", code="engine_stopped") from None
        if isinstance(reply, GenerationRejected):
            if reply.reason == "queue_full":
                raise ApiError(503, "too many requests are waiting for the engine; retry later",
                               code="queue_full", retry_after_s=reply.retry_after_s)
            if reply.reason == "draining":
                raise ApiError(503, "the server is shutting down", code="draining",
                               retry_after_s=reply.retry_after_s)
            raise ApiError(400, "duplicate request id", code="duplicate_request")
        self.started = True

    def cancel(self, choice: int | None = None) -> None:
        """Cancel the generation (``choice``: that choice alone, of n > 1)."""
        if not self.started or self.ended or self.from_memory:
            return
        try:
            self.state.engine.try_tell(CancelGeneration(self.request_id, choice),
                                       sender="server")
        except ActorStopped:
            pass  # a stopped engine runs nothing
        except MailboxFull:
            # A full mailbox drains in milliseconds; the engine must still hear of it.
            self.state.cancel_later(self.request_id, choice)

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def admitted(self) -> None:
        """Wait until the engine admits the prefill, so that a refusal (the governor found no
        room: 503 with Retry-After) is answered before a streaming response sends its headers.
        Token events that follow stay queued for ``texts``."""
        while True:
            msg = await self._events.get()
            match msg:
                case PrefillAdmitted():
                    return
                case GenerationFailed():
                    self.ended = True
                    self.finish_reason = "error"
                    raise _failure_error(msg)
                case GenerationStarted():
                    pass
                case PromptLogprobs(entries=entries):
                    self.prompt_logprobs = entries
                case _:
                    # An engine that never admits (a test double): what came is read first.
                    self._held.append(msg)
                    if isinstance(msg, GenerationFinished):
                        return

    async def _next_event(self):
        return self._held.pop(0) if self._held else await self._events.get()

    async def texts(self) -> AsyncIterator[str]:
        """The answer's text deltas, until the engine's last event or a stop string."""
        while not self.ended:
            msg = await self._next_event()
            if isinstance(msg, TokenGenerated):
                self._generated.append((msg.token_id, msg.hidden))
                self._generated_logprobs.append(msg.logprobs)
            match msg:
                case GenerationStarted() | PrefillAdmitted():
                    pass
                case PromptLogprobs(entries=entries):
                    self.prompt_logprobs = entries
                case TokenGenerated(hidden=True):
                    pass  # in the rows, never in the answer nor in usage
                case TokenGenerated(token_id=token_id):
                    if self.client_gone():
                        raise ClientGone
                    if self.ttft_ms is None:
                        self.ttft_ms = (self._loop.time() - self.arrived_s) * 1000.0
                    self.completion_tokens += 1
                    self.token_ids.append(token_id)
                    if msg.logprobs is not None:
                        self.logprobs.append(msg.logprobs)
                    text = self._stops.feed(self._decoder.push(token_id))
                    if text:
                        self.text += text
                        yield text
                    if self._stops.matched:
                        self.finish_reason = "stop"
                        await self._wait_after_cancel()
                        return
                case GenerationFinished():
                    self._finished(msg)
                    text = self._stops.feed(self._decoder.finish())
                    text += self._stops.flush()
                    if text:
                        self.text += text
                        yield text
                    if self._stops.matched:
                        self.finish_reason = "stop"
                case GenerationFailed():
                    self.ended = True
                    self.finish_reason = "error"
                    raise _failure_error(msg)

    async def scored_prompt(self) -> list[TokenLogprob]:
        """The prompt's logprobs (params.prompt_logprobs), waiting for them: a stream sends
        the echoed prompt first. Events read past on the way stay queued for ``texts``."""
        for msg in self._held:
            if isinstance(msg, PromptLogprobs):
                self.prompt_logprobs = msg.entries
        while self.prompt_logprobs is None:
            msg = await self._events.get()
            match msg:
                case PromptLogprobs(entries=entries):
                    self.prompt_logprobs = entries
                case GenerationFailed():
                    self.ended = True
                    self.finish_reason = "error"
                    raise _failure_error(msg)
                case _:
                    self._held.append(msg)
                    if isinstance(msg, GenerationFinished):
                        raise ApiError(500, "the engine sent no prompt logprobs",
                                       type="server_error", code="engine_error")
        return self.prompt_logprobs

    def take_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens read since the last call (a stream's next chunk)."""
        new = self.logprobs[self._logprobs_sent:]
        self._logprobs_sent = len(self.logprobs)
        return new

    async def _wait_after_cancel(self) -> None:
        """A stop string matched: cancel and take the engine's last event (it holds the
        counts); the tokens it made meanwhile are dropped."""
        self.cancel()
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                while not self.ended:
                    msg = await self._next_event()
                    if isinstance(msg, GenerationFinished):
                        self._finished(msg, keep_reason=True)
                    elif isinstance(msg, GenerationFailed):
                        self.ended = True
        except TimeoutError:
            log.warning("engine_cancel_slow", request_id=self.request_id)

    def _finished(self, msg: GenerationFinished, keep_reason: bool = False) -> None:
        self.ended = True
        self.result = msg
        if not keep_reason:
            self.finish_reason = msg.finish_reason
            self._remember(msg)

    # -- accounting ------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        """The client's prompt tokens that were not forwarded (OpenAI's cached_tokens)."""
        if self.result is None:
            return 0
        return max(0, self.client_prompt_tokens - self.result.reread_tokens)

    @property
    def cache_source(self) -> Source:
        if self.result is None:
            return "cold"
        c = self.compaction
        if c is not None and c.get("served") == "continuation" \
                and self.result.reused_tokens >= c["record_tokens"]:
            return "continuation"  # resumed at the record's end, from whichever copy held it
        return self.result.cache_source

    @property
    def engine_source(self) -> Source:
        """What served the rows as the engine says it (the tier of a continuation's rows)."""
        return self.result.cache_source if self.result is not None else "cold"

    def _parts(self) -> dict[str, int]:
        """The usage split of the client's prompt: system, tools and history add up to
        ``prompt_tokens`` (images: their rows); ``injected`` is what the server put in beyond
        them (the end anchor's replay of hidden spans and reasoning), so that the five are the
        prompt the engine read, cached plus reread. A continuation reads other ids than the
        client's prompt: nothing is injected into the client's."""
        prompt = self.client_prompt_tokens
        system, tools = self.head_parts or (0, 0)
        system = min(system, prompt)
        tools = min(tools, prompt - system)
        images = min(self.images.tokens, prompt - system - tools) if self.images else 0
        r = self.result
        read = (r.reused_tokens + r.reread_tokens) if r is not None else prompt
        injected = 0
        if self.compaction is None or self.compaction.get("served") == "as_sent":
            injected = max(0, read - prompt)
        return {"system": system, "tools": tools,
                "history": prompt - system - tools - images, "injected": injected,
                "images": images}

    def usage(self) -> dict:
        prompt = self.client_prompt_tokens
        source = self.cache_source
        r = self.result
        # cached and reread in the served prompt's positions (the spec's usage split); the
        # served prompt differs from the client's where the end alignment put rows back.
        tier = tier_of(self.engine_source)
        cache = {"tier": tier, "source": source,
                 "cached": r.reused_tokens if r else 0, "reread": r.reread_tokens if r else 0,
                 "slot": r.slot if r else None}
        if r is not None and r.aligned:
            cache["aligned"] = r.aligned
            cache["end_replayed"] = r.end_replayed
        if source == "continuation":
            cache["resumed_from"] = self.engine_source
        tandem: dict = {"parts": self._parts(), "harness": None, "cache": cache}
        if self.side:
            tandem["side"] = True
        if self.compaction is not None:
            tandem["compaction"] = dict(self.compaction)
        if r is not None:
            tandem["speculation"] = {"drafted": r.drafted, "accepted": r.accepted}
        if self.ttft_ms is not None:
            tandem["ttft_ms"] = round(self.ttft_ms, 3)  # as the journal row has it
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "tandem": tandem,
        }

    def close(self, status: int, error_code: str | None = None) -> None:
        """Cancel what still runs and account for the request: metrics and the journal row.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.started and not self.ended:
            self.cancel()
            if self.finish_reason is None:
                self.finish_reason = "cancelled"
        m = self.state.metrics
        prompt = self.client_prompt_tokens
        cached = self.cached_tokens
        ran = self.result is not None
        if ran:
            m.prompt_tokens.inc(prompt)
            m.prefix_cache_queries.inc(prompt)
            m.prefix_cache_hits.inc(cached)
            m.decode_tok_s.observe(self.result.decode_tok_s)
            m.spec_drafted.inc(self.result.drafted)
            m.spec_accepted.inc(self.result.accepted)
        m.generation_tokens.inc(self.completion_tokens)
        if self.finish_reason is not None:
            m.finished.labels(self.finish_reason).inc()
        if self.ttft_ms is not None:
            m.ttft.observe(self.ttft_ms / 1000.0)
        self.state.journal.append(RequestRow(
            request_id=self.request_id, t=time.time(), session=self.session,
            route=self.route, prompt_tokens=prompt, completion_tokens=self.completion_tokens,
            cached_tokens=cached, reread_tokens=self.result.reread_tokens if ran else 0,
            cache_source=self.cache_source if ran else None,
            cache_tier=tier_of(self.engine_source) if ran else None,
            ttft_ms=None if self.ttft_ms is None else round(self.ttft_ms, 3),
            decode_tok_s=round(self.result.decode_tok_s, 3) if ran else None,
            finish_reason=self.finish_reason, status=status, error=error_code,
            drafted=self.result.drafted if ran else 0,
            accepted=self.result.accepted if ran else 0, slot=self.result.slot if ran else None,
            extra=self._extra()))

    def _extra(self) -> dict | None:
        r = self.result
        if r is None:
            return None
        extra = {}
        if r.aligned:
            extra["aligned"] = r.aligned
            extra["end_replayed"] = r.end_replayed
        if r.hidden_tokens:
            extra["hidden_tokens"] = r.hidden_tokens
        if r.guest:
            extra["guest"] = True
        if self.side:
            extra["side"] = True
        if self.images is not None:
            # counts only: never a URL, a digest or a pixel
            extra["images"] = {"count": len(self.images.inputs),
                               "left_out": self.images.left_out,
                               "tokens": self.images.tokens, "tower_runs": r.tower_runs,
                               "tower_hits": r.tower_hits}
        if self.compaction is not None:
            extra["compaction"] = dict(self.compaction)
            if self.cache_source == "continuation":
                extra["resumed_from"] = self.engine_source
        return extra or None


def _failure_error(msg: GenerationFailed) -> ApiError:
    match msg.reason:
        case "context_overflow":
            return ApiError(400, msg.detail, param="messages", code="context_length_exceeded")
        case "model_error":
            return ApiError(400, msg.detail, code="invalid_prompt")
        case "draining" | "stopped":
            return ApiError(503, "the server is shutting down", code=msg.reason,
                            retry_after_s=msg.retry_after_s or 1.0)
        case "cancelled":
            return ApiError(503, "the request was cancelled", code="cancelled")
        case "no_memory":
            return ApiError(503, f"not enough memory for this prefill now: {msg.detail}",
                            code="no_memory", retry_after_s=msg.retry_after_s or 1.0)
        case _:
            # engine_error: a bug met by this request (the engine went on); never bad input,
            # which the routes and the engine answer 400 before it gets here.
            return ApiError(500, "internal engine error", type="server_error",
                            code="engine_error")


def _retry_after(state: ServerState) -> float:
    """The engine's estimate of when it has room (an engine without one: 1 s)."""
    estimate = getattr(state.engine, "retry_after_estimate", None)
    return estimate() if callable(estimate) else 1.0
