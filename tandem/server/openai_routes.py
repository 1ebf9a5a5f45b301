"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

A generation request goes: read the body (size limit, read deadline) -> decode and check it ->
render and tokenize -> check the window -> ask the engine (`Run`) -> answer whole or as SSE
chunks. Every request that gets as far as a decoded body leaves one journal row.

Nothing a body holds may stall the event loop: a large body is decoded, and every prompt is
rendered and tokenised, on a worker thread, and a prompt whose bytes alone show that it cannot
fit the window is refused before it is tokenised.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import msgspec
import structlog
from aiohttp import web

from tandem.actors.engine_messages import GenerationParams, PromptMarks
from tandem.cache.namespace import namespace_of
from tandem.cache.prepared import rows_digest
from tandem.models.chat import (
    ChatError,
    ContentDelta,
    ReasoningDelta,
    StreamParser,
    ToolCallArguments,
    ToolCallParsed,
    ToolCallStarted,
    parse_output,
    render_prompt,
    template_info,
    turn_starts,
)
from tandem.server.body import read_json
from tandem.server.compaction import Continuation, compaction_request, continuation_of
from tandem.server.errors import ApiError, bad_request
from tandem.server.generation import CLIENT_GONE, ClientGone, Run, new_request_id
from tandem.server.guard import require_admin
from tandem.server.image_caps import left_out_by_count
from tandem.server.image_prompt import read_images
from tandem.server.images import image_limits, image_parts, load_images
from tandem.server.journal import RequestRow
from tandem.server.keys import PREPARED
from tandem.server.logprobs_json import LogprobsWriter
from tandem.server.schema import ChatCompletionRequest, CompletionRequest, _Sampling, decode_body
from tandem.server.sessions import session_key
from tandem.server.side import is_side_request
from tandem.server.state import STATE, ServerState
from tandem.server.structured import chat_grammar
from tandem.tokens import common_prefix

log = structlog.get_logger("tandem.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SUMMARY_ROOM = 2048  # a compaction's summary is about 2,000 tokens (spec)
_json = msgspec.json.Encoder()


def add_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


# -- models ----------------------------------------------------------------------------------


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created_s,
            "owned_by": "tandem", "max_model_len": state.window, **template_report(state)}


def template_report(state: ServerState) -> dict:
    """Which chat template renders the prompts and the tool-call form it teaches."""
    info = template_info(state.chat_template)
    return {"chat_template": {"source": info.source, "sha256": info.sha256},
            "tool_call_format": info.tool_format}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.match_info["model"] != state.model_name:
        raise _unknown_model(request.match_info["model"], state)
    return web.json_response(_model_card(state))


def _unknown_model(name: str, state: ServerState) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; this server serves "
                    f"{state.model_name!r}", param="model", code="model_not_found")


# -- reading a request -----------------------------------------------------------------------


def _params(req: _Sampling, state: ServerState, limit: int | None, room: int,
            ) -> GenerationParams:
    d = state.defaults
    top_k = req.top_k if req.top_k is not None else d.top_k
    return GenerationParams(
        max_tokens=max(0, min(limit, room) if limit is not None else room),
        temperature=req.temperature if req.temperature is not None else d.temperature,
        top_p=req.top_p if req.top_p is not None else d.top_p,
        top_k=max(top_k, 0),
        seed=req.seed,
        stop_token_ids=tuple(state.tokenizer.eos_ids),
        max_reasoning_tokens=(req.max_reasoning_tokens if req.max_reasoning_tokens is not None
                              else state.config.server.max_reasoning_tokens),
        forced_ids=_forced_ids(req, state),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.logit_bias_pairs(state.tokenizer.vocab_size),
    )


def _forced_ids(req: _Sampling, state: ServerState) -> tuple[int, ...]:
    if req.tandem_forced_output is None:
        return ()
    if not state.config.server.allow_forced_output:
        raise ApiError(403, "tandem_forced_output is an admin field; this server does not allow "
                       "it (allow_forced_output)", param="tandem_forced_output",
                       type="permission_error", code="forced_output_not_allowed")
    require_admin()  # the admin token, or a loopback client when none is set
    tok = state.tokenizer
    return tuple(tok.encode(req.tandem_forced_output)) + (tok.special_ids["<|im_end|>"],)


