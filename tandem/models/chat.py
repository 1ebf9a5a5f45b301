"""Chat: OpenAI messages to prompt text, and generated text back to reasoning, content and tool
calls.

Rendering validates the messages (:class:`ChatError` names the message and the problem), turns
each tool call's ``arguments`` into a parsed JSON object and renders the Jinja template in a
sandbox. tandem's template (``chat_template.jinja``) is in the Qwen3 format and keeps every
answer's reasoning, so a conversation's rendering only grows by appending.

JSON in the prompt is written in Qwen's spelling: ``json.dumps(value, ensure_ascii=False)``, with
separators ``", "`` and ``": "`` and keys in the order given (the ``tojson`` of transformers'
chat templates). A Qwen model writes its tool calls that way, and clients send the arguments back
in their own spelling (opencode re-serialises them compactly, ``{"a":"b"}``): parsing and
re-rendering them gives back the text the model wrote, so the rendered history matches the
tokens the model generated and a cached prefix stays valid.

Encoding (:func:`encode_chat`, :class:`ChatPrompt`): the template's control tokens become their
ids; a control token's text that a client wrote anywhere (content, reasoning, system text, tool
results, tool calls, tools) is encoded as text, so no client opens a turn of another role.
Qwen's ``<think>`` and ``<tool_call>`` tags are added tokens but not special: they are read in
any text, as Qwen's tokenizer reads them (a model's own tags come back that way). JSON nesting
past ``MAX_JSON_DEPTH`` (100) levels, in tools or call arguments, is a ChatError.

Parsing: the prompt ends with ``<think>\\n`` when thinking is on, so a generation is
``REASONING</think>\\n\\nCONTENT``; a ``<tool_call>`` written before any ``</think>`` ends the
reasoning too (Qwen3.5 calls from inside an unclosed think block). ``<tool_call>`` blocks in the
content become tool calls, in either form: the JSON one (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, tandem's and Qwen3's templates teach it) and the XML one
(``<function=NAME>`` with ``<parameter=KEY>`` blocks, tandem.models.toolcalls, the Qwen3.5 /
Qwen3.6 templates teach it), its values typed by the request's tool schemas. A block that is
neither stays in the content, verbatim. Reasoning and content are stripped of surrounding
whitespace, as the template strips them when it renders them back. :class:`StreamParser` gives
the same result incrementally, never leaking a partial tag, and sends an XML call's name as
soon as it is read and its arguments as they come.

Templates: a checkpoint's own (``tokenizer_config.json``'s ``chat_template`` or a
``chat_template.jinja`` beside it) renders its prompts, with the flags the request gives
(``chat_template_kwargs``: ``enable_thinking``, ``preserve_thinking``) and its own defaults for
the rest; tandem's renders for ``tiny`` and for checkpoints that ship none
(:func:`template_info`, :func:`tool_format_of`). Whether the generation starts in its reasoning
is read from the rendered prompt (:attr:`ChatPrompt.thinking`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.models.toolcalls import XmlCall, partial_suffix, read_header, tool_properties


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
# How deep a request's JSON may nest (a tool's parameters, a call's arguments): far more than a
# JSON schema needs, far less than the depth at which a recursive parser or encoder fails.
MAX_JSON_DEPTH = 100


class ChatError(ValueError):
    """A request's messages or tools that cannot be rendered; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# Rendering


