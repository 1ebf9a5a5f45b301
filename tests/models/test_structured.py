"""The grammars of structured outputs and forced tool choices (tandem.models.structured): each
takes the text the model's own format writes, the parser reads that text back as the call, and
what OpenAI's API does not take is refused naming its field."""

from __future__ import annotations

import llguidance as llg
import pytest

from tandem.grammar import check, from_lark, ll_tokenizer
from tandem.models.chat import parse_output
from tandem.models.structured import StructuredError, build_lark
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\nnorth\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_qwen_tokenizer(tmp_path_factory.mktemp("tok")))


def takes(tok, lark: str, text: str) -> bool:
    """Whether the grammar takes the whole text, token by token, and is then complete."""
    grammar = from_lark(lark)
    check(grammar, tok)
    matcher = llg.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
    return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt, call, arguments", [
    ("json", JSON_CALL, '{"city": "Paris", "days": 3}'),
    ("xml", XML_CALL, '{"city": "Paris\\nnorth", "days": 3}')])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_required_call_in_the_templates_form_is_taken_and_parses(tok, fmt, call, arguments,
                                                                   thinking):
    lark = build_lark(thinking=thinking, special_ids=tok.special_ids, tools=[WEATHER, NOOP],
                      tool_choice="required", tool_format=fmt)
    text = ("I should look it up.</think>\n\n" if thinking else "") + call
    assert takes(tok, lark, text)
    assert not takes(tok, lark, text.replace("get_weather", "get_wether"))
    assert not takes(tok, lark, "Sure! " + call)
    parsed = parse_output(text, thinking=thinking, tools=[WEATHER])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] \
        == [("get_weather", arguments)]


def test_a_call_needs_its_required_arguments_and_no_others(tok):
    lark = build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER],
                      tool_choice="required")
    assert not takes(tok, lark, JSON_CALL.replace('"city": "Paris", ', ""))
    assert not takes(tok, lark, JSON_CALL.replace('"days": 3', '"days": 3, "x": 1'))
    xml = build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER],
                     tool_choice="required", tool_format="xml")
    assert not takes(tok, xml, XML_CALL.replace("<parameter=city>\nParis\nnorth\n</parameter>\n",
                                                ""))


def test_a_named_choice_takes_one_call_of_that_function_only(tok):
    lark = build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER, NOOP],
                      tool_choice={"type": "function", "function": {"name": "noop"}})
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert takes(tok, lark, noop)
    assert not takes(tok, lark, JSON_CALL)
    assert not takes(tok, lark, noop + "\n" + noop)
    required = build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER, NOOP],
                          tool_choice="required")
    assert takes(tok, required, noop + "\n" + JSON_CALL)


def test_the_reasoning_ends_at_its_own_token_and_the_answer_is_json(tok):
    lark = build_lark(thinking=True, special_ids=tok.special_ids,
                      response_format={"type": "json_object"})
    assert takes(tok, lark, 'Hmm, JSON.</think>\n\n{"a": [1, 2]}')
    assert not takes(tok, lark, 'Hmm</think> then more</think>\n\n{"a": 1}')
    assert not takes(tok, lark, 'Hmm <tool_call></think>\n\n{"a": 1}')
    assert not takes(tok, lark, "Hmm</think>\n\n[1]")


def test_auto_with_tools_and_a_json_format_takes_either(tok):
    lark = build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER],
                      tool_choice="auto", response_format={"type": "json_object"})
    assert takes(tok, lark, '{"a": 1}') and takes(tok, lark, JSON_CALL)
    assert build_lark(thinking=False, special_ids=tok.special_ids, tools=[WEATHER],
                      tool_choice="auto") is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_a_shape_openai_does_not_take_is_refused_naming_its_field(tok, fields, param):
    with pytest.raises(StructuredError) as e:
        build_lark(thinking=False, special_ids=tok.special_ids, **fields)
    assert e.value.param == param
