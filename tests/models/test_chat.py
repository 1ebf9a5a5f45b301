"""The chat template, message checks, and the parser of generations (whole and streamed)."""

import itertools
import json
import random

import pytest

from tandem.models.chat import (
    ChatError, ContentDelta, ParsedOutput, ReasoningDelta, StreamParser, ToolCallParsed, collect,
    parse_output, render_chat,
)

TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def opencode_conversation() -> list[dict]:
    """The shape opencode sends in a tool loop: reasoning back as reasoning_content, arguments
    re-serialised compactly, then the tool's result."""
    return [
        {"role": "system", "content": "You are opencode."},
        {"role": "user", "content": [{"type": "text", "text": "What is in a.txt?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Read it first.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "read", "arguments": '{"path":"a.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "héllo"},
        {"role": "assistant", "content": "It says héllo.", "reasoning_content": "Done.\n"},
        {"role": "user", "content": "Thanks"},
    ]


EXPECTED = (
    "<|im_start|>system\n"
    "You are opencode.\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions to assist with the user query.\n"
    "\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "read", "description": "Read a file", '
    '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}, '
    '"required": ["path"]}}}\n'
    "</tools>\n"
    "\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "What is in a.txt?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "<think>\n"
    "Read it first.\n"
    "</think>\n"
    "\n"
    "<tool_call>\n"
    '{"name": "read", "arguments": {"path": "a.txt"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n"
    "héllo\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    "<think>\n"
    "Done.\n"
    "</think>\n"
    "\n"
    "It says héllo.<|im_end|>\n"
    "<|im_start|>user\n"
    "Thanks<|im_end|>\n"
    "<|im_start|>assistant\n"
    "<think>\n"
)


def test_an_opencode_conversation_renders_to_the_qwen3_format():
    assert render_chat(opencode_conversation(), tools=TOOLS) == EXPECTED


def test_rendering_a_longer_conversation_only_appends():
    messages = opencode_conversation()
    shorter = render_chat(messages[:4], tools=TOOLS, add_generation_prompt=False)
    assert render_chat(messages, tools=TOOLS).startswith(shorter)


def test_without_tools_or_system_the_first_turn_is_the_users():
    assert render_chat([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert render_chat([{"role": "developer", "content": "S"}, {"role": "user", "content": "Hi"}],
                       tools=[], add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_generation_prompt_closes_an_empty_think_block_when_thinking_is_off():
    text = render_chat([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_preserve_thinking_renders_the_reasoning_of_every_earlier_answer():
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "a", "reasoning_content": "think a"},
        {"role": "user", "content": "B"},
        {"role": "assistant", "content": "b", "reasoning": "think b"},
        {"role": "user", "content": "C"},
    ]
    text = render_chat(messages)
    assert "<|im_start|>assistant\n<think>\nthink a\n</think>\n\na<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nthink b\n</think>\n\nb<|im_end|>" in text
    qwen3 = render_chat(messages, preserve_thinking=False)
    assert "think a" not in qwen3 and "<|im_start|>assistant\na<|im_end|>" in qwen3


def test_an_answer_without_reasoning_renders_an_empty_think_block():
    text = render_chat([{"role": "user", "content": "A"}, {"role": "assistant", "content": "a"}],
                       add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\na<|im_end|>\n")


def test_a_think_block_in_content_is_split_out_as_reasoning():
    as_field = render_chat([{"role": "user", "content": "A"},
                            {"role": "assistant", "content": "a", "reasoning_content": "r"}])
    in_content = render_chat([{"role": "user", "content": "A"},
                              {"role": "assistant", "content": "<think>\nr\n</think>\n\na"}])
    assert in_content == as_field


def test_consecutive_tool_results_share_one_user_turn():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": {"x": [1, 2]}}},
        ]},
        {"role": "tool", "tool_call_id": "1", "content": "r1"},
        {"role": "tool", "tool_call_id": "2", "content": "r2"},
    ]
    assert render_chat(messages, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nTwo calls.\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"x": [1, 2]}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n")


def test_a_parsed_answer_renders_back_to_the_text_the_model_wrote():
    prompt = render_chat([{"role": "user", "content": "Hi"}], tools=TOOLS)
    generated = ('I will read it.\n</think>\n\nLet me look.\n<tool_call>\n'
                 '{"name": "read", "arguments": {"path": "ü.txt", "n": 2}}\n</tool_call>')
    parsed = parse_output(generated)
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(
        json.loads(c["function"]["arguments"]), separators=(",", ":"))}}
        for c in parsed.tool_calls]  # as opencode sends them back
    message = {"role": "assistant", "content": parsed.content,
               "reasoning_content": parsed.reasoning, "tool_calls": calls}
    again = render_chat([{"role": "user", "content": "Hi"}, message], tools=TOOLS,
                        add_generation_prompt=False)
    assert again == prompt + generated + "<|im_end|>\n"


