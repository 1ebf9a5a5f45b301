"""The grammars of OpenAI's structured outputs and forced tool choices, in llguidance's Lark.

A grammar starts where the generation starts: after the template's generation prompt. When that
prompt opens the reasoning (``<think>\\n``) the grammar lets the reasoning run free (any text
that neither closes it nor opens a call, which the parser would read as its end) up to the
``</think>`` token and the blank line after it, then constrains the answer; otherwise it
constrains the answer from the first token. The answer is

- ``response_format`` ``json_object``: a JSON object; ``json_schema``: a JSON value valid
  against the schema (llguidance's JSON-schema compiler, ``%json``);
- ``tool_choice`` ``required``: one tool call (several with ``parallel_tool_calls``), of any of
  the tools; a named function: one call to it. A call is written in the form the template
  teaches (tandem.models.chat.tool_format_of): ``json``, ``<tool_call>\\n{"name": NAME,
  "arguments": ARGS}\\n</tool_call>`` as tandem's template renders one, or ``xml``,
  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n
  </tool_call>`` as Qwen3.5/3.6's; the arguments are valid against the tool's ``parameters``
  schema, and the text parses with tandem.models.chat.parse_output;
- ``tool_choice`` ``auto`` with tools and a JSON ``response_format``: the JSON answer or calls.

JSON is written with the separators the template's ``tojson`` writes (``", "``, ``": "``) and no
other whitespace, so a model cannot wander off in blank space. Pure: no torch, no llguidance
(the Lark text is compiled by tandem.grammar).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.models.toolcalls import is_string_param

# llguidance's JSON options: a schema's own "x-guidance" keys win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Reasoning: any text without "</think>" or "<tool_call>" spelled out (the tokens themselves are
# special: no text lexeme can be one). Where the vocabulary has no "</think>" token, its text
# ends a lazy lexeme (the first match ends it, as the parser's first "</think>" does).
_REASON = r"/(?s:.+)/ & ~/(?s:.*)(<\/think>|<tool_call>)(?s:.*)/"
_REASON_TEXT = r"/(?s:.*)<\/think>/ & ~/(?s:.*)<tool_call>(?s:.*)/"
# An XML string value and its closing tag, a lazy lexeme: it ends at the first
# "\n</parameter>\n" and holds no other "</parameter>" (the parser ends the value at the first).
_VALUE_TEXT = (r"/(?s:.*)\n<\/parameter>\n/ & "
               r"~/(?s:.*)<\/parameter>(?s:.*)<\/parameter>(?s:.*)/")


class StructuredError(ValueError):
    """A request's structured-output fields that cannot be honoured; ``param`` is the field the
    API's 400 names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _token(special_ids: Mapping[str, int], text: str) -> str:
    """A special token by id, or its text where the vocabulary has no such token."""
    return f"<[{special_ids[text]}]>" if text in special_ids else _lit(text)


def _json(schema: Any, param: str) -> str:
    if not isinstance(schema, Mapping):
        raise StructuredError("a JSON schema must be an object", param)
    options = schema.get("x-guidance", {})
    if not isinstance(options, Mapping):
        raise StructuredError("x-guidance must be an object", param)
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **options}},
                                 ensure_ascii=False)


def response_schema(response_format: Mapping[str, Any] | None) -> dict | None:
    """The JSON schema a ``response_format`` asks for; None for text (or none)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise StructuredError(f"unknown response_format type {str(kind)[:40]!r} (text, "
                              "json_object or json_schema)", "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise StructuredError("response_format json_schema needs a json_schema object "
                              "{name, schema, strict}", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise StructuredError("json_schema.name must be a non-empty string", "response_format")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise StructuredError("json_schema.strict must be a boolean", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise StructuredError("json_schema.schema must be a JSON schema object",
                              "response_format")
    return dict(schema)


def _functions(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and fn["name"]:
            out.setdefault(fn["name"], fn)
    return out


def forced_tools(tools: Sequence[Any] | None, tool_choice: Any) -> list[str] | None:
    """The functions a ``tool_choice`` forces a call of (None: it forces none)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = _functions(tools)
    if not functions:
        raise StructuredError("tool_choice forces a call but the request has no tools",
                              "tool_choice")
    if tool_choice == "required":
        return list(functions)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise StructuredError('a named tool_choice is {"type": "function", "function": '
                                  '{"name": ...}}', "tool_choice")
        if name not in functions:
            raise StructuredError(f"tool_choice names {name[:64]!r}, which is not among the "
                                  "tools", "tool_choice")
        return [name]
    raise StructuredError(f"unknown tool_choice {str(tool_choice)[:40]!r}", "tool_choice")