def _check_fits(text: str, state: ServerState, param: str) -> None:
    """Refuse a prompt whose bytes alone show it has more tokens than the window holds, before
    anything tokenises it."""
    at_least = state.tokenizer.min_tokens(text)
    if at_least > state.window:
        raise ApiError(400, f"the prompt has at least {at_least} tokens and the window holds "
                       f"{state.window}", param=param, code="context_length_exceeded")


def _check_room(limit: int | None, param: str, prompt_tokens: int, window: int,
                where: str) -> None:
    """An explicit ``max_tokens`` past the window's room is refused, as OpenAI refuses it (the
    last token needs no row: the room is window - prompt + 1); an implicit one is the room."""
    if limit is not None and limit > window - prompt_tokens + 1:
        raise ApiError(400, f"This model's maximum context length is {window} tokens. However, "
                       f"you requested {prompt_tokens + limit} tokens ({prompt_tokens} in the "
                       f"{where}, {limit} in the completion). Please reduce the length of the "
                       f"{where} or completion.", param=param, code="context_length_exceeded")


def _check_window(num_tokens: int, window: int, param: str) -> None:
    if num_tokens > window:
        raise ApiError(400, f"the prompt has {num_tokens} tokens and the window holds "
                       f"{window}: shorten it by at least {num_tokens - window} tokens",
                       param=param, code="context_length_exceeded")
    if num_tokens == 0:
        raise bad_request("the prompt is empty", param)


class _Request:
    """The part of a generation request shared by both routes: its id, session, the journal
    row for a request refused before it ran, and the Run once it started."""

    def __init__(self, request: web.Request, route: str, prefix: str) -> None:
        self.request = request
        self.state = request.app[STATE]
        self.route = route
        self.request_id = new_request_id(prefix)
        self.arrived_s = asyncio.get_running_loop().time()
        self.session: str | None = None
        self.prompt_tokens: int | None = None
        self.run: Run | None = None

    def refused(self, status: int, code: str | None) -> None:
        """The journal row of a request that never reached the engine, or was refused by it."""
        self.state.journal.append(RequestRow(
            request_id=self.request_id, t=time.time(), session=self.session, route=self.route,
            prompt_tokens=self.prompt_tokens, status=status, error=code))

    def counted(self, status: int) -> None:
        self.state.metrics.requests.labels(self.route, str(status)).inc()
        self.state.metrics.request_duration.observe(
            asyncio.get_running_loop().time() - self.arrived_s)


async def _serve(request: web.Request, route: str, prefix: str, prepare, answer,
                 ) -> web.StreamResponse:
    """Run a generation route: ``prepare(ctx, body)`` checks the body and returns the prompt
    ids, params and stop strings; ``answer(ctx, req, run)`` writes the response."""
    ctx = _Request(request, route, prefix)
    status = 500
    code: str | None = "internal_error"
    body: dict[str, Any] | None = None
    extra: dict = {}
    try:
        server = ctx.state.config.server
        body = await read_json(request, server.max_body_bytes, server.request_read_timeout_s)
        ctx.session = session_key(body, request.headers, ctx.state.session_secret)
        req, prompt_ids, params, stops, extra = await prepare(ctx, body)
        ctx.prompt_tokens = extra.get("client_prompt_tokens") or len(prompt_ids)
        n = extra.get("n", 1)
        if n > 1:
            # Its answers are written with this module's chunks (tandem/server/choices.py).
            from tandem.server.choices import ChoicesRun, answer_choices
            answer = answer_choices
        ctx.run = (Run if n == 1 else ChoicesRun)(ctx.state, request, route=route,
                                                  request_id=ctx.request_id,
                      prompt_ids=prompt_ids, params=params, stops=stops, session=ctx.session,
                      arrived_s=ctx.arrived_s,
                      cache_salt=req.salt(ctx.state.config.cache.require_cache_salt),
                      images=extra.get("images"),
                      marks=extra.get("marks"), side=extra.get("side", False),
                      client_prompt_tokens=extra.get("client_prompt_tokens"),
                      compaction=extra.get("compaction"), prepared=extra.get("prepared"),
                      head_parts=extra.get("head_parts"), n=n)
        await ctx.run.start()
        response = await answer(ctx, req, ctx.run, extra)
        status, code = response.status, None
        return response
    except ApiError as e:
        status, code = e.status, e.code
        if ctx.run is not None and ctx.run.started:
            ctx.run.close(status, code)
        raise
    except ClientGone:
        status, code = CLIENT_GONE, "client_gone"
        raise asyncio.CancelledError from None  # nobody is left to answer
    except asyncio.CancelledError:
        status, code = CLIENT_GONE, "client_gone"
        raise
    finally:
        if ctx.run is not None and ctx.run.started:
            ctx.run.close(status, code)  # no-op when already closed
            if "continuation" in extra and ctx.run.result is not None:
                ctx.state.compaction.ran(ctx.run.cache_source == "continuation",
                                         ctx.run.client_prompt_tokens,
                                         ctx.run.result.reread_tokens)
        else:
            ctx.refused(status, code)
        ctx.counted(status)
        if ctx.state.recorder is not None and body is not None:
            _record(ctx, body, status, code, extra)