@lru_cache(maxsize=1)
def default_chat_template() -> str:
    """tandem's own chat template (Qwen3 format, every answer's reasoning kept)."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


ToolFormat = Literal["json", "xml"]
TemplateSource = Literal["tandem", "checkpoint"]


class TemplateInfo(msgspec.Struct, frozen=True):
    """Which template renders the prompts (``/v1/models`` and ``/health`` say it): ``source``
    tandem's own or the checkpoint's, ``sha256`` of its text, and the ``tool_format`` it
    teaches the model."""

    source: TemplateSource
    sha256: str
    tool_format: ToolFormat


def tool_format_of(template: str) -> ToolFormat:
    """The tool-call form a template teaches: ``xml`` when its text writes ``<function=`` (the
    Qwen3.5 / Qwen3.6 / Qwen3-Coder templates, in their instructions and in the calls they
    render back), else ``json`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
    tandem's and Qwen3's). The parser reads both forms whatever the template teaches; this is
    what the model was trained to write, and what its earlier calls render as."""
    return "xml" if "<function=" in template else "json"


@lru_cache(maxsize=8)
def template_info(template: str | None) -> TemplateInfo:
    """The info of the template a server renders with (``template``: the checkpoint's text,
    None for tandem's). A checkpoint that ships tandem's own text (``tiny``, the test models)
    renders with tandem's."""
    text = default_chat_template() if template is None else template
    source: TemplateSource = "tandem" if text == default_chat_template() else "checkpoint"
    return TemplateInfo(source, hashlib.sha256(text.encode("utf-8")).hexdigest(),
                        tool_format_of(text))


def render_chat(messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True,
                enable_thinking: bool | None = True,
                template: str | None = None,
                preserve_thinking: bool | None = True) -> str:
    """The prompt text of a conversation. ``template``: a Jinja chat template (a checkpoint's
    own); None: tandem's. ``enable_thinking``: the generation prompt opens ``<think>\\n`` (True)
    or closes an empty think block (False). ``preserve_thinking``: render the reasoning of every
    earlier answer (True) or only after the last user query (False, Qwen3's published rule).
    A flag that is None is not passed: the template's own default holds (tandem's template
    defaults both to True; a checkpoint's has its own, as under vLLM)."""
    return _render(normalize_messages(messages), normalize_tools(tools), add_generation_prompt,
                   enable_thinking, template, preserve_thinking)


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            add_generation_prompt: bool, enable_thinking: bool | None, template: str | None,
            preserve_thinking: bool | None) -> str:
    compiled = _compile(template if template is not None else default_chat_template())
    flags = {k: v for k, v in (("enable_thinking", enable_thinking),
                               ("preserve_thinking", preserve_thinking)) if v is not None}
    try:
        return compiled.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, **flags)
    except ChatError:
        raise
    except jinja2.TemplateError as e:
        raise ChatError(f"chat template failed: {e}") from None


class ChatPrompt:
    """A rendered chat as the tokenizer must read it: the template's own control tokens
    (``<|im_start|>``, ``<|im_end|>``) become their ids, and control-token text that a client
    wrote (in content, reasoning, system text, tool results, tool calls or tools) stays text,
    so that no client can open a turn of another role. The rest is encoded exactly as one
    ``tokenizer.encode`` of the whole text encodes it (special and markup tokens split the text
    the same way there), so a chat without such text has the ids it always had."""

    def __init__(self, marked: str, marks: _Marks) -> None:
        self._marked = marked
        self._marks = marks

    @property
    def text(self) -> str:
        """The prompt text, what :func:`render_chat` returns."""
        return self._marks.show(self._marked) if self._marks.used else self._marked

    @property
    def thinking(self) -> bool:
        """Whether the prompt ends inside an open ``<think>`` block (the generation prompt of a
        thinking turn), so that the generation starts with its reasoning. Read from the text,
        since a checkpoint's template decides it by its own defaults."""
        return opens_reasoning(self._marked)

    def after(self, marker: str) -> ChatPrompt | None:
        """The prompt after the first occurrence of ``marker`` (plain text with no control
        token, which the template wrote verbatim), encoded as the same marks; None when the
        text does not hold it."""
        at = self._marked.find(marker)
        if at < 0:
            return None
        return ChatPrompt(self._marked[at + len(marker):], self._marks)

    def encode(self, tokenizer: Any) -> list[int]:
        marks = self._marks
        if not marks.used:
            return tokenizer.encode(self._marked)
        ids: list[int] = []
        pos = 0
        for m in marks.control.finditer(self._marked):  # the template's: the client's are marks
            if m.start() > pos:
                ids.extend(tokenizer.encode_text(marks.show(self._marked[pos:m.start()])))
            ids.append(tokenizer.special_ids[m.group()])
            pos = m.end()
        if pos < len(self._marked):
            ids.extend(tokenizer.encode_text(marks.show(self._marked[pos:])))
        return ids


def render_prompt(messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  add_generation_prompt: bool = True,
                  enable_thinking: bool | None = True,
                  template: str | None = None,
                  preserve_thinking: bool | None = True,
                  control_tokens: Sequence[str] = ()) -> ChatPrompt:
    """The conversation rendered as :func:`render_chat` renders it, every client string's
    ``control_tokens`` text (a tokenizer's ``control_tokens``) rendered as a unique mark that
    :meth:`ChatPrompt.encode` encodes as text. Raises ChatError."""
    normalized = normalize_messages(messages)
    tool_list = normalize_tools(tools)
    while True:
        marks = _Marks(tuple(control_tokens))
        try:
            hidden = _hide(normalized, marks)
            hidden_tools = _hide(tool_list, marks)
        except _MarkInText:
            continue  # a client string holds this nonce: draw another
        break
    return ChatPrompt(_render(hidden, hidden_tools, add_generation_prompt, enable_thinking,
                              template, preserve_thinking), marks)


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None = None, **render: Any) -> list[int]:
    """The prompt ids of a conversation (:class:`ChatPrompt`); ``render``: the keyword
    arguments of :func:`render_chat`."""
    return render_prompt(messages, tools, control_tokens=tokenizer.control_tokens,
                         **render).encode(tokenizer)


def turn_starts(ids: Sequence[int], tokenizer: Any, role: str) -> list[int]:
    """The token indices where the template opens a turn of ``role`` in a chat prompt's ids:
    each ``<|im_start|>`` special token followed by the role's tokens. A client's text cannot
    make one: its control-token text is encoded as text (ChatPrompt.encode)."""
    start = tokenizer.special_ids.get("<|im_start|>")
    if start is None:
        return []
    name = list(tokenizer.encode_text(role))
    n = len(name)
    return [i for i, t in enumerate(ids) if t == start and list(ids[i + 1:i + 1 + n]) == name]


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends with an open ``<think>`` (whitespace after it aside)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


class _MarkInText(Exception):
    pass


@lru_cache(maxsize=8)
def _control_pattern(control_tokens: tuple[str, ...]) -> re.Pattern[str]:
    # longest first, so that a token that begins another never cuts it
    alternatives = sorted(control_tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in alternatives) or "(?!)")


class _Marks:
    """Control-token text in a client's strings, each occurrence replaced by a mark: ASCII
    letters and digits with a random nonce, which no template filter (trim, tojson, escaping)
    changes and no client string holds."""

    def __init__(self, control_tokens: tuple[str, ...]) -> None:
        self.tokens = control_tokens
        self.control = _control_pattern(control_tokens)
        self._index = {t: i for i, t in enumerate(control_tokens)}
        self.nonce = "tandem" + secrets.token_hex(8)
        self._mark = re.compile(self.nonce + r"c(\d+)e")
        self.used = False

    def hide(self, text: str) -> str:
        if not self.tokens:
            return text
        if self.nonce in text:
            raise _MarkInText
        # one fast substring search a token, rather than one regex pass holding the GIL
        if not any(t in text for t in self.tokens):
            return text
        self.used = True
        return self.control.sub(lambda m: f"{self.nonce}c{self._index[m.group()]}e", text)

    def show(self, text: str) -> str:
        return self._mark.sub(lambda m: self.tokens[int(m.group(1))], text)


def _hide(value: Any, marks: _Marks) -> Any:
    """A copy of normalised messages or tools with every string's control-token text marked
    (their depth is bounded: MAX_JSON_DEPTH)."""
    if isinstance(value, str):
        return marks.hide(value)
    if isinstance(value, Mapping):
        return {_hide(k, marks): _hide(v, marks) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hide(v, marks) for v in value]
    return value


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of OpenAI chat messages, in the shape the template takes: ``developer``
    becomes ``system``, ``reasoning`` becomes ``reasoning_content``, a tool call's
    ``arguments`` becomes a parsed JSON object. Raises ChatError."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatError("messages must be a list of message objects")
    if not messages:
        raise ChatError("messages is empty")
    return [_normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as given (rendered with tojson, keys in their order), checked; None or [] when
    there are none."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ChatError("tools must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatError(f"{where} is not an object")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping):
            raise ChatError(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"{where}: the function has no name")
        if nested_deeper(tool, MAX_JSON_DEPTH):
            raise ChatError(f"{where} nests more than {MAX_JSON_DEPTH} levels deep")
        out.append(dict(tool))
    return out


def _normalize_message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise ChatError(f"{where} is not an object")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise ChatError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    content = _content(m.get("content"), where, images=role == "user")
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        reasoning = m.get("reasoning_content")
        if reasoning is None:
            reasoning = m.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatError(f"{where}: reasoning_content must be a string")
        tool_calls = _tool_calls(m.get("tool_calls"), where)
        if content is None and not tool_calls and reasoning is None:
            raise ChatError(f"{where}: an assistant message needs content, reasoning_content "
                            "or tool_calls")
        out["content"] = content or ""
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if tool_calls:
            out["tool_calls"] = tool_calls
    else:
        if content is None:
            raise ChatError(f"{where}: a {role} message needs content")
        out["content"] = content
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            out["tool_call_id"] = m["tool_call_id"]
    return out


def _content(content: Any, where: str, images: bool = False) -> str | list | None:
    """A string, or a list of text parts joined; None when missing. With ``images`` (a user
    message) an ``image_url`` part is kept: the content is then the list of its text parts and
    ``{"type": "image"}`` parts, which the template renders as the vision placeholder
    (``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen3.5's does); the route reads the
    images themselves (tandem.server.images)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts: list = []
        pictures = False
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ChatError(f"{where}.content[{j}] is not a content part object")
            kind = part.get("type")
            if kind == "image_url" and images:
                texts.append({"type": "image"})
                pictures = True
                continue
            if kind != "text":
                raise ChatError(f"{where}.content[{j}]: content of type {kind!r} is not "
                                "supported (only 'text')")
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{where}.content[{j}]: a text part needs a string 'text'")
            texts.append(part["text"])
        if pictures:
            return [p if isinstance(p, dict) else {"type": "text", "text": p} for p in texts]
        return "".join(texts)
    raise ChatError(f"{where}: content must be a string or a list of text parts")


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if tool_calls is None:
        return []
    if isinstance(tool_calls, (str, bytes, Mapping)) or not isinstance(tool_calls, Sequence):
        raise ChatError(f"{where}: tool_calls must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatError(f"{at} is not an object")
        if call.get("type", "function") != "function":
            raise ChatError(f"{at}: type {call.get('type')!r} is not supported (only "
                            "'function')")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatError(f"{at}: missing 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"{at}: the function has no name")
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else None, "type": "function",
                    "function": {"name": name, "arguments": _arguments(fn.get("arguments"), at)}})
    return out


def _arguments(arguments: Any, at: str) -> dict[str, Any]:
    too_deep = ChatError(f"{at}: arguments nest more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(arguments, Mapping):
        if nested_deeper(arguments, MAX_JSON_DEPTH):
            raise too_deep
        return dict(arguments)
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}  # some clients send "" for a call without arguments
    if isinstance(arguments, str):
        if json_text_deeper(arguments, MAX_JSON_DEPTH):
            raise too_deep  # before json.loads, which recurses and fails past ~1,000 levels
        try:
            parsed = json.loads(arguments)
        except ValueError as e:
            raise ChatError(f"{at}: arguments are not valid JSON ({e}): "
                            f"{_clip(arguments)!r}") from None
        if isinstance(parsed, dict):
            return parsed
        raise ChatError(f"{at}: arguments must be a JSON object, got {type(parsed).__name__}")
    raise ChatError(f"{at}: arguments must be a JSON object or a string holding one")


_SCALARS = (str, int, float, bool, type(None))


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether decoded JSON (objects, arrays, scalars; any Mapping or list) nests more than
    ``limit`` levels: ``[]`` is one level, ``[[1]]`` two. Iterative: no depth can overflow it."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if not isinstance(c, _SCALARS))
    return False


# A JSON text's strings (skipped whole, possessively: no backtracking), its brackets, and a quote
# that opens a string that never closes.
_JSON_BRACKETS = re.compile(
    r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|(?P<open>[\[{])|(?P<close>[\]}])|(?P<unclosed>")', re.DOTALL)


def json_text_deeper(text: str, limit: int) -> bool:
    """Whether a JSON text nests more than ``limit`` levels, without parsing it (in time linear
    in its length). A parser goes no deeper than the levels open before a string that never
    closes, so the count stops there."""
    depth = 0
    for m in _JSON_BRACKETS.finditer(text):
        kind = m.lastgroup
        if kind == "open":
            depth += 1
            if depth > limit:
                return True
        elif kind == "close":
            depth -= 1
        elif kind == "unclosed":
            return False
    return False


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


def tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
           sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """The template's tojson: Qwen's spelling (see the module doc), the signature of
    transformers' chat-template filter. Jinja's own tojson sorts keys and escapes HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template does not compile: {e}") from None


# ---------------------------------------------------------------------------------------------
# Parsing a generation


class ParsedOutput(msgspec.Struct, frozen=True):
    """A generation split for the API. ``tool_calls`` are OpenAI objects: ``{"id", "type":
    "function", "function": {"name", "arguments": JSON string}}``."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a generation that starts thinking: the reasoning ends at the
    first ``</think>``, or at a ``<tool_call>`` written before any (Qwen3.5 calls from inside an
    unclosed think block); the rest then starts with that ``<tool_call>``."""
    close = text.find(THINK_CLOSE)
    call = text.find(CALL_OPEN)
    if call >= 0 and (close < 0 or call < close):
        return text[:call], text[call:]
    if close >= 0:
        return text[:close], text[close + len(THINK_CLOSE):]
    return text, ""


def parse_output(text: str, thinking: bool = True,
                 make_id: Callable[[], str] = new_call_id,
                 tools: Sequence[Any] | None = None) -> ParsedOutput:
    """Split a whole generation. ``thinking``: the prompt ended with ``<think>\\n``, so the text
    up to the first ``</think>`` (or ``<tool_call>``) is reasoning (all of it, when there is
    none: the generation stopped while thinking). Reasoning that is empty is None. ``tools``:
    the request's, whose schemas type an XML call's values."""
    reasoning = None
    body = text
    if thinking:
        head, body = _split_reasoning(text)
        r = head.strip()
        if r.startswith(THINK_OPEN):  # the model opened the block again
            r = r[len(THINK_OPEN):].strip()
        reasoning = r or None
    props = tool_properties(tools)
    content: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = body.find(CALL_OPEN, pos)
        if start < 0:
            content.append(body[pos:])
            break
        content.append(body[pos:start])
        after = start + len(CALL_OPEN)
        header = read_header(body[after:])
        if isinstance(header, tuple):  # the XML form
            name, used = header
            call = XmlCall(props.get(name))
            arguments = "".join(call.feed(body[after + used:]))
            if not call.done:  # the generation stopped inside the call: it stays text
                content.append(body[start:])
                break
            tool_calls.append(_call(make_id(), name, arguments))
            rest = call.rest.lstrip()
            pos = len(body) - len(rest)
            if rest.startswith(CALL_CLOSE):
                pos += len(CALL_CLOSE)
            continue
        end = body.find(CALL_CLOSE, after)
        if end < 0:  # unterminated: the generation stopped inside it
            content.append(body[start:])
            break
        call_json = parse_tool_call(body[after:end], make_id)
        if call_json is None:
            content.append(body[start:end + len(CALL_CLOSE)])
        else:
            tool_calls.append(call_json)
        pos = end + len(CALL_CLOSE)
    return ParsedOutput(reasoning, "".join(content).strip(), tool_calls)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_call(block: str, make_id: Callable[[], str] = new_call_id,
                    ) -> dict[str, Any] | None:
    """The OpenAI tool call of the JSON between ``<tool_call>`` and ``</tool_call>``; None when
    it is not ``{"name": str, "arguments": object}`` (arguments may also be a string holding a
    JSON object, or missing) or nests more than MAX_JSON_DEPTH levels."""
    if json_text_deeper(block, MAX_JSON_DEPTH):
        return None
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        if json_text_deeper(args, MAX_JSON_DEPTH):
            return None
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return _call(make_id(), obj["name"], json.dumps(args, ensure_ascii=False))


# ---------------------------------------------------------------------------------------------
# Streaming


class ReasoningDelta(msgspec.Struct, frozen=True, tag=True):
    """More reasoning text (a ``reasoning_content`` delta)."""

    text: str


class ContentDelta(msgspec.Struct, frozen=True, tag=True):
    """More answer text (a ``content`` delta)."""

    text: str


class ToolCallParsed(msgspec.Struct, frozen=True, tag=True):
    """A whole tool call (the JSON form), the ``index``-th of the generation."""

    index: int
    tool_call: dict[str, Any]


class ToolCallStarted(msgspec.Struct, frozen=True, tag=True):
    """The ``index``-th call's id and name, as soon as its ``<function=NAME>`` is read (the
    XML form); its arguments follow as :class:`ToolCallArguments`."""

    index: int
    call_id: str
    name: str


class ToolCallArguments(msgspec.Struct, frozen=True, tag=True):
    """More of the ``index``-th call's arguments: the fragments of a call concatenate to its
    arguments' JSON text (cut short only where the generation stopped inside the call)."""

    index: int
    text: str


StreamEvent = ReasoningDelta | ContentDelta | ToolCallParsed | ToolCallStarted | ToolCallArguments


_partial_suffix = partial_suffix


class _Stripped:
    """Emits a stream of text as ``"".join(all).strip()`` would read: leading whitespace
    dropped, trailing whitespace held until more text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        return kept


class StreamParser:
    """Text deltas in, :data:`StreamEvent` lists out; the same split as :func:`parse_output`.

    The reasoning deltas joined equal ``parse_output(text).reasoning`` (or "" for None), the
    content deltas joined equal its content, and the tool calls add up to its calls, in order
    (:func:`collect`): a JSON call arrives whole, an XML call as its name, then its arguments
    as they come. A tag that may still be forming is held back, never emitted as text. One
    difference: an XML call whose name was sent stays a call when the generation stops inside
    it (its arguments cut short, as OpenAI's are at ``length``), where :func:`parse_output`,
    seeing the whole text, keeps it as text. ``num_calls``: the calls read to their end.
    """

    def __init__(self, thinking: bool = True, make_id: Callable[[], str] = new_call_id,
                 tools: Sequence[Any] | None = None) -> None:
        self._make_id = make_id
        self._props = tool_properties(tools)
        # head -> reasoning -> content <-> call -> (json | xml -> after_xml) -> content
        self._phase = "head" if thinking else "content"
        self._buf = ""
        self._reasoning = _Stripped()
        self._content = _Stripped()
        self._xml: XmlCall | None = None
        self._index = 0  # of the next call
        self.num_calls = 0

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buf += delta
        events: list[StreamEvent] = []
        self._scan(events)
        return events

    def finish(self) -> list[StreamEvent]:
        """Events for what was held back, at the end of the generation."""
        events: list[StreamEvent] = []
        self._scan(events)
        phase, buf = self._phase, self._buf
        if phase == "head":
            self._reason(events, buf.lstrip())
        elif phase == "reasoning":
            self._reason(events, buf)
        elif phase == "content":
            self._say(events, buf)
        elif phase in ("call", "json"):  # inside an unterminated tool call: it stays content
            self._say(events, CALL_OPEN + buf)
        elif phase == "after_xml":  # the call is whole; what followed it is content
            self._say(events, buf.lstrip())
        # "xml": the generation stopped inside the call, whose name and arguments so far went
        self._buf = ""
        return events

    def _reason(self, events: list[StreamEvent], text: str) -> None:
        out = self._reasoning.feed(text)
        if out:
            events.append(ReasoningDelta(out))

    def _say(self, events: list[StreamEvent], text: str) -> None:
        out = self._content.feed(text)
        if out:
            events.append(ContentDelta(out))

    def _scan(self, events: list[StreamEvent]) -> None:
        while True:
            buf = self._buf
            phase = self._phase
            if phase == "head":
                # is the reasoning opened by a (redundant) <think>? wait until it is known
                s = buf.lstrip()
                if not s or (len(s) < len(THINK_OPEN) and THINK_OPEN.startswith(s)):
                    return
                self._buf = s[len(THINK_OPEN):] if s.startswith(THINK_OPEN) else s
                self._phase = "reasoning"
            elif phase == "reasoning":
                close, call = buf.find(THINK_CLOSE), buf.find(CALL_OPEN)
                if close < 0 and call < 0:
                    keep = max(_partial_suffix(buf, THINK_CLOSE), _partial_suffix(buf, CALL_OPEN))
                    self._reason(events, buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                if call >= 0 and (close < 0 or call < close):
                    self._reason(events, buf[:call])
                    self._buf = buf[call:]  # the call is read as content's
                else:
                    self._reason(events, buf[:close])
                    self._buf = buf[close + len(THINK_CLOSE):]
                self._phase = "content"
            elif phase == "content":
                start = buf.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(buf, CALL_OPEN)
                    self._say(events, buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._say(events, buf[:start])
                self._buf = buf[start + len(CALL_OPEN):]
                self._phase = "call"
            elif phase == "call":  # after <tool_call>: which form?
                header = read_header(buf)
                if header is None:
                    return
                if header is False:
                    self._phase = "json"
                    continue
                name, used = header
                events.append(ToolCallStarted(self._index, self._make_id(), name))
                self._xml = XmlCall(self._props.get(name))
                self._buf = buf[used:]
                self._phase = "xml"
            elif phase == "xml":
                assert self._xml is not None
                text = "".join(self._xml.feed(buf))
                self._buf = ""
                if text:
                    events.append(ToolCallArguments(self._index, text))
                if not self._xml.done:
                    return
                self._buf = self._xml.rest
                self._xml = None
                self._index += 1
                self.num_calls += 1
                self._phase = "after_xml"
            elif phase == "after_xml":  # the </tool_call> after </function>, if it comes
                s = buf.lstrip()
                if not s or (CALL_CLOSE.startswith(s) and s != CALL_CLOSE):
                    self._buf = s
                    return
                self._buf = s[len(CALL_CLOSE):] if s.startswith(CALL_CLOSE) else s
                self._phase = "content"
            else:  # "json": the text after <tool_call>, up to </tool_call>
                end = buf.find(CALL_CLOSE)
                if end < 0:
                    return
                call = parse_tool_call(buf[:end], self._make_id)
                if call is None:
                    self._say(events, CALL_OPEN + buf[:end + len(CALL_CLOSE)])
                else:
                    events.append(ToolCallParsed(self._index, call))
                    self._index += 1
                    self.num_calls += 1
                self._buf = buf[end + len(CALL_CLOSE):]
                self._phase = "content"


def collect(events: Sequence[StreamEvent]) -> ParsedOutput:
    """The ParsedOutput that a list of stream events adds up to."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, ToolCallParsed):
            calls[e.index] = e.tool_call
        elif isinstance(e, ToolCallStarted):
            calls[e.index] = _call(e.call_id, e.name, "")
        elif isinstance(e, ToolCallArguments):
            calls[e.index]["function"]["arguments"] += e.text
    return ParsedOutput(reasoning or None, content, [calls[i] for i in sorted(calls)])
