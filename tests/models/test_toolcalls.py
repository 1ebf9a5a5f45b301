"""A checkpoint's own template and the XML tool-call form it teaches (tandem/models/toolcalls.py,
tandem/models/chat.py).

templates/qwen3_5.jinja is the chat template the Qwen3.5 checkpoints ship (public, data);
templates/qwen3_6.jinja is not a downloaded file: it is Qwen3.5's with the three differences a
copy of Qwen3.6's (in llama.cpp's webui test data) shows: ``preserve_thinking``, thinking on by
default, and non-string values written with ``tojson`` (Qwen3.5 writes them with ``| string``:
``True``, ``None``)."""

import itertools
import json
import random
from pathlib import Path

import pytest

from tandem.models.chat import (
    ChatError, ContentDelta, ParsedOutput, ReasoningDelta, StreamParser, ToolCallArguments,
    ToolCallParsed, ToolCallStarted, collect, default_chat_template, parse_output, render_chat,
    render_prompt, template_info)
from tandem.models.toolcalls import convert_value

TEMPLATES = Path(__file__).with_name("templates")
QWEN35 = (TEMPLATES / "qwen3_5.jinja").read_text()
QWEN36 = (TEMPLATES / "qwen3_6.jinja").read_text()

TOOLS = [{"type": "function", "function": {
    "name": "edit", "description": "Edit a file",
    "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string"},
        "oldString": {"type": "string"},
        "replaceAll": {"type": "boolean"},
        "line": {"type": "integer"},
        "ratio": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {
        "name": "read", "parameters": {"type": "object", "properties": {
            "filePath": {"type": "string"}, "limit": {"type": "integer"}}}}}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args_of(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.tool_calls]


# -- templates -------------------------------------------------------------------------------


def test_the_qwen_templates_teach_the_xml_form_and_tandems_the_json_form():
    assert template_info(QWEN35).tool_format == "xml"
    assert template_info(QWEN36).tool_format == "xml"
    ours = template_info(None)
    assert (ours.source, ours.tool_format) == ("tandem", "json")
    # a checkpoint that ships tandem's own text (tiny, the test models) is tandem's
    assert template_info(default_chat_template()) == ours
    theirs = template_info(QWEN35)
    assert theirs.source == "checkpoint" and len(theirs.sha256) == 64
    assert theirs.sha256 != template_info(QWEN36).sha256


def test_a_checkpoint_template_renders_with_the_flags_the_request_gives_and_its_own_defaults():
    user = [{"role": "user", "content": "Hi"}]
    # Qwen3.5's template thinks only when asked; Qwen3.6's unless told not to
    assert not render_prompt(user, template=QWEN35, enable_thinking=None).thinking
    assert render_prompt(user, template=QWEN35, enable_thinking=True).thinking
    assert render_prompt(user, template=QWEN36, enable_thinking=None).thinking
    off = render_prompt(user, template=QWEN36, enable_thinking=False)
    assert not off.thinking and off.text.endswith("<think>\n\n</think>\n\n")
    earlier = [{"role": "user", "content": "A"},
               {"role": "assistant", "content": "a", "reasoning_content": "thought about a"},
               {"role": "user", "content": "B"}]
    assert "thought about a" not in render_chat(earlier, template=QWEN36,
                                                preserve_thinking=None)
    assert "<think>\nthought about a\n</think>\n\na" in render_chat(
        earlier, template=QWEN36, preserve_thinking=True)


def test_a_qwen_template_that_refuses_the_messages_is_a_chat_error():
    with pytest.raises(ChatError, match="No user query found"):
        render_chat([{"role": "system", "content": "s"}], template=QWEN35)


# -- the XML form ----------------------------------------------------------------------------


@pytest.mark.parametrize("key, raw, value", [
    ("line", "42", 42),
    ("line", "forty", "forty"),  # not of its type: the text as written
    ("ratio", "0.5", 0.5),
    ("ratio", "3.0", 3),  # an integral number is an int, as vLLM gives it
    ("replaceAll", "true", True),
    ("replaceAll", "False", False),  # Qwen3.5 renders the client's false back as False
    ("replaceAll", "maybe", "maybe"),
    ("tags", '["a", "b"]', ["a", "b"]),
    ("options", '{"deep": {"x": null}}', {"deep": {"x": None}}),
    ("options", "{'k': True}", {"k": True}),  # a Python literal, as Qwen3.5 may write one
    ("note", "None", None),
    ("note", "null", None),
    ("filePath", "null", "null"),  # a string stays a string
    ("filePath", " 42 ", " 42 "),
    ("unknown", "7", "7"),  # a key the schema lacks: a string
])
def test_xml_values_take_the_types_of_the_tool_schema(key, raw, value):
    text = "ok\n</think>\n\n" + xml_call("edit", **{key: raw})
    (call,) = args_of(parse_output(text, tools=TOOLS))
    assert call == ("edit", {key: value})
    assert json.dumps(convert_value(raw, TOOLS[0]["function"]["parameters"]["properties"]
                                    .get(key))) == json.dumps(value)


def test_a_string_value_keeps_its_inner_newlines_less_the_one_the_template_writes_each_side():
    old = "\n  def f():\n\n      return 1\n"
    text = "r</think>" + xml_call("edit", filePath="/a.py", oldString=old)
    (call,) = args_of(parse_output(text, tools=TOOLS))
    assert call[1] == {"filePath": "/a.py", "oldString": old}


def test_several_xml_calls_in_one_answer_come_back_in_order():
    text = ("Two reads.\n</think>\n\nReading both.\n\n" + xml_call("read", filePath="a", limit="5")
            + "\n" + xml_call("read", filePath="b") + "\n")
    parsed = parse_output(text, tools=TOOLS, make_id=ids())
    assert parsed.reasoning == "Two reads." and parsed.content == "Reading both."
    assert args_of(parsed) == [("read", {"filePath": "a", "limit": 5}),
                               ("read", {"filePath": "b"})]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]