def _record(ctx: _Request, body: dict[str, Any], status: int, code: str | None,
            extra: dict) -> None:
    """The recording's row of a request that got as far as a decoded body."""
    from tandem.replay.record import request_row

    response: dict[str, Any] = {"request_id": ctx.request_id, "status": status, "error": code}
    run = ctx.run
    if run is not None and run.started:
        response.update(text=run.text, token_ids=run.token_ids, usage=run.usage(),
                        cache_source=run.cache_source, finish_reason=run.finish_reason)
        if ctx.route == "chat":
            parsed = parse_output(run.text, thinking=extra.get("thinking", True),
                                  tools=extra.get("tools"))
            response.update(reasoning=parsed.reasoning, content=parsed.content,
                            tool_calls=parsed.tool_calls)
    wall_s = time.time() - (asyncio.get_running_loop().time() - ctx.arrived_s)
    ctx.state.recorder.append(request_row(t=wall_s, route=ctx.route, headers=ctx.request.headers,
                                          body=body, response=response))


# -- chat ------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat", "chatcmpl", _prepare_chat, _answer_chat)


async def chat_prompt(state: ServerState, req: ChatCompletionRequest):
    """The request as the engine reads it: the request with its left-out images replaced by
    text, the prompt ids (each image's rows its key ids), whether the prompt opens the
    reasoning, and the images (None without any). The chat route's and the peek's."""
    images = None
    if parts := image_parts(req.messages):
        caps = state.config.images
        if state.images is None:
            # The oldest past the cap are left out (never decoded); the others are read and
            # checked first, so a bad one is named as such; a model without a vision tower
            # then refuses them all.
            left = left_out_by_count(len(parts), caps.max_images)
            parts = parts[left:]
            await load_images(parts, image_limits(state.config))
            raise bad_request("this model reads no images: it has no vision tower",
                              parts[0].where, "images_unsupported")
        images = await read_images(req.messages, parts, state.images,
                                   image_limits(state.config), caps.max_images,
                                   caps.max_image_tokens)
        req = msgspec.structs.replace(req, messages=images.messages)
    prompt_ids, thinking = await asyncio.to_thread(_chat_ids, state, req)
    if images is not None:
        # Each placeholder grown to its image's rows, and those rows its key: the ids the
        # engine and every cache compare (tandem.models.image_keys).
        prompt_ids = await asyncio.to_thread(images.key_ids, prompt_ids,
                                             state.images.image_token_id)
    return req, prompt_ids, thinking, images


async def _prepare_chat(ctx: _Request, body: dict[str, Any]):
    state = ctx.state
    req: ChatCompletionRequest = decode_body(body, ChatCompletionRequest)
    req.check()
    if req.model != state.model_name:
        raise _unknown_model(req.model, state)
    req, prompt_ids, thinking, images = await chat_prompt(state, req)
    stops = req.stop_strings()
    head = await asyncio.to_thread(_head_parts, state, req, prompt_ids)
    window = state.window
    _check_window(len(prompt_ids), window, "messages")
    _check_room(req.limit, "max_completion_tokens" if req.max_completion_tokens is not None
                else "max_tokens", len(prompt_ids), window, "messages")
    params = _params(req, state, req.limit, window - len(prompt_ids) + 1)
    if not thinking:  # no reasoning to budget: a forced </think> would land in the answer
        params = msgspec.structs.replace(params, max_reasoning_tokens=0)
    if req.logprobs:
        params = msgspec.structs.replace(params, logprobs=req.top_logprobs or 0)
    extra = {"thinking": thinking, "tools": req.tools, "marks": _marks(state, req, prompt_ids),
             "head_parts": head, "images": images,
             "side": state.config.server.side_requests and is_side_request(req.messages)}
    extra["n"] = req.choices(state.config.server.max_n)
    prepared = ctx.request.app.get(PREPARED)
    if prepared is not None and ctx.session is not None and req.tools:
        prepared.note_session(ctx.session, _client(ctx.request))  # an agent's conversation
    if not extra["side"] and images is None \
            and (ask := compaction_request(req.messages, req.tools)) is not None:
        prompt_ids, params = await _compaction(ctx, req, ask, prompt_ids, params, extra)
    # After the compaction, which may serve another prompt: the grammar starts where it ends.
    if (grammar := await asyncio.to_thread(chat_grammar, state, req, extra["thinking"])):
        params = msgspec.structs.replace(params, grammar=grammar)
    return req, prompt_ids, params, stops, extra


