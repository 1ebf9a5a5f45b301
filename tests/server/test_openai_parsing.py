"""Reasoning, content and tool calls as the API returns them, streamed and not: the engine is
the real actor around a scripted engine that "generates" the tokens of a given text."""

import json


from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.server.app import build_app

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
TOOL_ANSWER = ('The user wants the file.\n</think>\n\nLet me look.\n<tool_call>\n'
               '{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>')


def scripted_app(loaded, config, text, **engine_options):
    tok = loaded.tokenizer
    script = tok.encode(text) + [tok.special_ids["<|im_end|>"]]
    engine = ScriptedEngine(script, window=config.engine.window, **engine_options)
    actor = EngineActor("engine", make_engine=lambda: engine,
                        queue_limit=config.server.queue_limit)
    return build_app(config, loaded, engine=actor), engine


async def test_tool_calls_come_back_parsed_with_reasoning(small_loaded, make_config, serve, sdk):
    app, _ = scripted_app(small_loaded, make_config(), TOOL_ANSWER)
    async with serve(app) as server:
        resp = await sdk(server).chat.completions.create(
            model="small", tools=TOOLS, messages=[{"role": "user", "content": "read a.txt"}])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants the file."
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "read_file" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"path": "a.txt"}


async def test_streamed_tool_calls_and_reasoning_add_up_to_the_same(small_loaded, make_config,
                                                                    serve, sdk):
    app, _ = scripted_app(small_loaded, make_config(), TOOL_ANSWER)
    async with serve(app) as server:
        stream = await sdk(server).chat.completions.create(
            model="small", tools=TOOLS, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "read a.txt"}])
        chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == "The user wants the file." and content == "Let me look."
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "read_file", {"path": "a.txt"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0


async def test_a_conversation_with_tool_results_and_earlier_reasoning_renders(
        small_loaded, make_config, serve, sdk):
    app, engine = scripted_app(small_loaded, make_config(), "ok\n</think>\n\nThe file says hi.")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "read a.txt"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants it.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "read_file", "arguments": "{\"path\":\"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hi"},
    ]
    async with serve(app) as server:
        resp = await sdk(server).chat.completions.create(model="small", tools=TOOLS,
                                                         messages=messages)
    assert resp.choices[0].message.content == "The file says hi."
    assert resp.choices[0].finish_reason == "stop"
    prompt = small_loaded.tokenizer.decode(engine.prompts[0])
    # the client's compact arguments are rendered back in Qwen's spelling
    assert '{"name": "read_file", "arguments": {"path": "a.txt"}}' in prompt
    assert "The user wants it." in prompt and "<tool_response>" in prompt


async def test_a_stop_string_cuts_the_answer(small_loaded, make_config, serve, sdk):
    app, _ = scripted_app(small_loaded, make_config(), "one two three four five")
    async with serve(app) as server:
        client = sdk(server)
        resp = await client.completions.create(model="small", prompt="count", stop=[" three"],
                                               max_tokens=20)
        assert resp.choices[0].text == "one two" and resp.choices[0].finish_reason == "stop"
        stream = await client.completions.create(model="small", prompt="count", stop="four",
                                                 max_tokens=20, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text == "one two three "


async def test_thinking_off_returns_everything_as_content(small_loaded, make_config, serve,
                                                          sdk):
    app, engine = scripted_app(small_loaded, make_config(), "Plain answer.")
    async with serve(app) as server:
        resp = await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.choices[0].message.content == "Plain answer."
    assert resp.choices[0].message.model_extra.get("reasoning_content") is None
