"""n > 1 choices through the HTTP server (tandem/server/choices.py, tandem/choices.py), on the
small real model: the prompt read once, the choices decoded as a batch beside it, choice i the
answer of an n = 1 request with seed + i, token for token; choice 0's end kept as the
conversation's end anchor; no other conversation in place loses its rows."""

import asyncio
import json

import aiohttp
import msgspec
import openai
import pytest

from tandem.config import SpeculationConfig
from tandem.server.app import build_app
from tandem.server.keys import ENGINE, JOURNAL

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
CHAT = [{"role": "user", "content": "Tell me about foxes and dogs, briefly."}]


def _tandem(resp) -> dict:
    return resp.usage.model_extra["tandem"]


def _no_speculation(config):
    # Verify blocks round a logprob otherwise than a decode step (about 1e-5): with them off
    # the logprobs of a choice and of its n = 1 request are the same bits too.
    return msgspec.structs.replace(config, speculation=SpeculationConfig(speculation="off"))


async def until(predicate, timeout_s=10.0):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def _sse(server, path, body):
    """A streamed answer's chunks (the parsed data lines before [DONE])."""
    chunks = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                chunks.append(json.loads(line[6:]))
    return chunks


async def test_three_seeded_choices_are_the_three_single_requests_with_seed_plus_i(
        small_loaded, make_config, serve, sdk):
    config = _no_speculation(make_config(window=1024))
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        many = await client.completions.create(model="small", prompt=PROMPT, max_tokens=12,
                                               temperature=1.0, seed=40, n=3, logprobs=2)
        singles = [await client.completions.create(model="small", prompt=PROMPT,
                                                   max_tokens=12, temperature=1.0,
                                                   seed=40 + i, logprobs=2)
                   for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice, single in zip(many.choices, singles):
        want = single.choices[0]
        assert choice.text == want.text
        assert choice.logprobs.tokens == want.logprobs.tokens  # token for token
        assert choice.logprobs.token_logprobs == want.logprobs.token_logprobs
        assert choice.logprobs.text_offset == want.logprobs.text_offset
        assert choice.finish_reason == want.finish_reason
    assert len({c.text for c in many.choices}) > 1  # three seeds, three draws
    # The prompt was read once and counted once; the completions are summed.
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in many.choices)
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert _tandem(many)["cache"]["source"] == "cold"
    assert _tandem(many)["cache"]["reread"] == many.usage.prompt_tokens


