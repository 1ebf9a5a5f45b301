"""Request bodies of the OpenAI routes as msgspec Structs, and their checks.

Unknown fields are ignored (clients send many harmless ones: ``user``, ``metadata``, ...); fields that would change the answer in a way tandem cannot honour are refused with a
400 naming the parameter (``n`` above the server's ``max_n``, ``suffix``, ``best_of`` > 1). A
wrong type is a 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tandem.logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from tandem.server.errors import ApiError, bad_request

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]  # OpenAI's presence / frequency range
Bias = Annotated[float, Meta(ge=-100, le=100)]  # OpenAI's logit_bias range
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
TopK = Annotated[int, Meta(ge=-1)]  # -1 and 0: every token (vLLM spells "off" -1)
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 1024
# A tenant's cache namespace (vLLM's field): requests with different salts share no cached state.
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
MAX_STOP_CHARS = 1000  # a stop string is a delimiter; OpenAI documents no bound, vLLM has none


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    # Logits processors (tandem.engine.LogitsProcessors), on generated tokens; absent or 0: off
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: PositiveInt | None = None
    # tandem's reasoning budget: past it the reasoning is closed with a hidden phrase (0: none)
    max_reasoning_tokens: Annotated[int, Meta(ge=0)] | None = None
    # Admin only (server knob allow_forced_output): text the engine is made to write, then
    # <|im_end|>. Replay's forced mode uses it to make the rows hold a recorded answer.
    tandem_forced_output: str | None = None
    cache_salt: CacheSalt | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
        return [s for s in stops if s]

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs sorted by id, zero biases left out; a key that
        is not a token id of the vocabulary is a 400."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}); "
                                  f"got {key[:32]!r}", "logit_bias")
            pairs[int(key)] = float(bias)
        return tuple(sorted((t, b) for t, b in pairs.items() if b != 0))

    def check_common(self) -> None:
        """The checks both routes share beyond the fields' types: none at present (``n`` is
        held to the server's cap by ``choices``)."""

    def choices(self, max_n: int) -> int:
        """How many choices the request asks for (n, 1 by default); over ``max_n`` a 400."""
        n = self.n or 1
        if n > max_n:
            raise bad_request(f"n is at most {max_n} on this server (max_n); got {n}", "n",
                              "unsupported_parameter")
        return n

    def salt(self, required: bool) -> str | None:
        """The request's cache salt; a 400 when the server requires one and there is none."""
        if required and self.cache_salt is None:
            raise bad_request("this server requires a cache_salt on every request "
                              "(require_cache_salt)", "cache_salt", "missing_cache_salt")
        return self.cache_salt


class ChatTemplateKwargs(msgspec.Struct, frozen=True):
    """The template flags a request may set, as vLLM takes them; one left out is left to the
    template's own default (tandem's template: both on)."""

    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: a forced tool_choice makes one call
    chat_template_kwargs: ChatTemplateKwargs | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            # OpenAI's and vLLM's answer: top_logprobs is a part of logprobs.
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        # response_format and a forcing tool_choice are read into a grammar when the prompt is
        # rendered (tandem.models.structured: a shape OpenAI does not take is a 400 there).
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise bad_request(f"unknown tool_choice {choice!r}", "tool_choice")

    @property
    def limit(self) -> int | None:
        """max_completion_tokens, else max_tokens (OpenAI's newer name wins)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def enable_thinking(self) -> bool | None:
        return None if self.chat_template_kwargs is None \
            else self.chat_template_kwargs.enable_thinking

    @property
    def preserve_thinking(self) -> bool | None:
        return None if self.chat_template_kwargs is None \
            else self.chat_template_kwargs.preserve_thinking


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    prompt: str | list[Any]
    # 0 with echo: the prompt scored (its logprobs) or echoed, nothing generated (OpenAI's
    # legacy answer, vLLM's; how lm-eval-harness reads a prompt's log-likelihood).
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    # echo: the prompt's text before the answer's; with logprobs, the prompt's logprobs too
    # (the prompt then runs cold: tandem.engine).
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of > 1:
            raise bad_request("best_of > 1 is not supported", "best_of", "unsupported_parameter")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            # vLLM's answer too (its SamplingParams: "max_tokens must be at least 1").
            raise bad_request("max_tokens 0 generates nothing: it needs echo (with logprobs, "
                              "to score the prompt)", "max_tokens", "invalid_value")

    def prompt_ids_or_text(self, vocab_size: int) -> str | list[int]:
        """The one prompt: a string, or a list of token ids (also either wrapped in a list of
        one)."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        # (in C: a 100k-token prompt was two Python loops, some 10 ms of the event loop's)
        if set(map(type, p)) == {int}:  # plain ints: a JSON true is a bool, not an id
            if min(p) < 0 or max(p) >= vocab_size:
                bad = next(t for t in p if not 0 <= t < vocab_size)
                raise bad_request(f"token id {bad} is outside the vocabulary (size "
                                  f"{vocab_size})", "prompt")
            return list(p)
        if all(isinstance(t, (str, list)) for t in p):
            raise bad_request("one prompt per request is supported", "prompt",
                              "unsupported_parameter")
        raise bad_request("prompt must be a string or a list of token ids", "prompt")


_AT = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: dict[str, Any], cls: type[msgspec.Struct]) -> Any:
    """``body`` (a decoded JSON object) as ``cls``; a wrong type or a missing field is a 400
    naming the field."""
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _AT.search(text)
        param = m.group(1) if m else None
        if param is None and (missing := re.search(r"missing required field `([^`]*)`", text)):
            param = missing.group(1)
        raise ApiError(400, f"invalid request: {text}", param=param or None,
                       code="invalid_value") from None