@pytest.mark.parametrize("call", [
    xml_call("read", filePath="a.txt"),
    '<tool_call>\n{"name": "read", "arguments": {"filePath": "a.txt"}}\n</tool_call>',
])
def test_a_call_written_inside_an_unclosed_think_ends_the_reasoning(call):
    text = "I need the file, so I read it.\n\n" + call
    parsed = parse_output(text, tools=TOOLS)
    assert parsed.reasoning == "I need the file, so I read it."
    assert parsed.content == ""
    assert args_of(parsed) == [("read", {"filePath": "a.txt"})]
    assert collect(stream(text, list(text))) == parse_output(text, tools=TOOLS, make_id=ids())


def test_a_call_whose_tool_call_close_never_came_is_still_a_call_at_its_function_close():
    text = "r</think>" + xml_call("read", filePath="a")[:-len("\n</tool_call>")]
    assert args_of(parse_output(text, tools=TOOLS)) == [("read", {"filePath": "a"})]


@pytest.mark.parametrize("text", [
    "r</think>a <tool_call>\n<function=>\n</function>\n</tool_call> b",  # no name
    "r</think>a <tool_call>\n<function=read\n<parameter=x>\n1\n</parameter>\n</function>\n"
    "</tool_call> b",  # the name's tag never closes on its line
    "r</think>a <tool_call>\nhello <function=read>\n</function>\n</tool_call> b",  # text first
    "r</think>a <tool_call>\n<func <function=read>\n</function>\n</tool_call> b",
])
def test_a_malformed_xml_block_stays_text(text):
    parsed = parse_output(text, tools=TOOLS)
    assert parsed.tool_calls == []
    assert parsed.content == text.split("</think>", 1)[1].strip()
    assert collect(stream(text, list(text))).content == parsed.content


def test_text_between_parameters_is_skipped_and_a_repeated_key_keeps_its_first_value():
    text = ("r</think><tool_call>\n<function=read>\nnoise <b>\n<parameter=filePath>\na\n"
            "</parameter>\n<parameter=filePath>\nb\n</parameter>\n</function>\n</tool_call>")
    assert args_of(parse_output(text, tools=TOOLS)) == [("read", {"filePath": "a"})]


XML_GENERATIONS = [
    "Edit it.\n</think>\n\nOn it.\n\n" + xml_call(
        "edit", filePath="/src/ü.py", oldString="a \"quoted\"\\ line\n\tand </param> more",
        replaceAll="true", line="3", tags='["x"]', note="None"),
    "thinking <tool_call" + ">\n<function=read>\n<parameter=filePath>\nx\n</parameter>\n"
    "</function>\n</tool_call>\n" + xml_call("edit", ratio="2.5") + " tail",
    "r</think>" + xml_call("read") + "<tool_call>\n{\"name\": \"read\", \"arguments\": {}}\n"
    "</tool_call>",
    "r</think><tool_call>\n<function=read>\n<parameter=filePath>\n\n\n</parameter>\n"
    "</function>   </tool_",
]


