"""logprobs / top_logprobs on chat, logprobs and echo on completions (issue 12, part 8), through
the HTTP server: the shapes OpenAI and vLLM answer, streamed and not, the bounds, the SDK's
parsing, and the exactness gates made visible from outside.

Gates: a grid resume's logprobs are a cold server's exactly (bit-exact gate, floats compared
with ==); the prompt's logprobs (echo) are a cold prefill's whatever the caches hold; with
speculation the logprobs are plain decoding's up to the verify forward's rounding (greedy).
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import msgspec
import pytest

from tandem.config import CacheConfig, Config, SpeculationConfig
from tandem.server.app import build_app
from tandem.server.keys import JOURNAL

CHAT = {"model": "small", "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 8, "temperature": 0}
# Token ids far from the special ones: P spans two grid lines of 64 and more.
P = list(range(1000, 1150))
Q = list(range(4000, 4040))


def quiet(config: Config, **cache) -> Config:
    """No speculation (a verify block rounds otherwise than decode) and no suffix store."""
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off", suffix_store=False),
        cache=CacheConfig(**cache))


async def post(server, path, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def stream(server, path, body) -> list[dict]:
    chunks = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}",
                             json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(msgspec.json.decode(line[6:]))
    return chunks


@pytest.fixture
async def server(small_loaded, make_config, serve):
    async with serve(build_app(quiet(make_config(parallel=1)), small_loaded)) as server:
        yield server


def assert_chat_entry(entry: dict, num_top: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert isinstance(entry["token"], str) and entry["logprob"] <= 0
    assert all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
    assert len(entry["top_logprobs"]) == num_top
    tops = [t["logprob"] for t in entry["top_logprobs"]]
    assert tops == sorted(tops, reverse=True)
    for top in entry["top_logprobs"]:
        assert set(top) == {"token", "logprob", "bytes"}


# -- shapes ------------------------------------------------------------------------------------


async def test_chat_logprobs_have_openais_shape_one_entry_a_token(server):
    status, body = await post(server, "/v1/chat/completions",
                              {**CHAT, "logprobs": True, "top_logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert len(content) == body["usage"]["completion_tokens"] > 0
    for entry in content:
        assert_chat_entry(entry, 3)
        # Greedy: the chosen token is the most probable one, its logprob the top's.
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    # The bytes of the entries are the answer's bytes (reasoning, then content).
    joined = b"".join(bytes(e["bytes"]) for e in content).decode()
    message = choice["message"]
    assert (message["reasoning_content"] or "") in joined
    # logprobs without top_logprobs: each entry has an empty top list.
    status, body = await post(server, "/v1/chat/completions", {**CHAT, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])
    # Not asked: null, as before.
    status, body = await post(server, "/v1/chat/completions", CHAT)
    assert body["choices"][0]["logprobs"] is None


async def test_chat_logprobs_stream_with_their_chunks_and_equal_the_whole_answers(server):
    ask = {**CHAT, "logprobs": True, "top_logprobs": 2}
    _, whole = await post(server, "/v1/chat/completions", ask)
    chunks = await stream(server, "/v1/chat/completions", ask)
    streamed = [e for c in chunks for choice in c["choices"]
                for e in ((choice.get("logprobs") or {}).get("content") or [])]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    assert all(c["choices"][0]["logprobs"] is not None for c in chunks[1:] if c["choices"])


async def test_completion_logprobs_have_the_legacy_shape(server):
    body = {"model": "small", "prompt": P[:20], "max_tokens": 6, "temperature": 0,
            "logprobs": 2}
    status, answer = await post(server, "/v1/completions", body)
    assert status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = answer["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["text_offset"][0] == 0
    for i in range(1, n):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert token in top and top[token] == logprob  # the chosen one is always there
        assert 1 <= len(top) <= 3
        assert max(top.values()) == logprob  # greedy
    # logprobs 0: the chosen token alone.
    _, zero = await post(server, "/v1/completions", {**body, "logprobs": 0})
    tops = zero["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(top) == 1 for top in tops)
    # Streamed: the same lists, split over the chunks.
    chunks = await stream(server, "/v1/completions", body)
    joined = {k: [] for k in lp}
    for c in chunks:
        for choice in c["choices"]:
            for k in lp:
                joined[k] += (choice["logprobs"] or {}).get(k, [])
    assert joined == lp


async def test_echo_prepends_the_prompt_and_with_logprobs_scores_it(server):
    text = "The quick brown fox jumps over the lazy dog."
    base = {"model": "small", "prompt": text, "max_tokens": 4, "temperature": 0}
    _, plain = await post(server, "/v1/completions", base)
    _, echoed = await post(server, "/v1/completions", {**base, "echo": True})
    assert echoed["choices"][0]["text"] == text + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None

    _, scored = await post(server, "/v1/completions", {**base, "echo": True, "logprobs": 1})
    lp = scored["choices"][0]["logprobs"]
    num_prompt = scored["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == num_prompt + scored["usage"]["completion_tokens"]
    assert "".join(lp["tokens"][:num_prompt]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI's
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    # The generated part is the answer without echo's.
    _, alone = await post(server, "/v1/completions", {**base, "logprobs": 1})
    tail = {k: v[num_prompt:] for k, v in lp.items() if k != "text_offset"}
    want = {k: v for k, v in alone["choices"][0]["logprobs"].items() if k != "text_offset"}
    assert tail == want
    assert lp["text_offset"][num_prompt] == len("".join(lp["tokens"][:num_prompt]))
    # Streamed: the prompt first, with its logprobs, then the answer's.
    chunks = await stream(server, "/v1/completions", {**base, "echo": True, "logprobs": 1})
    first = chunks[0]["choices"][0]
    assert first["text"] == text and first["logprobs"]["tokens"] == lp["tokens"][:num_prompt]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        scored["choices"][0]["text"]


# -- bounds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"model": "small", "prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"model": "small", "prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": "small", "prompt": "x", "logprobs": True}, "logprobs"),
])
async def test_logprobs_out_of_bounds_are_a_400_naming_the_field(server, path, body, param):
    status, answer = await post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


async def test_the_bounds_themselves_are_answered(server):
    status, body = await post(server, "/v1/chat/completions",
                              {**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 20})
    assert status == 200 and len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    status, body = await post(server, "/v1/completions", {"model": "small", "prompt": "x",
                                                          "max_tokens": 2, "logprobs": 5})
    assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5


# -- the SDK -----------------------------------------------------------------------------------


async def test_the_openai_sdk_parses_logprobs_on_both_routes(server, sdk):
    client = sdk(server)
    chat = await client.chat.completions.create(
        model="small", messages=CHAT["messages"], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=4)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob == e.logprob
               for e in content)
    streamed = await client.chat.completions.create(
        model="small", messages=CHAT["messages"], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=4, stream=True)
    entries = [e async for c in streamed for ch in c.choices
               if ch.logprobs is not None for e in ch.logprobs.content or []]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    done = await client.completions.create(model="small", prompt="Once upon a time",
                                           max_tokens=4, temperature=0, logprobs=3, echo=True)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.text_offset)
    assert done.choices[0].text.startswith("Once upon a time")


# -- the gates, from outside -------------------------------------------------------------------


async def wait_indexed_then(server, ask):
    """``ask()`` once the suffix store's index covers every append (it rebuilds off the
    engine)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
                store = (await resp.json())["suffix_store"]
            if store["tokens"] and store["indexed_tokens"] == store["tokens"]:
                return await ask()
            await asyncio.sleep(0.05)
    raise AssertionError(f"the suffix store was never indexed: {store}")


