"""``POST /tokenize`` and ``POST /detokenize``, as vLLM and llama-server have them (issue 18,
part 5).

    POST /tokenize    {"prompt": "..."}           vLLM's text form (``add_special_tokens``)
                      {"content": "..."}          llama-server's (``add_special``, ``with_pieces``)
                      {"messages": [...], ...}    vLLM's chat form: rendered as a chat request is
                                                  (``tools``, ``add_generation_prompt``,
                                                  ``chat_template_kwargs``)
        -> {"count", "max_model_len", "tokens"} (+ "pieces" with ``with_pieces``)
    POST /detokenize  {"tokens": [ids]}  -> {"prompt": text, "content": text}

A text's special tokens: a client's text is text (``encode_text``: a control token's text is
ordinary text) unless ``add_special_tokens`` / ``add_special`` asks for the tokenizer's own
reading of them. ``model``, when given, must name the served model (404). A body that is not one
of these forms, an id outside the vocabulary or a text past the window is a 400 naming the field;
tokenising runs off the event loop. Nothing of it reaches the engine, a log or the journal.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tandem.models.chat import ChatError, render_prompt
from tandem.server.body import read_json
from tandem.server.errors import ApiError, bad_request
from tandem.server.state import STATE

MAX_TOKENS = 1 << 20  # ids a detokenize takes at most (a window's worth, and then some)


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def _body(request: web.Request) -> tuple[Any, dict[str, Any]]:
    state = request.app[STATE]
    server = state.config.server
    body = await read_json(request, server.max_body_bytes, server.request_read_timeout_s)
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{state.model_name!r}", param="model", code="model_not_found")
    return state, body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name, "invalid_value")
    return value


async def tokenize(request: web.Request) -> web.Response:
    state, body = await _body(request)
    tokenizer = state.tokenizer
    forms = [k for k in ("prompt", "content", "messages") if k in body]
    if len(forms) != 1:
        raise bad_request("give one of prompt, content or messages", "prompt", "invalid_value")
    form = forms[0]
    value = body[form]
    if form == "messages":
        if not isinstance(value, list) or not value:
            raise bad_request("messages must be a non-empty array", "messages", "invalid_value")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be an array", "tools", "invalid_value")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs",
                              "invalid_value")
        thinking = kwargs.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise bad_request("enable_thinking must be a boolean",
                              "chat_template_kwargs.enable_thinking", "invalid_value")
        generation_prompt = _flag(body, "add_generation_prompt", True)

        def ids() -> list[int]:
            try:
                prompt = render_prompt(value, tools, add_generation_prompt=generation_prompt,
                                       enable_thinking=thinking, template=state.chat_template,
                                       preserve_thinking=None,
                                       control_tokens=tokenizer.control_tokens)
            except ChatError as e:
                raise bad_request(str(e), "messages", "invalid_messages") from None
            return prompt.encode(tokenizer)
    else:
        if not isinstance(value, str):
            raise bad_request(f"{form} must be a string", form, "invalid_value")
        if len(value) > state.config.server.max_body_bytes:
            raise bad_request(f"{form} is too long", form, "invalid_value")
        special = _flag(body, "add_special_tokens" if form == "prompt" else "add_special",
                        False)

        def ids() -> list[int]:
            return tokenizer.encode(value, True) if special else tokenizer.encode_text(value)
    tokens = await asyncio.to_thread(ids)
    doc: dict[str, Any] = {"count": len(tokens), "max_model_len": state.window,
                           "tokens": tokens}
    if form == "content" and _flag(body, "with_pieces", False):
        doc["pieces"] = [{"id": t, "piece": tokenizer.id_to_piece(t)} for t in tokens]
    return web.json_response(doc)


async def detokenize(request: web.Request) -> web.Response:
    state, body = await _body(request)
    tokens = body.get("tokens")
    vocab = state.tokenizer.vocab_size
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        raise bad_request("tokens must be an array of token ids", "tokens", "invalid_value")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad_request(f"tokens[{i}] is not a token id of this model (0 to {vocab - 1})",
                              f"tokens[{i}]", "invalid_value")
    text = await asyncio.to_thread(state.tokenizer.decode, tokens)
    return web.json_response({"prompt": text, "content": text})
