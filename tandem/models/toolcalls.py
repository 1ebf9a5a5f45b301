"""The XML tool-call form that Qwen3.5 / Qwen3.6 checkpoints are taught, read as vLLM's
``qwen3_xml`` / ``qwen3_coder`` parsers read it::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=KEY>`` and the first ``</parameter>``, less the one
newline the template writes after the opening tag and the one before the closing tag; its type is
the one the tool's JSON schema gives the key (:func:`convert_value`). Text between parameters that
is neither a parameter nor ``</function>`` is ignored, a repeated key keeps its first value, and
the call is complete at its ``</function>`` (the ``</tool_call>`` after it is expected but a
generation that stopped right after ``</function>`` still made the call).

:class:`XmlCall` reads one call incrementally, from the text after ``<function=NAME>``: it
returns the arguments' JSON text as it comes (a string value a piece at a time, another value
whole once its ``</parameter>`` is read), and the fragments concatenate to
``json.dumps(arguments, ensure_ascii=False)``. The whole-text parser and the stream parser of
:mod:`tandem.models.chat` both run it, so both give the same arguments.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"

# A function or parameter name: up to the ">" that closes its tag, on one line.
_NAME = re.compile(r"([^<>\n]*)>")
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that is a proper beginning of ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


def tool_properties(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by name (``function.parameters.properties``): what the
    values of its calls are converted to. Tools that are not well-formed give none."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _schema_type(schema: Any) -> tuple[str, bool]:
    """The type a parameter's schema names (the first that is not null, of a ``type`` list or
    an ``anyOf``), lower case, and whether it admits null. No schema or no type: string."""
    if not isinstance(schema, Mapping):
        return "string", False
    kinds: list[Any] = []
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        kinds = [o.get("type") for o in schema["anyOf"] if isinstance(o, Mapping)]
    names = [str(k).strip().lower() for k in kinds if k is not None]
    nullable = "null" in names
    rest = [k for k in names if k != "null"]
    return (rest[0] if rest else ("null" if nullable else "string")), nullable


def is_string_param(schema: Any) -> bool:
    """Whether a value of this schema is kept verbatim (and so can be streamed as it comes)."""
    kind, nullable = _schema_type(schema)
    return kind in _STRING_TYPES and not nullable


def convert_value(raw: str, schema: Any, max_depth: int = 100) -> Any:
    """A parameter's text as the type its schema gives: integer, number (an integral one as an
    int, as vLLM gives it), boolean (``true``/``false`` in any case), object and array (JSON,
    else a Python literal), null (``null`` or ``None`` where the schema admits it or the type
    is not a string). A string, or a text that is not of its type, stays the text as written."""
    from tandem.models.chat import json_text_deeper, nested_deeper

    kind, nullable = _schema_type(schema)
    word = raw.strip().lower()
    if nullable and word in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return raw
    if word in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if number != number or number in (float("inf"), float("-inf")):
            return raw  # JSON has no NaN or infinity
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return word == "true" if word in ("true", "false") else raw
    if json_text_deeper(raw, max_depth):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        pass
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw
        try:
            json.dumps(value)  # a tuple, a set or bytes is not JSON
        except (TypeError, ValueError):
            return raw
        return raw if nested_deeper(value, max_depth) else value
    return raw


def read_header(text: str) -> tuple[str, int] | None | bool:
    """``<function=NAME>`` at the start of ``text`` (after whitespace): (NAME, the length read),
    None while it may still be forming, False when the text is not such a header."""
    s = text.lstrip()
    skipped = len(text) - len(s)
    if not s:
        return None
    if not s.startswith(FUNCTION_OPEN):
        return None if FUNCTION_OPEN.startswith(s) else False
    m = _NAME.match(s, len(FUNCTION_OPEN))
    if m is None:
        # the name is still coming, unless the line or a tag began first
        rest = s[len(FUNCTION_OPEN):]
        return False if "\n" in rest or "<" in rest else None
    name = m.group(1).strip()
    if not name:
        return False
    return name, skipped + m.end()


class XmlCall:
    """One XML call read from the text after its ``<function=NAME>`` header. :meth:`feed`
    returns the arguments' JSON fragments that the text completes; :attr:`done` is set once
    ``</function>`` is read, and :attr:`rest` is what followed it."""

    def __init__(self, properties: Mapping[str, Any] | None) -> None:
        self._props = properties or {}
        self._buf = ""
        self._phase = "between"  # between -> value -> between ... -> done
        self._key: str | None = None
        self._skip = False  # the value of a repeated key: read, not sent
        self._streaming = False  # the value is a string sent as it comes
        self._started = False  # the value's leading newline has been looked at
        self._held = ""  # a string value's text not yet sent (its possible last newline)
        self._value: list[str] = []
        self._keys: set[str] = set()
        self.done = False
        self.rest = ""

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out: list[str] = []
        while not self.done and self._step(out):
            pass
        return [f for f in out if f]

    def _step(self, out: list[str]) -> bool:
        buf = self._buf
        if self._phase == "between":
            s = buf.lstrip()
            if not s:
                self._buf = ""
                return False
            if s.startswith(FUNCTION_CLOSE):
                out.append("}" if self._keys else "{}")
                self.rest = s[len(FUNCTION_CLOSE):]
                self._buf = ""
                self.done = True
                return False
            if s.startswith(PARAM_OPEN):
                m = _NAME.match(s, len(PARAM_OPEN))
                if m is None:
                    rest = s[len(PARAM_OPEN):]
                    if "\n" in rest or "<" in rest:  # not a tag: skip past its "<"
                        self._buf = s[1:]
                        return True
                    self._buf = s
                    return False
                self._open(m.group(1).strip(), out)
                self._buf = s[m.end():]
                return True
            if FUNCTION_CLOSE.startswith(s) or PARAM_OPEN.startswith(s):
                self._buf = s
                return False
            # text that is no tag: skipped up to the next "<"
            lt = s.find("<", 1)
            self._buf = s[lt:] if lt >= 0 else ""
            return lt >= 0
        # "value"
        if not self._started:
            if not buf:
                return False
            self._started = True
            if buf.startswith("\n"):
                buf = self._buf = buf[1:]
        end = buf.find(PARAM_CLOSE)
        if end >= 0:
            self._take(buf[:end], out, final=True)
            self._buf = buf[end + len(PARAM_CLOSE):]
            self._phase = "between"
            return True
        keep = partial_suffix(buf, PARAM_CLOSE)
        self._take(buf[:len(buf) - keep], out, final=False)
        self._buf = buf[len(buf) - keep:]
        return False

    def _open(self, key: str, out: list[str]) -> None:
        self._phase = "value"
        self._key = key
        self._started = False
        self._held = ""
        self._value = []
        self._skip = key in self._keys or not key
        if self._skip:
            return
        head = ("{" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._keys.add(key)
        self._streaming = is_string_param(self._props.get(key))
        out.append(head + '"' if self._streaming else head)

    def _take(self, text: str, out: list[str], final: bool) -> None:
        """A piece of the value's text; ``final``: the value ends after it."""
        text = self._held + text
        if final:
            if text.endswith("\n"):
                text = text[:-1]
            self._held = ""
        elif text.endswith("\n"):  # may be the newline before </parameter>
            text, self._held = text[:-1], "\n"
        else:
            self._held = ""
        if self._skip:
            return
        if self._streaming:
            out.append(json.dumps(text, ensure_ascii=False)[1:-1])
            if final:
                out.append('"')
            return
        self._value.append(text)
        if final:
            value = convert_value("".join(self._value), self._props.get(self._key))
            out.append(json.dumps(value, ensure_ascii=False))


