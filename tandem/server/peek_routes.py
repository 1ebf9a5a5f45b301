"""POST /v1/cache/peek and POST /v1/cache/prewarm (spec: "Peek and prewarm"; issue 18, parts 2
and 3): where a conversation's rows are, and reading them back from the NVMe ahead of its turn.

Both take a chat body as /v1/chat/completions takes it (messages, tools, the effort fields,
``model``; checked the same way, its errors in the same format) and the conversation's session
as the chat route reads it (the body's conversation fields, else ``x-session-id``: tandem/
server/sessions.py). The body is rendered and tokenised as the request would be, and the engine
actor is asked (`Peek`, answered from its mailbox): the hidden spans and the alignment are its
plan's (tandem/actors/engine_peek.py). Neither runs the model; the peek counts nothing.

The engine busy: while a request waits for it, a 409 at once; otherwise the route asks again
until ``PEEK_WAIT_S`` (the end of a turn and the engine's idle work after it) and then answers
409. Both are admin routes, with the rules /v1/cache/clear has (tandem/server/guard.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tandem.actors import ActorStopped
from tandem.actors.engine_messages import Peek, Peeked
from tandem.cache.namespace import namespace_of
from tandem.server.body import read_json
from tandem.server.errors import ApiError
from tandem.server.guard import admin_route
from tandem.server.openai_routes import _check_window, _unknown_model, chat_prompt
from tandem.server.schema import ChatCompletionRequest, decode_body
from tandem.server.sessions import session_key
from tandem.server.side import is_side_request
from tandem.server.state import STATE

PEEK_WAIT_S = 3.0  # the longest a peek waits for a running generation to end (spec)
PEEK_POLL_S = 0.02  # how often it asks again meanwhile
# A prewarm's reply: a read of the NVMe of up to PREWARM_MAX_S (too_long past it, spec) and a
# save of the conversation in place before it.
PREWARM_ASK_S = 120.0


def add_peek_routes(app: web.Application) -> None:
    app.router.add_post("/v1/cache/peek", cache_peek)
    app.router.add_post("/v1/cache/prewarm", cache_prewarm)


async def _rendered(request: web.Request) -> tuple[Peek, str | None]:
    """The body as the chat route reads it: the prompt ids and what the plan is asked with."""
    state = request.app[STATE]
    server = state.config.server
    body: dict[str, Any] = await read_json(request, server.max_body_bytes,
                                           server.request_read_timeout_s)
    session = session_key(body, request.headers, state.session_secret)
    req: ChatCompletionRequest = decode_body(body, ChatCompletionRequest)
    req.check()
    if req.model != state.model_name:
        raise _unknown_model(req.model, state)
    req, prompt_ids, _, images = await chat_prompt(state, req)  # images as their key ids
    _check_window(len(prompt_ids), state.window, "messages")
    namespace = namespace_of(req.salt(state.config.cache.require_cache_salt))
    side = state.config.server.side_requests and is_side_request(req.messages)
    return Peek(prompt_ids, session=session, namespace=namespace, side=side,
                images=images is not None), session


async def _ask_engine(request: web.Request, msg: Peek, timeout_s: float) -> Peeked:
    """The engine's answer once it is free: a 409 at once while a request waits for it, else
    after PEEK_WAIT_S of asking again."""
    engine = request.app[STATE].engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PEEK_WAIT_S
    while True:
        try:
            reply = await engine.ask(msg, timeout_s, sender="server")
        except ActorStopped:
            raise ApiError(503, "the engine has stopped", code="engine_stopped") from None
        except TimeoutError:
            raise ApiError(503, "the engine did not answer in time", code="engine_busy",
                           retry_after_s=timeout_s) from None
        if not isinstance(reply, Peeked):
            raise ApiError(404, "this engine keeps no caches to peek at", code="no_caches")
        if not reply.busy:
            return reply
        if reply.waiting or loop.time() >= deadline:
            why = ("a request is waiting for the engine" if reply.waiting else
                   "the engine stayed busy")
            raise ApiError(409, f"{why}; ask again once it is idle", code="engine_busy",
                           retry_after_s=reply.retry_after_s or 1.0)
        await asyncio.sleep(PEEK_POLL_S)


def peek_doc(reply: Peeked, session: str | None) -> dict[str, Any]:
    """The peek's answer (spec): the tier in the usage frame's names, the line and re-read in
    the served prompt's positions, the estimates in milliseconds."""
    return {"tier": reply.tier, "cached_tokens": reply.cached_tokens,
            "reread_tokens": reply.reread_tokens, "reread_eta_ms": reply.reread_eta_ms,
            "tokens": reply.tokens, "restore_ms": reply.restore_ms, "session": session,
            "slot": reply.slot}


@admin_route
async def cache_peek(request: web.Request) -> web.Response:
    """Where the conversation's rows are, as its next request's plan would find them; runs
    nothing and counts nothing."""
    msg, session = await _rendered(request)
    reply = await _ask_engine(request, msg, request.app[STATE].ask_timeout_s)
    return web.json_response(peek_doc(reply, session))


@admin_route
async def cache_prewarm(request: web.Request) -> web.Response:
    """The conversation read back from the NVMe into the slot its next request takes, when the
    peek says nvme_spill; ``{"prewarmed": false, "why"}`` otherwise."""
    msg, session = await _rendered(request)
    msg = Peek(msg.prompt_ids, session=msg.session, namespace=msg.namespace, side=msg.side,
               prewarm=True)
    reply = await _ask_engine(request, msg, PREWARM_ASK_S)
    doc = dict(reply.prewarm or {"prewarmed": False, "why": "not_on_nvme"})
    doc["peek"] = peek_doc(reply, session)
    return web.json_response(doc)