async def test_seeded_chat_choices_equal_their_single_requests_with_speculation_on(
        small_loaded, make_config, serve, sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        many = await client.chat.completions.create(model="small", messages=CHAT,
                                                    max_tokens=16, temperature=0.9, seed=7,
                                                    n=3)
        singles = [await client.chat.completions.create(model="small", messages=CHAT,
                                                        max_tokens=16, temperature=0.9,
                                                        seed=7 + i) for i in range(3)]
    for choice, single in zip(many.choices, singles):
        want = single.choices[0]
        assert choice.message.content == want.message.content
        assert choice.message.model_extra.get("reasoning_content") == \
            want.message.model_extra.get("reasoning_content")
        assert choice.finish_reason == want.finish_reason


async def test_greedy_choices_are_identical(small_loaded, make_config, serve, sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        resp = await client.chat.completions.create(model="small", messages=CHAT, max_tokens=10,
                                                    temperature=0, n=2, logprobs=True)
        single = await client.chat.completions.create(model="small", messages=CHAT,
                                                      max_tokens=10, temperature=0)
    first, second = resp.choices
    assert (first.index, second.index) == (0, 1)
    assert first.message == second.message == single.choices[0].message
    assert [e.token for e in first.logprobs.content] == \
        [e.token for e in second.logprobs.content]
    assert resp.usage.completion_tokens == 2 * single.usage.completion_tokens
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens


async def test_unseeded_choices_differ(small_loaded, make_config, serve, sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        resp = await sdk(server).completions.create(model="small", prompt=PROMPT,
                                                    max_tokens=12, temperature=1.0, n=3)
    assert len({c.text for c in resp.choices}) > 1


async def test_streamed_choices_carry_their_index_and_each_ends_once(
        small_loaded, make_config, serve):
    config = _no_speculation(make_config(window=1024))
    body = {"model": "small", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0,
            "seed": 3, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": "small", "messages": CHAT, "max_tokens": 10, "temperature": 1.0,
            "seed": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with serve(build_app(config, small_loaded)) as server:
        chunks = await _sse(server, "/v1/completions", body)
        whole = await _post(server, "/v1/completions", {**body, "stream": False,
                                                        "stream_options": None})
        chat_chunks = await _sse(server, "/v1/chat/completions", chat)
        chat_whole = await _post(server, "/v1/chat/completions", {**chat, "stream": False,
                                                                  "stream_options": None})
    texts, ends = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in ends
            ends[choice["index"]] = choice["finish_reason"]
    assert sorted(ends) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert [ends[i] for i in range(3)] == [c["finish_reason"] for c in whole["choices"]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == whole["usage"][key], key

    content, roles, finishes = {}, {}, {}
    for c in chat_chunks[:-1]:
        (choice,) = c["choices"]
        i, delta = choice["index"], choice["delta"]
        roles[i] = roles.get(i, 0) + ("role" in delta)
        content[i] = content.get(i, "") + (delta.get("content") or "") + \
            (delta.get("reasoning_content") or "")
        if choice["finish_reason"] is not None:
            finishes[i] = choice["finish_reason"]
    assert roles == {0: 1, 1: 1} and sorted(finishes) == [0, 1]
    for i, want in enumerate(chat_whole["choices"]):
        message = want["message"]
        assert content[i] == (message["content"] or "") + (message["reasoning_content"] or "")
        assert finishes[i] == want["finish_reason"]
    assert chat_chunks[-1]["usage"]["completion_tokens"] == \
        chat_whole["usage"]["completion_tokens"]


async def _post(server, path, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=body) as r:
            return await r.json()


async def test_n_above_the_cap_is_a_400_naming_n(small_loaded, make_config, serve, sdk):
    async with serve(build_app(make_config(max_n=2), small_loaded)) as server:
        with pytest.raises(openai.BadRequestError) as err:
            await sdk(server).chat.completions.create(model="small", messages=CHAT, n=3,
                                                      max_tokens=2)
        assert err.value.body["param"] == "n" and "max_n" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            await sdk(server).completions.create(model="small", prompt="hi", n=3)
        assert err.value.body["param"] == "n"
        ok = await sdk(server).completions.create(model="small", prompt="hi", n=2,
                                                  max_tokens=2)
    assert len(ok.choices) == 2


async def test_choice_zero_is_the_conversations_end_for_the_next_turn(
        small_loaded, make_config, serve, sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        resp = await client.completions.create(model="small", prompt=PROMPT, max_tokens=8,
                                               temperature=1.0, seed=5, n=2)
        first, second = (c.text for c in resp.choices)
        assert first != second
        on = await client.completions.create(model="small", prompt=PROMPT + first + " And",
                                             max_tokens=2, temperature=0)
        assert _tandem(on)["cache"]["source"] == "end"
        assert _tandem(on)["cache"]["slot"] == _tandem(resp)["cache"]["slot"]
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        await client.completions.create(model="small", prompt=PROMPT, max_tokens=8,
                                        temperature=1.0, seed=5, n=2)
        other = await client.completions.create(model="small", prompt=PROMPT + second + " And",
                                                max_tokens=2, temperature=0)
        assert _tandem(other)["cache"]["source"] != "end"  # choice 1's rows were not kept


async def test_another_conversation_in_place_keeps_its_rows(small_loaded, make_config, serve,
                                                           sdk):
    """A conversation in its slot, then an n = 3 request of another prompt while slots are
    free: the conversation's next turn resumes at its end as it does with no n > 1 request
    between, in its slot, reading only the new line."""
    conversation = "A conversation about rivers and the sea. " * 5

    async def turns(between):
        async with serve(build_app(make_config(window=1024), small_loaded)) as server:
            client = sdk(server)
            one = await client.completions.create(model="small", prompt=conversation,
                                                  max_tokens=6, temperature=0)
            if between:
                many = await client.completions.create(model="small", prompt=PROMPT,
                                                       max_tokens=20, temperature=1.0, n=3)
                assert _tandem(many)["cache"]["slot"] != _tandem(one)["cache"]["slot"]
            two = await client.completions.create(
                model="small", prompt=conversation + one.choices[0].text + " Next.",
                max_tokens=6, temperature=0)
            rows = server.app[ENGINE].snapshot()["slots"]
            return one, two, rows

    one, two, rows = await turns(True)
    ref_one, ref_two, _ = await turns(False)
    assert _tandem(two)["cache"]["source"] == _tandem(ref_two)["cache"]["source"] == "end"
    assert _tandem(two)["cache"]["slot"] == _tandem(one)["cache"]["slot"]
    assert _tandem(two)["cache"]["reread"] == _tandem(ref_two)["cache"]["reread"]
    assert two.choices[0].text == ref_two.choices[0].text
    # Only the n = 3 request's own slot and the conversation's hold rows: no fork took a slot.
    assert sum(1 for slot in rows if slot["rows_in_place"]) == 2


async def test_a_client_that_leaves_cancels_every_choice_and_frees_the_engine(
        small_loaded, make_config, serve, sdk):
    config = make_config(window=1024)
    app = build_app(config, small_loaded)
    async with serve(app) as server:
        engine = app[ENGINE]
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"model": "small", "prompt": PROMPT, "n": 3,
                                            "max_tokens": 400, "temperature": 1.0,
                                            "stream": True}) as r:
                first = await r.content.readline()
                assert first.startswith(b"data: ")
            # leaving the block closed the connection mid-stream
        journal = app[JOURNAL]
        await until(lambda: journal.tail(1))
        row = journal.tail(1)[0]
        assert row["status"] == 499 and row["finish_reason"] == "cancelled"
        assert row["completion_tokens"] < 3 * 400
        await until(lambda: engine.running == 0 and not engine._runs)
        again = await sdk(server).completions.create(model="small", prompt="hi", n=2,
                                                     max_tokens=3)
    assert [c.index for c in again.choices] == [0, 1]


async def test_the_openai_sdk_reads_choices_whole_and_streamed(small_loaded, make_config,
                                                              serve, sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        resp = await client.chat.completions.create(model="small", messages=CHAT, n=2,
                                                    max_tokens=6, seed=1, temperature=1.0)
        stream = await client.chat.completions.create(model="small", messages=CHAT, n=2,
                                                      max_tokens=6, seed=1, temperature=1.0,
                                                      stream=True)
        seen = {}
        async for chunk in stream:
            for choice in chunk.choices:
                seen.setdefault(choice.index, []).append(choice.finish_reason)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert sorted(seen) == [0, 1]
    assert all(reasons[-1] in ("stop", "length") for reasons in seen.values())


async def test_a_stop_string_ends_its_own_choice_and_the_others_go_on(
        small_loaded, make_config, serve, sdk):
    config = _no_speculation(make_config(window=1024))
    ask = {"model": "small", "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0,
           "seed": 21, "n": 3}
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        free = [c.text for c in (await client.completions.create(**ask)).choices]
        # A piece of choice 0's text that the others never write.
        stop = next(free[0][i:i + 4] for i in range(len(free[0]) // 2, len(free[0]) - 4)
                    if free[0][i:i + 4].strip() and all(free[0][i:i + 4] not in t
                                                        for t in free[1:]))
        cut = await client.completions.create(**ask, stop=[stop])
    first, *others = cut.choices
    assert first.text == free[0][:free[0].index(stop)] and first.finish_reason == "stop"
    assert [c.text for c in others] == free[1:]
    assert cut.usage.completion_tokens < 3 * 24


TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string"}},
                   "required": ["filePath"]}}}]
CALL = ("I should read it.\n</think>\n\n<tool_call>\n{\"name\": \"read\", \"arguments\": "
        "{\"filePath\": \"/src/app.py\"}}\n</tool_call>")


async def test_each_choice_has_its_tool_calls_parsed(small_loaded, make_config, serve, sdk):
    config = make_config(allow_forced_output=True, window=1024)
    async with serve(build_app(config, small_loaded)) as server:
        client = sdk(server)
        ask = dict(model="small", messages=CHAT, tools=TOOLS, max_tokens=100, n=2,
                   extra_body={"tandem_forced_output": CALL})
        whole = await client.chat.completions.create(**ask)
        calls, finishes = {}, {}
        async for chunk in await client.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    calls.setdefault(choice.index, []).append(call)
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "read"
        assert json.loads(call.function.arguments) == {"filePath": "/src/app.py"}
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [0, 1]
    for deltas in calls.values():
        assert deltas[0].function.name == "read"
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == \
            {"filePath": "/src/app.py"}


async def test_echoed_choices_each_carry_the_scored_prompt(small_loaded, make_config, serve,
                                                          sdk):
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        client = sdk(server)
        many = await client.completions.create(model="small", prompt=PROMPT, max_tokens=4,
                                               temperature=0, n=2, echo=True, logprobs=1)
        one = await client.completions.create(model="small", prompt=PROMPT, max_tokens=4,
                                              temperature=0, echo=True, logprobs=1)
        rows = server.app[JOURNAL].tail(2)
    want = one.choices[0]
    for choice in many.choices:
        assert choice.text == want.text and choice.text.startswith(PROMPT)
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.tokens == want.logprobs.tokens
        assert choice.logprobs.text_offset == want.logprobs.text_offset
    assert rows[0]["extra"]["n"] == 2 and "n" not in (rows[1].get("extra") or {})


async def test_the_governor_admits_the_forks_rows_with_the_request(small_loaded, make_config,
                                                                   serve, sdk):
    """The forks are never taken from a slot: the plan asks the memory governor for their rows
    (the prompt and answer each, and a copy of the sections) beside the slot's growth, so what
    they cost is what the governor sheds or refuses, as for a longer prompt."""
    async with serve(build_app(make_config(window=1024), small_loaded)) as server:
        engine = server.app[ENGINE]
        grown = []
        admit = engine.governor.admit_prefill

        async def spy(num_tokens, shed, levels, grow_nbytes=0):
            grown.append(grow_nbytes)
            return await admit(num_tokens, shed, levels, grow_nbytes=grow_nbytes)

        engine.governor.admit_prefill = spy
        client = sdk(server)
        one = await client.completions.create(model="small", prompt=PROMPT, max_tokens=8,
                                              temperature=0)
        three = await client.completions.create(model="small", prompt="Rivers. " * 20,
                                                max_tokens=8, temperature=0, n=3)
    assert _tandem(three)["cache"]["slot"] != _tandem(one)["cache"]["slot"]  # an empty slot
    row, state = engine._row_nbytes, engine._state_nbytes
    assert row > 0 and state > 0
    slot = [engine._blocks(r.usage.prompt_tokens + 8) * row for r in (one, three)]
    fork = (three.usage.prompt_tokens + 8) * row + state
    assert grown == [slot[0], slot[1] + 2 * fork]
