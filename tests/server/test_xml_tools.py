"""A checkpoint whose own template is Qwen3.5's (tests/models/templates/qwen3_5.jinja, in its
tokenizer_config.json) through the HTTP server with the OpenAI SDK, on the small real model: the
engine is made to write the model's answers through the admin field tandem_forced_output. Its
tool calls, in the XML form the template teaches, reach the client as tool calls, streamed and
not; the opencode-shaped next turn (the call sent back as OpenAI JSON, rendered again as XML by
the template) resumes at the end anchor (greedy gate: the state was written by decoding)."""

import hashlib
import json
from pathlib import Path

import aiohttp
import pytest

from opencode_copy import opencode_copy
from small_hybrid import make_small_hybrid

from tandem.models import load_model
from tandem.server.app import build_app

QWEN35 = (Path(__file__).parents[1] / "models" / "templates" / "qwen3_5.jinja").read_text()
SYSTEM = ("You are opencode, an interactive CLI agent for software engineering tasks. "
          "Working directory: /home/user/project. " * 8)
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string", "description": "Absolute path of the file"},
        "limit": {"type": "integer"}, "force": {"type": "boolean"},
        "ranges": {"type": "array", "items": {"type": "integer"}}},
        "required": ["filePath"]}}},
    {"type": "function", "function": {
        "name": "bash", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
THINK_ON = {"chat_template_kwargs": {"enable_thinking": True}}
CALL = ("<tool_call>\n<function=read>\n<parameter=filePath>\n/home/user/project/src/app.py\n"
        "</parameter>\n<parameter=limit>\n50\n</parameter>\n<parameter=force>\ntrue\n"
        "</parameter>\n<parameter=ranges>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")
CALL_ARGS = {"filePath": "/home/user/project/src/app.py", "limit": 50, "force": True,
             "ranges": [1, 2]}


@pytest.fixture(scope="module")
def xml_loaded(tmp_path_factory):
    """The small hybrid with the real Qwen tokenizer and Qwen3.5's own chat template."""
    path = make_small_hybrid(tmp_path_factory.mktemp("models") / "small35")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN35
    config_path.write_text(json.dumps(config))
    return load_model(str(path), path.parent, "float32")


@pytest.fixture
async def server(xml_loaded, make_config, serve):
    app = build_app(make_config(allow_forced_output=True, window=4096), xml_loaded)
    async with serve(app) as server:
        yield server


async def _chat(client, messages, forced, **kw):
    extra = {"tandem_forced_output": forced, **THINK_ON, **kw.pop("extra_body", {})}
    return await client.chat.completions.create(model="small35", messages=messages,
                                                tools=TOOLS, max_tokens=200, temperature=0,
                                                extra_body=extra, **kw)


def _user(text="Fix the failing test in src/app.py"):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


async def _health(server) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
            return await resp.json()


async def test_models_and_health_say_which_template_and_tool_format_are_in_use(
        server, small_loaded, make_config, serve, sdk):
    (card,) = (await sdk(server).models.list()).data
    checkpoint = {"source": "checkpoint",
                  "sha256": hashlib.sha256(QWEN35.encode()).hexdigest()}
    assert card.model_extra["chat_template"] == checkpoint
    assert card.model_extra["tool_call_format"] == "xml"
    health = await _health(server)
    assert (health["chat_template"], health["tool_call_format"]) == (checkpoint, "xml")
    # the test model ships tandem's own template: tandem's, the JSON form
    async with serve(build_app(make_config(), small_loaded)) as other:
        card = (await sdk(other).models.retrieve("small")).model_extra
        assert card["chat_template"]["source"] == "tandem"
        assert card["tool_call_format"] == "json"
        assert (await _health(other))["tool_call_format"] == "json"


async def test_an_xml_call_comes_back_as_a_typed_tool_call(server, sdk):
    resp = await _chat(sdk(server), _user(), "The test is in src/app.py; I should read it.\n"
                       "</think>\n\n" + CALL)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == \
        "The test is in src/app.py; I should read it."
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "read"
    assert json.loads(call.function.arguments) == CALL_ARGS


async def test_a_streamed_xml_call_sends_its_name_first_then_its_arguments(server, sdk):
    stream = await _chat(sdk(server), _user(), "I should read it.\n</think>\n\nReading.\n\n"
                         + CALL + "\n" + CALL.replace("src/app.py", "tests/test_app.py"),
                         stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    deltas = [(i, d) for i, c in enumerate(chunks) if c.choices
              for d in (c.choices[0].delta.tool_calls or [])]
    firsts = [(i, d) for i, d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for _, d in firsts] == \
        [(0, "function", "read", ""), (1, "function", "read", "")]
    for index in (0, 1):
        pieces = [d for _, d in deltas if d.index == index and d.id is None]
        assert len(pieces) > 2  # the arguments as they come, not in one piece
        assert all(d.function.name is None for d in pieces)
        assert json.loads("".join(d.function.arguments for d in pieces)) == (
            CALL_ARGS if index == 0 else {**CALL_ARGS,
                                          "filePath": "/home/user/project/tests/test_app.py"})
    # the second call's name went out before its arguments had all been written
    assert firsts[1][0] < max(i for i, d in deltas if d.index == 1)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Reading."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_inside_the_unclosed_reasoning_ends_it(server, sdk, stream):
    forced = "The test is in src/app.py; I should read it.\n\n" + CALL
    resp = await _chat(sdk(server), _user(), forced, stream=stream)
    if stream:
        chunks = [c async for c in resp]
        reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                            for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        name = calls[0].function.name
        arguments = "".join(d.function.arguments or "" for d in calls)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and
                  c.choices[0].finish_reason]
    else:
        message = resp.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        (call,) = message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, \
            [resp.choices[0].finish_reason]
    assert reasoning == "The test is in src/app.py; I should read it."
    assert (name, json.loads(arguments), finish) == ("read", CALL_ARGS, ["tool_calls"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_block_stays_text_and_the_request_succeeds(server, sdk, stream):
    block = "<tool_call>\n<function=>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    resp = await _chat(sdk(server), _user(), "Hmm.\n</think>\n\nTry " + block, stream=stream)
    if stream:
        chunks = [c async for c in resp]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and
                  c.choices[0].finish_reason]
    else:
        content, finish = resp.choices[0].message.content, [resp.choices[0].finish_reason]
        assert resp.choices[0].message.tool_calls is None
    assert content == "Try " + block and finish == ["stop"]


async def test_the_json_form_is_still_read_on_a_checkpoint_that_teaches_xml(server, sdk):
    resp = await _chat(sdk(server), _user(), 'Read.\n</think>\n\n<tool_call>\n{"name": '
                       '"bash", "arguments": {"command": "pytest -q"}}\n</tool_call>')
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("bash", {"command": "pytest -q"})


async def test_an_opencode_turn_after_an_xml_call_resumes_at_the_end_anchor(server, sdk):
    """opencode sends the call back as OpenAI JSON (arguments a compact string) with the
    reasoning as reasoning_content; Qwen3.5's template renders it again as XML, writing the
    boolean as Python's True where the model wrote true: the copy aligns by the call's value."""
    client = sdk(server)
    headers = {"x-session-id": "ses_xml_1"}
    messages = _user()
    first = await _chat(client, messages, "The test is in src/app.py; I should read it.\n"
                        "</think>\n\n" + CALL, extra_headers=headers)
    assert first.usage.model_extra["tandem"]["cache"]["source"] == "cold"
    msg = first.choices[0].message
    results = ["def add(a, b):\n    return a - b\n", "1 failed: test_add expected 3 got -1",
               "fixed"]
    for turn, result in enumerate(results):
        messages += opencode_copy(msg, result)
        # the second answer calls from inside its unclosed reasoning, as Qwen3.5 does: its
        # copy has a </think> the rows lack
        think_close = "\n\n" if turn == 1 else "\n</think>\n\n"
        resp = await _chat(client, messages, f"Step {turn + 2}: run the tests.{think_close}"
                           + CALL.replace("true", "false"), extra_headers=headers)
        cache = resp.usage.model_extra["tandem"]["cache"]
        assert cache["source"] == "end", cache
        assert cache["aligned"] == "calls", cache
        # only the tool result and the template's glue are forwarded, not the history
        assert cache["reread"] < 60, cache
        msg = resp.choices[0].message
        assert json.loads(msg.tool_calls[0].function.arguments)["force"] is False


async def test_the_reasoning_budget_leaves_an_answer_that_does_not_think_alone(
        xml_loaded, make_config, serve, sdk):
    """Qwen3.5's template does not think unless asked: there is no reasoning to budget, and a
    budget's </think> forced into the answer would change it (greedy: the same tokens)."""
    answers = []
    for budget in (0, 3):
        app = build_app(make_config(max_reasoning_tokens=budget), xml_loaded)
        async with serve(app) as server:
            resp = await sdk(server).chat.completions.create(
                model="small35", messages=_user(), max_tokens=12, temperature=0)
        assert resp.choices[0].message.model_extra["reasoning_content"] is None
        answers.append(resp.choices[0].message.content)
    assert answers[1] == answers[0] and "</think>" not in answers[1]