def stream(text: str, pieces: list[str], tools=TOOLS):
    parser = StreamParser(make_id=ids(), tools=tools)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    assert "".join(pieces) == text
    return events


@pytest.mark.parametrize("text", XML_GENERATIONS)
def test_a_streamed_xml_answer_adds_up_to_the_whole_text_parsed(text):
    expected = parse_output(text, tools=TOOLS, make_id=ids())
    assert expected.tool_calls
    assert collect(stream(text, list(text))) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert collect(stream(text, pieces)) == expected


def test_a_streamed_xml_call_sends_its_name_first_then_its_arguments_as_they_come():
    parser = StreamParser(make_id=ids(), tools=TOOLS)
    assert parser.feed("ok</think>\n\n<tool_call>\n<function=ed") == [ReasoningDelta("ok")]
    assert parser.feed("it>\n") == [ToolCallStarted(0, "call_0", "edit")]
    assert parser.feed("<parameter=oldString>\nline one\nline") == [
        ToolCallArguments(0, '{"oldString": "line one\\nline')]
    # the newline before </parameter> is held until it is known not to be the value's
    assert parser.feed(" two\n") == [ToolCallArguments(0, " two")]
    # a value of another type goes whole, once its </parameter> is read
    assert parser.feed("</parameter>\n<parameter=line>\n1") == [
        ToolCallArguments(0, '", "line": ')]
    assert parser.feed("2\n</parameter>\n") == [ToolCallArguments(0, "12")]
    assert parser.feed("</function>\n</tool_call>") == [ToolCallArguments(0, "}")]
    assert parser.finish() == [] and parser.num_calls == 1


def test_a_stream_that_stops_inside_an_xml_call_has_sent_the_name_but_made_no_whole_call():
    text = "r</think>" + xml_call("read", filePath="abc")[:-30]
    parser = StreamParser(make_id=ids(), tools=TOOLS)
    events = parser.feed(text) + parser.finish()
    assert events[:2] == [ReasoningDelta("r"), ToolCallStarted(0, "call_0", "read")]
    assert "".join(e.text for e in events[2:]) == '{"filePath": "abc'
    assert parser.num_calls == 0
    assert parse_output(text, tools=TOOLS).tool_calls == []  # whole, it stays text


def test_the_json_form_still_arrives_whole_while_the_template_teaches_xml():
    text = 'r</think><tool_call>\n{"name": "read", "arguments": {"filePath": "a"}}\n</tool_call>'
    events = stream(text, list(text))
    assert [type(e) for e in events if not isinstance(e, (ReasoningDelta, ContentDelta))] == \
        [ToolCallParsed]


def test_an_xml_answer_sent_back_as_openai_json_renders_as_the_model_wrote_it():
    """Qwen3.6 writes non-string values with tojson: the parsed call, sent back as opencode
    sends it (arguments a compact JSON string), renders to the generated text exactly."""
    messages = [{"role": "user", "content": "edit it"}]
    prompt = render_chat(messages, tools=TOOLS, template=QWEN36)
    generated = ("I will edit.\n</think>\n\n" + xml_call(
        "edit", filePath="/a.py", oldString="x = 1\ny = 2", replaceAll="true", line="7",
        tags='["a", "b"]'))
    parsed = parse_output(generated, tools=TOOLS)
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(
        json.loads(c["function"]["arguments"]), separators=(",", ":"))}}
        for c in parsed.tool_calls]
    message = {"role": "assistant", "content": parsed.content,
               "reasoning_content": parsed.reasoning, "tool_calls": calls}
    again = render_chat(messages + [message], tools=TOOLS, template=QWEN36,
                        add_generation_prompt=False)
    assert again == prompt + generated + "<|im_end|>\n"


def test_a_chat_template_file_beside_the_tokenizer_is_the_checkpoints(tmp_path):
    """Newer checkpoints ship the template as chat_template.jinja, not in tokenizer_config."""
    from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

    write_qwen_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(QWEN35)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == QWEN35
    assert (template_info(tok.chat_template).source,
            template_info(tok.chat_template).tool_format) == ("checkpoint", "xml")