def _client(request: web.Request) -> str:
    """Which client sent a request, for the instructions it compacts with: the first product
    of its User-Agent (never logged)."""
    agent = request.headers.get("User-Agent", "").strip()
    return agent.split("/", 1)[0].split(" ", 1)[0][:64] or "unknown"


async def _compaction(ctx: _Request, req: ChatCompletionRequest, ask, prompt_ids: list[int],
                      params: GenerationParams, extra: dict,
                      ) -> tuple[list[int], GenerationParams]:
    """A compaction request (tandem/server/compaction.py): its prompt as the continuation of the
    session's conversation, or as the client sent it (the knob, or a miss of the guard; both
    said in ``extra["compaction"]``, the usage frame's and the journal's)."""
    state = ctx.state
    counts = state.compaction
    counts.recognised += 1
    if state.config.compaction.compaction == "client":
        counts.client += 1
        extra["compaction"] = {"served": "as_sent", "why": "client"}
        return prompt_ids, params
    if ctx.session is None:
        got = "no_session"
    else:
        namespace = namespace_of(req.salt(state.config.cache.require_cache_salt))
        got = await continuation_of(state, ask, ctx.session, namespace)
    prepared = ctx.request.app.get(PREPARED)
    if prepared is not None:
        # The preparer writes its next summaries with this client's own text.
        prepared.remember_instructions(_client(ctx.request), ask.system, ask.instructions)
    if isinstance(got, Continuation):
        # The continuation has room for the answer the client asked for (without a limit, for
        # a summary's, or as much as the client's prompt left).
        room = state.window - len(got.prompt_ids) + 1
        wanted = params.max_tokens if req.limit is not None else min(params.max_tokens,
                                                                       SUMMARY_ROOM)
        if room < wanted:
            got = "window"
        else:
            params = msgspec.structs.replace(params, max_tokens=params.max_tokens
                                             if req.limit is not None else room)
    if not isinstance(got, Continuation):
        counts.missed(got)
        log.info("compaction_served_as_sent", request_id=ctx.request_id, why=got)
        extra["compaction"] = {"served": "as_sent", "why": got}
        return prompt_ids, params
    answer = None if prepared is None else prepared.lookup(
        ctx.session, rows_digest(got.prompt_ids[:got.record_tokens]), ask.system,
        template_info(state.chat_template).sha256)
    if answer is not None:
        # Written ahead at this very end anchor, with this system text and template: the
        # answer without the engine.
        log.info("compaction_prepared_served", request_id=ctx.request_id,
                 record_tokens=got.record_tokens, completion_tokens=answer.completion_tokens)
        extra.update(thinking=False, prepared=answer, client_prompt_tokens=len(prompt_ids),
                     compaction={"served": "prepared", "where": got.where,
                                 "record_tokens": got.record_tokens,
                                 "turn_tokens": got.turn_tokens})
        return got.prompt_ids, msgspec.structs.replace(params, max_reasoning_tokens=0)
    counts.continuations += 1
    log.info("compaction_continued", request_id=ctx.request_id, where=got.where,
             record_tokens=got.record_tokens, turn_tokens=got.turn_tokens,
             client_prompt_tokens=len(prompt_ids))
    extra.update(thinking=False, marks=got.marks, continuation=got,
                 client_prompt_tokens=len(prompt_ids),
                 compaction={"served": "continuation", "where": got.where,
                             "record_tokens": got.record_tokens,
                             "turn_tokens": got.turn_tokens})
    # Thinking is off: no reasoning to budget.
    return got.prompt_ids, msgspec.structs.replace(params, max_reasoning_tokens=0)


