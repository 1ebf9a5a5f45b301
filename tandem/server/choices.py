"""Answers of n > 1 choices (OpenAI's ``n``) on /v1/chat/completions and /v1/completions.

The engine reads the prompt once and decodes the choices as a batch (tandem/choices.py); its
tokens carry their choice. Each choice has its own text decoder, stop strings, logprobs, tool
calls and finish_reason; a stop string that matches in one choice cancels that choice alone.
Streamed, every chunk carries one choice's ``index`` and each choice ends with its own chunk
holding its finish_reason; whole, ``choices`` lists them in order. ``usage`` counts the prompt
once and the completion tokens summed over the choices. A client that leaves cancels them all.

The response cache and a compaction's prepared summary answer one choice; an n > 1 request
always runs on the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tandem.actors.engine_messages import (
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PrefillAdmitted,
    PromptLogprobs,
    TokenGenerated,
)
from tandem.logprobs import TokenLogprob
from tandem.models.chat import StreamParser, parse_output
from tandem.server.errors import ApiError
from tandem.server.generation import ClientGone, Run, StopStrings, _failure_error
from tandem.server.logprobs_json import LogprobsWriter
from tandem.server.openai_routes import (
    _SSE,
    _chat_finish,
    _chat_message,
    _chunk,
    _completion_doc,
    _delta,
    _event_delta,
    _json,
)


class Choice:
    """What the client is sent of one choice: its text, tokens, logprobs and how it ended."""

    def __init__(self, index: int, run: Run, stops: list[str]) -> None:
        self.index = index
        self.decoder = run.state.tokenizer.stream_decoder()
        self.stops = StopStrings(stops)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self._logprobs_sent = 0
        self.finish_reason: str | None = None  # the engine's (or "stop" for a stop string)

    def take_logprobs(self) -> list[TokenLogprob]:
        new = self.logprobs[self._logprobs_sent:]
        self._logprobs_sent = len(self.logprobs)
        return new

    def feed(self, token_id: int, logprobs: TokenLogprob | None) -> str:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        return self._add(self.stops.feed(self.decoder.push(token_id)))

    def finish(self) -> str:
        return self._add(self.stops.feed(self.decoder.finish()) + self.stops.flush())

    def _add(self, text: str) -> str:
        self.text += text
        return text


class ChoicesRun(Run):
    """A Run of n > 1 choices: ``deltas`` in place of ``texts``."""

    def __init__(self, *args: Any, stops: list[str], **kwargs: Any) -> None:
        super().__init__(*args, stops=stops, **kwargs)
        self.choices = [Choice(i, self, stops) for i in range(self.n)]

    def _answer_prepared(self) -> bool:
        return False  # a prepared summary is one choice

    def _answer_from_memory(self) -> bool:
        return False  # the response cache keeps one choice

    def _remember(self, msg: GenerationFinished) -> None:
        pass

    def _extra(self) -> dict | None:
        return {**(super()._extra() or {}), "n": self.n}  # the journal row says how many

    async def deltas(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(choice, text, finish_reason)`` until the engine's last event: a text delta of a
        choice (finish_reason None), or a choice's end (its finish_reason, with the text it
        held back). A choice whose stop string matched ends there; its later tokens are
        dropped and the engine is told to stop it."""
        live = set(range(self.n))
        while not self.ended:
            msg = await self._next_event()
            match msg:
                case GenerationStarted() | PrefillAdmitted():
                    pass
                case PromptLogprobs(entries=entries):
                    self.prompt_logprobs = entries
                case TokenGenerated(hidden=True):
                    pass  # in the rows, never in the answer nor in usage
                case TokenGenerated(token_id=token_id, choice=i) if i in live:
                    if self.client_gone():
                        raise ClientGone
                    if self.ttft_ms is None:
                        self.ttft_ms = (self._loop.time() - self.arrived_s) * 1000.0
                    self.completion_tokens += 1
                    choice = self.choices[i]
                    text = choice.feed(token_id, msg.logprobs)
                    if choice.stops.matched:
                        live.discard(i)
                        choice.finish_reason = "stop"
                        self.cancel(choice=i)
                        yield i, text, "stop"
                    elif text:
                        yield i, text, None
                case TokenGenerated():
                    pass  # a choice that already ended at a stop string
                case GenerationFinished():
                    self._finished(msg)
                    ends = msg.choices or []
                    for i in sorted(live):
                        choice = self.choices[i]
                        text = choice.finish()
                        choice.finish_reason = ("stop" if choice.stops.matched else
                                                ends[i].finish_reason if i < len(ends)
                                                else msg.finish_reason)
                        yield i, text, choice.finish_reason
                    live.clear()
                case GenerationFailed():
                    self.ended = True
                    self.finish_reason = "error"
                    raise _failure_error(msg)
        # The journal's and the recording's: choice 0, which the conversation goes on from.
        first = self.choices[0]
        self.finish_reason = first.finish_reason or self.finish_reason
        self.text, self.token_ids = first.text, first.token_ids


