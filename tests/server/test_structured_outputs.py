"""Structured outputs and forced tool choices through the chat route: the answer parses and
validates against its schema, greedy and sampled, with speculation on or off (the same tokens);
`required` and a named function give a parsed call of the right function; a schema the
grammar library cannot compile is a 400 naming response_format; streaming works. The small
model is random, so each test also shows that the same request without the grammar gives no
such answer: the mask does the work."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import pytest

from tandem.config import Config, SpeculationConfig
from tandem.server.app import build_app

TRIP = {"type": "object", "additionalProperties": False,
        "required": ["city", "days", "sunny"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "sunny": {"type": "boolean"}}}
TRIP_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP,
                                                      "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {}}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def valid_trip(value) -> bool:
    """TRIP's checks by hand (jsonschema is not installed)."""
    return (isinstance(value, dict) and set(value) == {"city", "days", "sunny"}
            and value["city"] in ("Paris", "Rome", "Oslo")
            and type(value["days"]) is int and 1 <= value["days"] <= 14
            and type(value["sunny"]) is bool)


def parsed(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


async def chat(s, base, status=200, **extra):
    body = {"model": "small", "messages": [{"role": "user", "content": "Plan a trip."}],
            "max_tokens": 60, "temperature": 0, **NO_THINKING, **extra}
    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
        doc = await resp.json()
        assert resp.status == status, doc
        return doc


def spec(config: Config, mode: str) -> Config:
    return msgspec.structs.replace(config, speculation=SpeculationConfig(speculation=mode,
                                                                         draft_max=8))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
async def test_a_json_schema_answer_validates_with_speculation_on_or_off(
        small_loaded, make_config, serve, sampling):
    answers = {}
    for mode in ("off", "lookup"):
        async with serve(build_app(spec(make_config(), mode), small_loaded)) as server, \
                aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{server.port}"
            free = await chat(s, base, **sampling)
            # Twice: the second drafts from the suffix store the first wrote.
            answers[mode] = [await chat(s, base, response_format=TRIP_FORMAT, **sampling)
                             for _ in range(2)]
    assert not valid_trip(parsed(free["choices"][0]["message"]["content"]))
    for doc in answers["off"] + answers["lookup"]:
        choice = doc["choices"][0]
        assert valid_trip(parsed(choice["message"]["content"])), choice
        assert choice["finish_reason"] == "stop"
    # Speculation accepts exactly plain decoding's tokens.
    assert [d["choices"][0]["message"] for d in answers["off"]] \
        == [d["choices"][0]["message"] for d in answers["lookup"]]
    assert all(d["usage"]["tandem"]["speculation"]["drafted"] == 0 for d in answers["off"])
    assert answers["lookup"][1]["usage"]["tandem"]["speculation"]["drafted"] > 0


async def test_json_object_holds_even_against_a_logit_bias(small_loaded, make_config, serve):
    # "}" pushed up by 100: free, the model writes it again and again; the grammar lets it
    # close the object only.
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        close = str(small_loaded.tokenizer.encode("}")[0])
        free = await chat(s, base, logit_bias={close: 100})
        doc = await chat(s, base, logit_bias={close: 100},
                         response_format={"type": "json_object"})
    assert parsed(free["choices"][0]["message"]["content"]) is None
    assert parsed(doc["choices"][0]["message"]["content"]) == {}
    assert doc["choices"][0]["finish_reason"] == "stop"


async def test_the_reasoning_runs_first_and_the_answer_after_it_is_json(small_loaded,
                                                                        make_config, serve):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        # Thinking on: the budget closes the random model's reasoning, then the schema holds.
        doc = await chat(s, base, response_format=TRIP_FORMAT, max_reasoning_tokens=8,
                         max_tokens=100, chat_template_kwargs={"enable_thinking": True})
    message = doc["choices"][0]["message"]
    assert message["reasoning_content"]
    assert valid_trip(parsed(message["content"])), message


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})])
async def test_a_forced_tool_choice_gives_a_parsed_call_of_the_right_function(
        small_loaded, make_config, serve, choice, names):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        free = await chat(s, base, tools=[WEATHER, CLOCK], tool_choice="auto")
        doc = await chat(s, base, tools=[WEATHER, CLOCK], tool_choice=choice,
                         parallel_tool_calls=False, max_tokens=80)
    assert "tool_calls" not in free["choices"][0]["message"]
    choice_doc = doc["choices"][0]
    calls = choice_doc["message"]["tool_calls"]
    assert choice_doc["finish_reason"] == "tool_calls" and len(calls) == 1
    fn = calls[0]["function"]
    assert fn["name"] in names
    args = json.loads(fn["arguments"])
    if fn["name"] == "get_weather":
        assert args["city"] in ("Paris", "Rome") and set(args) <= {"city", "days"}
    else:
        assert args == {}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
async def test_a_bad_format_or_schema_is_a_400_naming_its_field(small_loaded, make_config, serve,
                                                                extra, param):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        doc = await chat(s, f"http://127.0.0.1:{server.port}", status=400, **extra)
    assert doc["error"]["param"] == param


async def test_streamed_structured_answers_parse(small_loaded, make_config, serve):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        whole = await chat(s, base, response_format=TRIP_FORMAT)
        streams = []
        for extra in ({"response_format": TRIP_FORMAT},
                      {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 80}):
            body = {"model": "small", "messages": [{"role": "user", "content": "Plan a trip."}],
                    "max_tokens": 60, "temperature": 0, "stream": True, **NO_THINKING, **extra}
            async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                lines = [line for line in (await resp.text()).splitlines()
                         if line.startswith("data: {")]
            streams.append([json.loads(line[6:])["choices"] for line in lines])
    content = "".join(c[0]["delta"].get("content") or "" for c in streams[0] if c)
    assert valid_trip(parsed(content)) and content == whole["choices"][0]["message"]["content"]
    deltas = [d for c in streams[1] if c for d in c[0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather"
    args = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert [c[0]["finish_reason"] for c in streams[1] if c][-1] == "tool_calls"


async def test_every_one_of_n_sampled_choices_is_held_to_the_schema(small_loaded, make_config,
                                                                   serve):
    # Each choice compiles its own matcher: a shared one would see the tokens of every choice.
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.port}"
        doc = await chat(s, base, n=3, temperature=0.9, seed=11, response_format=TRIP_FORMAT)
        alone = await chat(s, base, temperature=0.9, seed=12, response_format=TRIP_FORMAT)
    texts = [c["message"]["content"] for c in sorted(doc["choices"], key=lambda c: c["index"])]
    assert len(texts) == 3
    assert all(valid_trip(parsed(t)) for t in texts), texts
    assert texts[1] == alone["choices"][0]["message"]["content"]  # choice 1 is seed + 1's