async def completion(server, prompt, **extra) -> dict:
    status, body = await post(server, "/v1/completions", {
        "model": "small", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 5,
        **extra})
    assert status == 200, body
    return body


async def test_a_grid_resumes_logprobs_equal_a_cold_servers_exactly(small_loaded, make_config,
                                                                    serve):
    config = quiet(make_config())
    async with serve(build_app(config, small_loaded)) as server:
        first = await completion(server, P)
        assert first["usage"]["tandem"]["cache"]["source"] == "cold"
        warm = await completion(server, P + Q)
    cache = warm["usage"]["tandem"]["cache"]
    assert cache["source"] == "resident" and cache["cached"] == 128  # the anchor at line 128
    # A fresh home: the spill would bring the first server's conversation back.
    fresh = msgspec.structs.replace(config, home=config.home + "-cold")
    async with serve(build_app(fresh, small_loaded)) as server:
        cold = await completion(server, P + Q)
    assert cold["usage"]["tandem"]["cache"]["source"] == "cold"
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]  # floats, ==
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


async def test_echo_scores_the_prompt_cold_whatever_the_caches_hold(small_loaded, make_config,
                                                                    serve):
    """A resumed prompt has no logits for the rows it did not forward: an echo with logprobs
    runs cold (usage says so) and scores as a fresh server does."""
    config = quiet(make_config(), response_cache=False)
    async with serve(build_app(config, small_loaded)) as server:
        await completion(server, P)
        warm = await completion(server, P + Q, echo=True)
        again = await completion(server, P + Q, echo=True)
        after = await completion(server, P + Q + [7000])  # the anchors it took still serve
    fresh = msgspec.structs.replace(config, home=config.home + "-cold")
    async with serve(build_app(fresh, small_loaded)) as server:
        cold = await completion(server, P + Q, echo=True)
    assert warm["usage"]["tandem"]["cache"]["source"] == "cold"
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"] == \
        again["choices"][0]["logprobs"]
    assert after["usage"]["tandem"]["cache"]["source"] in ("resident", "end")
    lp = cold["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(P + Q) + 12 and lp["token_logprobs"][0] is None


async def test_the_response_cache_replays_logprobs_only_to_requests_that_asked(
        small_loaded, make_config, serve):
    config = quiet(make_config(), response_cache=True)
    async with serve(build_app(config, small_loaded)) as server:
        plain = await completion(server, P[:40], logprobs=None)
        asked = await completion(server, P[:40])
        replayed = await completion(server, P[:40])
        echo = await completion(server, P[:40], echo=True)
        echo_replayed = await completion(server, P[:40], echo=True)
    assert plain["choices"][0]["logprobs"] is None
    assert asked["usage"]["tandem"]["cache"]["source"] != "response"  # not plain's answer
    assert replayed["usage"]["tandem"]["cache"]["source"] == "response"
    assert replayed["choices"][0]["logprobs"] == asked["choices"][0]["logprobs"] is not None
    assert echo["usage"]["tandem"]["cache"]["source"] != "response"
    assert echo_replayed["usage"]["tandem"]["cache"]["source"] == "response"
    assert echo_replayed["choices"][0] == echo["choices"][0]


async def test_with_speculation_the_logprobs_are_plain_decodings(small_loaded, make_config,
                                                                  serve):
    """Each emitted token is scored at the verify block's row that produced it: the same
    tokens and top lists as without speculation, the values up to the verify forward's
    rounding (it is not decode's arithmetic)."""
    prompt = P[:60]
    config = msgspec.structs.replace(
        make_config(), speculation=SpeculationConfig(speculation="off", suffix_store=False))
    async with serve(build_app(config, small_loaded)) as server:
        off = await completion(server, prompt, max_tokens=30)
    # The second request is drafted from the suffix store the first one wrote.
    config = msgspec.structs.replace(make_config(),
                                     speculation=SpeculationConfig(speculation="lookup"))
    async with serve(build_app(config, small_loaded)) as server:
        await completion(server, prompt, max_tokens=30)
        on = await wait_indexed_then(server, lambda: completion(server, prompt, max_tokens=30))
    assert on["usage"]["tandem"]["speculation"]["accepted"] > 0
    a, b = off["choices"][0]["logprobs"], on["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"]):
        assert math.isclose(x, y, abs_tol=1e-4)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert list(x) == list(y)
        assert all(math.isclose(x[k], y[k], abs_tol=1e-4) for k in x)