def _marks(state: ServerState, req: ChatCompletionRequest, ids: list[int]) -> PromptMarks:
    """Where the conversation's parts start in its prompt ids (the disk tier writes a new
    session's head up to its last user message, and shares only the head before the first
    answer)."""
    users = turn_starts(ids, state.tokenizer, "user")
    last_user = users[-1] if users else None
    answers = [i for i in turn_starts(ids, state.tokenizer, "assistant")
               if last_user is not None and i < last_user]
    first = not any(isinstance(m, dict) and m.get("role") == "assistant" for m in req.messages)
    return PromptMarks(first_of_session=first, last_user_start=last_user,
                       head_stop=answers[0] if answers else None)


def _chat_ids(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], bool]:
    """The prompt ids (on a worker thread): control-token text in the client's strings is text
    (tandem.models.chat.ChatPrompt); and whether the prompt opens the reasoning."""
    tools = req.tools if req.tool_choice != "none" else None
    try:
        prompt = render_prompt(req.messages, tools, add_generation_prompt=True,
                               enable_thinking=req.enable_thinking, template=state.chat_template,
                               preserve_thinking=req.preserve_thinking,
                               control_tokens=state.tokenizer.control_tokens)
    except ChatError as e:
        param = "tools" if str(e).startswith("tools") else "messages"
        raise bad_request(str(e), param, "invalid_messages") from None
    _check_fits(prompt.text, state, "messages")
    return prompt.encode(state.tokenizer), prompt.thinking


def warm_chat_prompt(state: ServerState) -> None:
    """A two-message chat rendered and encoded once at start, on the thread a request's would
    run on (the default executor): the template's compile, the worker's first use and the
    tokenizer's first call were 60 ms of the first chat request's first token on tiny."""
    req = msgspec.convert({"model": state.model_name,
                           "messages": [{"role": "system", "content": "warm-up"},
                                        {"role": "user", "content": "warm-up"}]},
                          ChatCompletionRequest)
    _chat_ids(state, req)


HEADS_KEPT = 64  # system texts and tool sets whose rendered head is kept (the usage split)
_HEADS: dict[tuple[int, bytes], list[int]] = {}  # worker threads only; oldest first
_HEADS_LOCK = threading.Lock()


def _head_parts(state: ServerState, req: ChatCompletionRequest, ids: list[int]
                ) -> tuple[int, int]:
    """How many of a chat prompt's first tokens are its system text and then its tools (the
    usage split's ``system`` and ``tools``; the rest is ``history``): the leading system
    messages rendered alone, without and with the tools, met against the prompt's ids (a
    template that puts them elsewhere gets what it shares at the start)."""
    system = []
    for m in req.messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        system.append(m)
    tools = req.tools if req.tool_choice != "none" else None
    counts = []
    for with_tools in (None, tools):
        if not system and not with_tools:
            counts.append(0)
            continue
        key = (id(state), _json.encode([system, with_tools, req.enable_thinking,
                                        req.preserve_thinking]))
        head = _HEADS.get(key)
        if head is None:
            # An agent sends the same system text and tools every turn: rendered once.
            try:
                head = render_prompt(system, with_tools, add_generation_prompt=False,
                                     enable_thinking=req.enable_thinking,
                                     template=state.chat_template,
                                     preserve_thinking=req.preserve_thinking,
                                     control_tokens=state.tokenizer.control_tokens
                                     ).encode(state.tokenizer)
            except ChatError:
                head = []
            with _HEADS_LOCK:
                _HEADS[key] = head
                while len(_HEADS) > HEADS_KEPT:
                    _HEADS.pop(next(iter(_HEADS)))
        counts.append(common_prefix(ids, head))
    return counts[0], max(0, counts[1] - counts[0])


def _chunk(ctx: _Request, run: Run, choices: list[dict], usage: dict | None = None,
           with_usage: bool = False) -> bytes:
    doc: dict[str, Any] = {"id": run.request_id, "object": "chat.completion.chunk",
                           "created": ctx.state.created_now(), "model": ctx.state.model_name,
                           "system_fingerprint": None, "choices": choices}
    if with_usage:
        doc["usage"] = usage
    return b"data: " + _json.encode(doc) + b"\n\n"