@pytest.mark.parametrize("message, expected", [
    ({"role": "robot", "content": "x"}, r"messages\[1\]: unknown role 'robot'"),
    ({"content": "x"}, r"messages\[1\]: unknown role None"),
    ({"role": "user"}, r"messages\[1\]: a user message needs content"),
    ({"role": "tool", "content": None}, r"messages\[1\]: a tool message needs content"),
    ({"role": "assistant"}, r"messages\[1\]: an assistant message needs content"),
    ({"role": "tool", "content": [{"type": "image_url", "image_url": {}}]},
     r"messages\[1\]\.content\[0\]: content of type 'image_url' is not supported"),
    ({"role": "user", "content": 5}, r"content must be a string or a list of text parts"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
     r"messages\[1\]\.tool_calls\[0\]: arguments are not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     r"tool_calls\[0\]: arguments must be a JSON object, got list"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]},
     r"tool_calls\[0\]: missing 'function' object"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]},
     r"tool_calls\[0\]: the function has no name"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "x"}},
     r"tool_calls must be a list"),
    ("hello", r"messages\[1\] is not an object"),
])
def test_a_bad_message_is_a_chat_error_naming_it(message, expected):
    with pytest.raises(ChatError, match=expected):
        render_chat([{"role": "user", "content": "ok"}, message])


def test_bad_message_lists_and_tools_are_chat_errors():
    with pytest.raises(ChatError, match="messages is empty"):
        render_chat([])
    with pytest.raises(ChatError, match="list of message objects"):
        render_chat("hi")
    with pytest.raises(ChatError, match=r"tools\[0\]: the function has no name"):
        render_chat([{"role": "user", "content": "x"}], tools=[{"type": "function",
                                                                 "function": {}}])


def test_a_template_error_is_a_chat_error():
    with pytest.raises(ChatError, match="boom"):
        render_chat([{"role": "user", "content": "x"}], template="{{ raise_exception('boom') }}")
    with pytest.raises(ChatError, match="does not compile"):
        render_chat([{"role": "user", "content": "x"}], template="{% if %}")


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_parse_output_splits_reasoning_content_and_tool_calls():
    text = ("Need the file.\n</think>\n\nReading it now.\n<tool_call>\n"
            '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>\n'
            "<tool_call>\n{\"name\": \"ls\", \"arguments\": \"{\\\"d\\\": 1}\"}\n</tool_call>")
    assert parse_output(text, make_id=ids()) == ParsedOutput(
        reasoning="Need the file.", content="Reading it now.", tool_calls=[
            {"id": "call_0", "type": "function",
             "function": {"name": "read", "arguments": '{"path": "a.txt"}'}},
            {"id": "call_1", "type": "function",
             "function": {"name": "ls", "arguments": '{"d": 1}'}},
        ])