def _json_call(rule: str, fn: Mapping[str, Any], special_ids: Mapping[str, int]) -> list[str]:
    params = fn.get("parameters") or {"type": "object"}
    head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
    return [f"{rule}: {_token(special_ids, '<tool_call>')} {_lit(chr(10) + head)} "
            f"{rule}_args {_lit('}' + chr(10))} {_token(special_ids, '</tool_call>')}",
            f"{rule}_args: {_json(params, 'tools')}"]


def _xml_call(rule: str, fn: Mapping[str, Any], special_ids: Mapping[str, int]) -> list[str]:
    params = fn.get("parameters")
    props = params.get("properties") if isinstance(params, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    required = params.get("required", []) if isinstance(params, Mapping) else []
    lines, parts = [], []
    for i, (key, schema) in enumerate(props.items()):
        value = f"{rule}_v{i}"
        close = _lit("\n</parameter>\n")
        enum = schema.get("enum") if isinstance(schema, Mapping) else None
        if not is_string_param(schema):
            lines.append(f"{value}: {_json(schema if isinstance(schema, Mapping) else {}, 'tools')}"
                         f" {close}")
        elif isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            lines.append(f"{value}: (" + " | ".join(_lit(e) for e in enum) + f") {close}")
        else:
            lines.append(f"{value}[lazy]: {_VALUE_TEXT}")
        lines.append(f"{rule}_p{i}: {_lit(f'<parameter={key}>' + chr(10))} {value}")
        parts.append(f"{rule}_p{i}" + ("" if key in required else "?"))
    head = f"<function={fn['name']}>\n"
    lines.insert(0, f"{rule}: {_token(special_ids, '<tool_call>')} {_lit(chr(10) + head)} "
                    f"{' '.join(parts)} {_lit('</function>' + chr(10))} "
                    f"{_token(special_ids, '</tool_call>')}")
    return lines


def build_lark(*, thinking: bool, special_ids: Mapping[str, int],
               response_format: Mapping[str, Any] | None = None,
               tools: Sequence[Any] | None = None, tool_choice: Any = None,
               parallel_tool_calls: bool | None = None,
               tool_format: str = "json") -> str | None:
    """The Lark grammar of a chat request's answer, or None when it constrains nothing.
    Raises StructuredError for fields that are not what OpenAI's API takes."""
    schema = response_schema(response_format)
    forced = forced_tools(tools, tool_choice)
    if schema is None and forced is None:
        return None
    if schema is not None and forced is not None:
        raise StructuredError("a JSON response_format cannot be combined with a tool_choice "
                              "that forces a call", "response_format")
    lines: list[str] = []
    alternatives: list[str] = []
    if schema is not None:
        lines.append(f"answer: {_json(schema, 'response_format')}")
        alternatives.append("answer")
        if tool_choice != "none" and _functions(tools):
            forced = list(_functions(tools))  # auto: the JSON answer or calls
    if forced is not None:
        functions = _functions(tools)
        make = _xml_call if tool_format == "xml" else _json_call
        names = []
        for i, name in enumerate(forced):
            lines.extend(make(f"call{i}", functions[name], special_ids))
            names.append(f"call{i}")
        lines.append("call: " + " | ".join(names))
        several = parallel_tool_calls is not False and not isinstance(tool_choice, Mapping)
        lines.append('calls: call ("\\n" call)*' if several else "calls: call")
        alternatives.append("calls")
    lines.insert(0, "body: " + " | ".join(alternatives))
    if thinking and "</think>" in special_ids:
        head = ["start: reasoning body",
                f"reasoning: REASON? {_token(special_ids, '</think>')} BLANK?",
                f"REASON: {_REASON}"]
    elif thinking:
        head = ["start: reasoning BLANK? body", f"reasoning[lazy]: {_REASON_TEXT}"]
    else:
        head = ["start: BLANK? body"]
    head.append(r"BLANK: /[ \t\r\n]{1,4}/")
    return "\n".join(head + lines) + "\n"