def _delta(delta: dict, finish_reason: str | None = None,
           logprobs: dict | None = None, index: int = 0) -> list[dict]:
    return [{"index": index, "delta": delta, "logprobs": logprobs,
             "finish_reason": finish_reason}]


def _event_delta(event) -> dict:
    """A stream parser's event as a chat chunk's delta."""
    match event:
        case ReasoningDelta(text=t):
            return {"reasoning_content": t}
        case ContentDelta(text=t):
            return {"content": t}
        case ToolCallParsed(index=i, tool_call=call):
            return {"tool_calls": [{"index": i, **call}]}
        case ToolCallStarted(index=i, call_id=call_id, name=name):
            # OpenAI's first delta of a call: its id, type and name, no arguments yet
            return {"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]}
        case ToolCallArguments(index=i, text=t):
            return {"tool_calls": [{"index": i, "function": {"arguments": t}}]}
    raise TypeError(f"no delta for {type(event).__name__}")


def _chat_message(parsed) -> dict[str, Any]:
    """An answer's message: its content (null beside tool calls), reasoning and calls."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or
                               not parsed.tool_calls else None,
                               "reasoning_content": parsed.reasoning}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


async def _answer_chat(ctx: _Request, req: ChatCompletionRequest, run: Run, extra: dict,
                       ) -> web.StreamResponse:
    thinking = extra["thinking"]
    writer = LogprobsWriter(ctx.state.tokenizer) if req.logprobs else None
    if not req.stream:
        text = "".join([t async for t in run.texts()])
        parsed = parse_output(text, thinking=thinking, tools=extra["tools"])
        finish = _chat_finish(run.finish_reason, bool(parsed.tool_calls))
        message = _chat_message(parsed)
        run.close(200)
        return web.json_response({
            "id": run.request_id, "object": "chat.completion",
            "created": ctx.state.created_now(), "model": ctx.state.model_name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message,
                         "logprobs": writer.chat(run.logprobs) if writer else None,
                         "finish_reason": finish}],
            "usage": run.usage(),
        })

    include_usage = req.include_usage
    stream = _SSE(ctx.request)
    parser = StreamParser(thinking=thinking, tools=extra["tools"])

    async def send(events) -> None:
        for event in events:
            # A chunk carries the entries of the tokens read since the last one.
            logprobs = writer.chat(run.take_logprobs()) if writer else None
            await stream.write(_chunk(ctx, run, _delta(_event_delta(event), logprobs=logprobs),
                                      with_usage=include_usage))

    # Headers and the role go out once the engine admitted the prefill: until then the memory
    # governor may still refuse it, which is a 503 with Retry-After, not a broken stream.
    await run.admitted()
    await stream.write(_chunk(ctx, run, _delta({"role": "assistant", "content": ""}),
                              with_usage=include_usage))
    try:
        async for text in run.texts():
            await send(parser.feed(text))
        await send(parser.finish())
        finish = _chat_finish(run.finish_reason, parser.num_calls > 0)
        logprobs = writer.chat(run.take_logprobs()) if writer else None
        await stream.write(_chunk(ctx, run, _delta({}, finish, logprobs),
                                  with_usage=include_usage))
        if include_usage:
            await stream.write(_chunk(ctx, run, [], run.usage(), with_usage=True))
    except ApiError as e:
        run.close(200, e.code)
        await stream.write(b"data: " + _json.encode(e.body()) + b"\n\n")
    run.close(200)
    await stream.done()
    return stream.response


def _chat_finish(reason: str | None, tool_calls: bool) -> str:
    if reason == "stop" and tool_calls:
        return "tool_calls"
    if reason in ("stop", "length"):
        return reason
    return "stop"


class _SSE:
    """A text/event-stream response, prepared at its first chunk; a failed write means the
    client has gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})
        self.prepared = False

    async def prepare(self) -> None:
        await self.response.prepare(self.request)
        self.prepared = True

    async def write(self, data: bytes) -> None:
        if not self.prepared:
            await self.prepare()
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as e:  # aiohttp's reset error is both
            raise ClientGone from e

    async def done(self) -> None:
        await self.write(b"data: [DONE]\n\n")
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone from e