async def answer_choices(ctx: Any, req: Any, run: ChoicesRun, extra: dict
                         ) -> web.StreamResponse:
    """The route's answer (``ctx.route``: chat or completions), streamed or whole."""
    if ctx.route == "chat":
        return await _answer_chat(ctx, req, run, extra)
    return await _answer_completion(ctx, req, run, extra)


async def _answer_chat(ctx: Any, req: Any, run: ChoicesRun, extra: dict) -> web.StreamResponse:
    thinking, tools = extra["thinking"], extra["tools"]
    writer = LogprobsWriter(ctx.state.tokenizer) if req.logprobs else None
    if not req.stream:
        async for _ in run.deltas():
            pass
        choices = []
        for c in run.choices:
            parsed = parse_output(c.text, thinking=thinking, tools=tools)
            choices.append({"index": c.index, "message": _chat_message(parsed),
                            "logprobs": writer.chat(c.logprobs) if writer else None,
                            "finish_reason": _chat_finish(c.finish_reason,
                                                          bool(parsed.tool_calls))})
        run.close(200)
        return web.json_response({
            "id": run.request_id, "object": "chat.completion",
            "created": ctx.state.created_now(), "model": ctx.state.model_name,
            "system_fingerprint": None, "choices": choices, "usage": run.usage()})

    include_usage = req.include_usage
    stream = _SSE(ctx.request)
    parsers = [StreamParser(thinking=thinking, tools=tools) for _ in run.choices]

    async def send(i: int, delta: dict, finish: str | None = None) -> None:
        logprobs = writer.chat(run.choices[i].take_logprobs()) if writer else None
        await stream.write(_chunk(ctx, run, _delta(delta, finish, logprobs, index=i),
                                  with_usage=include_usage))

    await run.admitted()  # a refusal before here is a 503, as for one choice
    for c in run.choices:
        await send(c.index, {"role": "assistant", "content": ""})
    try:
        async for i, text, finish in run.deltas():
            events = parsers[i].feed(text) if text else []
            if finish is not None:
                events += parsers[i].finish()
            for event in events:
                await send(i, _event_delta(event))
            if finish is not None:
                await send(i, {}, _chat_finish(finish, parsers[i].num_calls > 0))
        if include_usage:
            await stream.write(_chunk(ctx, run, [], run.usage(), with_usage=True))
    except ApiError as e:
        run.close(200, e.code)
        await stream.write(b"data: " + _json.encode(e.body()) + b"\n\n")
    run.close(200)
    await stream.done()
    return stream.response


async def _answer_completion(ctx: Any, req: Any, run: ChoicesRun, extra: dict
                             ) -> web.StreamResponse:
    echo = extra.get("echo")
    # A writer a choice: the legacy offsets count from the start of each choice's text.
    writers = [LogprobsWriter(ctx.state.tokenizer) if req.logprobs is not None else None
               for _ in run.choices]

    def new_logprobs(i: int) -> dict | None:
        if writers[i] is None:
            return None
        entries = run.choices[i].take_logprobs()
        return writers[i].completion([e.token_id for e in entries], entries)

    def echoed_logprobs(i: int) -> dict | None:
        # The prompt's tokens, the first with nothing to score it (null, as OpenAI's).
        if writers[i] is None:
            return None
        return writers[i].completion(run.prompt_ids, [None, *run.prompt_logprobs])

    def finish_of(c: Choice) -> str:
        return _chat_finish(c.finish_reason, False)

    if not req.stream:
        async for _ in run.deltas():
            pass
        run.close(200)
        choices = []
        for c in run.choices:
            logprobs = None
            if writers[c.index] is not None:
                head = echoed_logprobs(c.index) if echo is not None else None
                logprobs = new_logprobs(c.index)
                if head is not None:
                    logprobs = {k: head[k] + logprobs[k] for k in head}
            choices.append({"index": c.index, "text": c.text if echo is None else echo + c.text,
                            "logprobs": logprobs, "finish_reason": finish_of(c)})
        doc = _completion_doc(ctx, run, choices)
        doc["usage"] = run.usage()
        return web.json_response(doc)
    stream = _SSE(ctx.request)

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        doc = _completion_doc(ctx, run, choices)
        if req.include_usage:
            doc["usage"] = usage
        return b"data: " + _json.encode(doc) + b"\n\n"

    await run.admitted()
    if echo is not None and req.logprobs is not None:
        await run.scored_prompt()
    await stream.prepare()
    try:
        if echo is not None:
            for c in run.choices:
                await stream.write(chunk([{"index": c.index, "text": echo,
                                           "logprobs": echoed_logprobs(c.index),
                                           "finish_reason": None}]))
        async for i, text, finish in run.deltas():
            await stream.write(chunk([{"index": i, "text": text, "logprobs": new_logprobs(i),
                                       "finish_reason": None if finish is None
                                       else finish_of(run.choices[i])}]))
        if req.include_usage:
            await stream.write(chunk([], run.usage()))
    except ApiError as e:
        run.close(200, e.code)
        await stream.write(b"data: " + _json.encode(e.body()) + b"\n\n")
    run.close(200)
    await stream.done()
    return stream.response