async def test_an_echo_run_as_a_guest_puts_the_conversation_back(small_loaded, make_config,
                                                                 serve):
    """A short echo with logprobs after a long turn runs as a guest resumed at line 64, then
    cold from token 0 (it writes the rows below its start again, with the same tokens): the
    conversation's next turn resumes at its end anchor and answers as if no guest had come."""
    long = list(range(1000, 1300))
    said = "one two three four five"
    tok = small_loaded.tokenizer
    follow = long + tok.encode(said) + [tok.special_ids["<|im_end|>"], 5000, 5001]
    config = quiet(make_config(allow_forced_output=True, parallel=1))
    answers = []
    for with_guest in (True, False):
        app = build_app(config, small_loaded)
        async with serve(app) as server:
            await completion(server, long, tandem_forced_output=said)
            if with_guest:
                guest = await completion(server, long[:70], echo=True)
                guest_row = app[JOURNAL].tail(1)[-1]
            answers.append(await completion(server, follow))
    after, alone = answers
    assert guest["usage"]["tandem"]["cache"]["source"] == "cold"
    assert guest_row["extra"]["guest"] is True
    assert after["usage"]["tandem"]["cache"]["source"] == "end"
    assert alone["usage"]["tandem"]["cache"]["source"] == "end"
    assert after["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