# -- completions -----------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions", "cmpl", _prepare_completion,
                        _answer_completion)


async def _prepare_completion(ctx: _Request, body: dict[str, Any]):
    state = ctx.state
    req: CompletionRequest = decode_body(body, CompletionRequest)
    req.check()
    if req.model != state.model_name:
        raise _unknown_model(req.model, state)
    stops = req.stop_strings()
    prompt = req.prompt_ids_or_text(state.tokenizer.vocab_size)
    prompt_ids = await asyncio.to_thread(_text_ids, state, prompt) if isinstance(prompt, str) \
        else prompt
    window = state.window
    _check_window(len(prompt_ids), window, "prompt")
    _check_room(req.max_tokens, "max_tokens", len(prompt_ids), window, "prompt")
    limit = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = _params(req, state, limit, window - len(prompt_ids) + 1)
    extra = {"n": req.choices(state.config.server.max_n)}
    if req.logprobs is not None:
        params = msgspec.structs.replace(
            params, logprobs=req.logprobs, prompt_logprobs=req.logprobs if req.echo else None)
    if req.echo:
        extra["echo"] = prompt if isinstance(prompt, str) else await asyncio.to_thread(
            state.tokenizer.decode, prompt_ids)
    return req, prompt_ids, params, stops, extra


def _text_ids(state: ServerState, prompt: str) -> list[int]:
    """A raw prompt's ids (on a worker thread). The client writes the whole prompt, turn
    markers included, so special-token text in it is read as the tokens."""
    _check_fits(prompt, state, "prompt")
    return state.tokenizer.encode(prompt)


def _completion_doc(ctx: _Request, run: Run, choices: list[dict]) -> dict:
    return {"id": run.request_id, "object": "text_completion",
            "created": ctx.state.created_now(), "model": ctx.state.model_name,
            "system_fingerprint": None, "choices": choices}


async def _answer_completion(ctx: _Request, req: CompletionRequest, run: Run, extra: dict,
                             ) -> web.StreamResponse:
    echo = extra.get("echo")
    writer = LogprobsWriter(ctx.state.tokenizer) if req.logprobs is not None else None

    def new_logprobs() -> dict | None:
        if writer is None:
            return None
        entries = run.take_logprobs()
        return writer.completion([e.token_id for e in entries], entries)

    def echoed_logprobs() -> dict | None:
        # The prompt's tokens, the first with nothing to score it (null, as OpenAI's).
        if writer is None:
            return None
        return writer.completion(run.prompt_ids, [None, *run.prompt_logprobs])

    if not req.stream:
        text = "".join([t async for t in run.texts()])
        run.close(200)
        logprobs = None
        if writer is not None:
            head = echoed_logprobs() if echo is not None else None  # offsets: the prompt first
            logprobs = new_logprobs()
            if head is not None:
                logprobs = {k: head[k] + logprobs[k] for k in head}
        doc = _completion_doc(ctx, run, [{"index": 0, "text": text if echo is None
                                          else echo + text, "logprobs": logprobs,
                                          "finish_reason": _chat_finish(run.finish_reason,
                                                                        False)}])
        doc["usage"] = run.usage()
        return web.json_response(doc)
    stream = _SSE(ctx.request)

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        doc = _completion_doc(ctx, run, choices)
        if req.include_usage:
            doc["usage"] = usage
        return b"data: " + _json.encode(doc) + b"\n\n"

    await run.admitted()  # a refusal before here is a 503, as for the chat stream
    if echo is not None and writer is not None:
        await run.scored_prompt()
    await stream.prepare()
    try:
        if echo is not None:
            await stream.write(chunk([{"index": 0, "text": echo, "logprobs": echoed_logprobs(),
                                       "finish_reason": None}]))
        async for text in run.texts():
            await stream.write(chunk([{"index": 0, "text": text, "logprobs": new_logprobs(),
                                       "finish_reason": None}]))
        await stream.write(chunk([{"index": 0, "text": "", "logprobs": new_logprobs(),
                                   "finish_reason": _chat_finish(run.finish_reason, False)}]))
        if req.include_usage:
            await stream.write(chunk([], run.usage()))
    except ApiError as e:
        run.close(200, e.code)
        await stream.write(b"data: " + _json.encode(e.body()) + b"\n\n")
    run.close(200)
    await stream.done()
    return stream.response