_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def _plain(value: Any) -> Any:
    """A JSON value with every integral float an int (``5.0`` and ``5`` are one value)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _loose(text: str) -> Any:
    """An XML value read without a schema, so that the model's spelling and the template's
    spelling of one value read the same: JSON, or Python's ``True``/``False``/``None``, else
    the text."""
    from tandem.models.chat import json_text_deeper

    word = text.strip()
    if word in _PYTHON_WORDS:
        return _PYTHON_WORDS[word]
    if json_text_deeper(word, 100):
        return text
    try:
        return _plain(json.loads(word))
    except ValueError:
        return text


def call_value(body: str) -> list[Any] | None:
    """``[name, arguments]`` of a tool call's body (the text between ``<tool_call>`` and
    ``</tool_call>``) in either form, read without the tools' schemas: what a call is, for
    comparing the rows' call with a client's copy rendered again by the template. None when
    the body is neither form."""
    from tandem.models.chat import parse_tool_call

    header = read_header(body)
    if isinstance(header, tuple):
        name, used = header
        call = XmlCall(None)  # no schema: every value is its text
        arguments = "".join(call.feed(body[used:]))
        if not call.done:
            return None
        return [name, {k: _loose(v) for k, v in json.loads(arguments).items()}]
    parsed = parse_tool_call(body, lambda: "")
    if parsed is None:
        return None
    fn = parsed["function"]
    return [fn["name"], _plain(json.loads(fn["arguments"]))]