@pytest.mark.parametrize("text, thinking, expected", [
    ("still thinking", True, ParsedOutput("still thinking", "", [])),
    ("\n</think>\n\nHi!", True, ParsedOutput(None, "Hi!", [])),
    ("<think>\nr\n</think>\n\nx", True, ParsedOutput("r", "x", [])),
    ("Hi </think> there", False, ParsedOutput(None, "Hi </think> there", [])),
    ("r</think>a <tool_call>\n{oops}\n</tool_call> b", True,
     ParsedOutput("r", "a <tool_call>\n{oops}\n</tool_call> b", [])),
    ("r</think>a <tool_call>\n{\"name\": \"f\", \"argu", True,
     ParsedOutput("r", "a <tool_call>\n{\"name\": \"f\", \"argu", [])),
    ('</think><tool_call>{"name": "f", "arguments": [1]}</tool_call>', True,
     ParsedOutput(None, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
])
def test_parse_output_keeps_what_is_not_a_tool_call_as_content(text, thinking, expected):
    assert parse_output(text, thinking=thinking) == expected


GENERATIONS = [
    ("Need the file.\n</think>\n\nReading it now.\n<tool_call>\n"
     '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', True),
    ("  <think>\n\n我想想 🎉 < </thin </think>\n\nAnswer with <b>tags</b> and <tool_ "
     "and <tool_call>\n{bad}\n</tool_call>  tail  \n", True),
    ("Plain answer\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"<tool_call>\"}}"
     "\n</tool_call>\nafter", False),
    ("cut off in reasoning </thi", True),
    ("r</think>x<tool_call>\n{\"name\": \"f\"", True),
    ("<thi", True),
    ("   ", True),
    ("", False),
]


def stream(text: str, pieces: list[str], thinking: bool):
    parser = StreamParser(thinking=thinking, make_id=ids())
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    assert "".join(pieces) == text
    return events


@pytest.mark.parametrize("text, thinking", GENERATIONS)
def test_stream_parser_fed_one_character_at_a_time_equals_parse_output(text, thinking):
    events = stream(text, list(text), thinking)
    assert collect(events) == parse_output(text, thinking=thinking, make_id=ids())
    calls = [e for e in events if isinstance(e, ToolCallParsed)]
    assert [e.index for e in calls] == list(range(len(calls)))
    assert all(e.text for e in events if isinstance(e, (ReasoningDelta, ContentDelta)))


@pytest.mark.parametrize("text, thinking", GENERATIONS)
def test_stream_parser_on_random_chunks_equals_parse_output(text, thinking):
    rng = random.Random(len(text))
    expected = parse_output(text, thinking=thinking, make_id=ids())
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert collect(stream(text, pieces, thinking)) == expected


def test_stream_parser_holds_back_a_partial_tag():
    parser = StreamParser()
    assert parser.feed("reasoning </thi") == [ReasoningDelta("reasoning")]
    assert parser.feed("nk>\n\nok <tool") == [ContentDelta("ok")]
    assert parser.feed("_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call") == []
    events = parser.feed(">")
    assert len(events) == 1 and events[0].tool_call["function"]["name"] == "f"
    assert parser.finish() == []


def test_an_image_part_of_a_user_message_renders_as_the_vision_placeholder_as_qwen3_5s_does():
    """tandem's template and Qwen3.5's write the same placeholder for an image part; the
    text around it stays where the client put it."""
    from tandem.models.chat import render_prompt

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look: "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " what is it?"}]}]
    text = render_chat(messages, enable_thinking=False)
    assert "look: <|vision_start|><|image_pad|><|vision_end|> what is it?" in text
    # the placeholder is the template's: a client's own placeholder text is marked as text
    typed = [{"role": "user", "content": "<|image_pad|>"}]
    prompt = render_prompt(typed, control_tokens=("<|image_pad|>", "<|im_start|>", "<|im_end|>"))
    assert "<|image_pad|>" not in prompt._marked and prompt.text.count("<|image_pad|>") == 1
