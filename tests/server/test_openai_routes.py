"""The OpenAI routes with the OpenAI Python SDK as the client, on the small real model."""

import json

import aiohttp
import pytest

from tandem.server.app import build_app


@pytest.fixture
async def server(small_loaded, make_config, serve):
    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        yield server


async def test_models_lists_the_served_model(server, sdk):
    models = [m async for m in sdk(server).models.list()]
    assert [m.id for m in models] == ["small"]


async def test_a_chat_completion_answers_with_reasoning_and_full_usage(server, sdk):
    resp = await sdk(server).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, seed=7,
        temperature=0.8)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    # the prompt ends inside <think>: what a random model writes is reasoning
    assert isinstance(choice.message.model_extra["reasoning_content"], str)
    u = resp.usage
    assert u.completion_tokens == 5 and u.total_tokens == u.prompt_tokens + 5
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.model_extra["tandem"]["cache"] == {"tier": "none", "source": "cold", "cached": 0,
                                                "reread": u.prompt_tokens, "slot": 0}


async def test_seeded_sampling_gives_the_same_answer_twice(server, sdk):
    client = sdk(server)
    answers = []
    for _ in range(2):
        resp = await client.completions.create(model="small", prompt="Once upon a time",
                                               max_tokens=6, temperature=1.0, seed=99)
        answers.append(resp.choices[0].text)
    assert answers[0] == answers[1]


async def test_a_streamed_chat_sends_chunks_then_usage_then_done(server, sdk):
    stream = await sdk(server).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])


async def test_the_raw_stream_ends_with_done(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json={
                "model": "small", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            body = await r.text()
    events = [line for line in body.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


async def test_a_prompt_that_continues_the_rows_in_place_reports_them_cached(server, sdk):
    client = sdk(server)
    prompt = list(range(1000, 1040))
    first = await client.completions.create(model="small", prompt=prompt, max_tokens=4,
                                            temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the engine holds prompt + the first 3 generated tokens (the 4th was never forwarded);
    # greedy again, so the rows in place are the same, and the answer's ids continue them
    again = await client.completions.create(model="small", prompt=prompt, max_tokens=4,
                                            temperature=0)
    assert again.choices[0].text == first.choices[0].text
    second_prompt = prompt + _ids_of(server, first.choices[0].text) + [7]
    second = await client.completions.create(model="small", prompt=second_prompt,
                                             max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(prompt)
    assert second.usage.model_extra["tandem"]["cache"]["source"] == "end"
    assert second.usage.model_extra["tandem"]["cache"]["reread"] == len(second_prompt) - cached


def _ids_of(server, text):
    from tandem.server.state import STATE

    return server.app[STATE].tokenizer.encode(text)


async def test_health_metrics_and_cache_stats(server, sdk):
    await sdk(server).completions.create(model="small", prompt="a b c", max_tokens=2)
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/health") as r:
            assert (await r.json())["status"] == "ok"
        async with http.get(base + "/v1/cache/stats") as r:
            resident = (await r.json())["tiers"]["resident"]
        assert resident["cold"] == 1 and resident["ends"] == 1
        assert resident["end"] == resident["rows_in_place"] > 0
        async with http.get(base + "/metrics") as r:
            text = await r.text()
    for name in ("tandem_prefix_cache_queries_total", "tandem_prefix_cache_hits_total",
                 "tandem_requests_total", "tandem_generation_tokens_total",
                 "tandem_time_to_first_token_seconds_bucket"):
        assert name in text
    assert 'tandem_requests_total{route="completions",status="200"} 1.0' in text
    assert "tandem_generation_tokens_total 2.0" in text


async def test_the_journal_gets_one_row_per_request_without_user_text(server, sdk, small_loaded):
    client = sdk(server)
    secret = "my secret project plan"
    await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": secret}], max_tokens=3,
        extra_body={"conversation_id": "conv-42"})
    with pytest.raises(Exception):
        await client.chat.completions.create(model="nope", messages=[
            {"role": "user", "content": secret}], extra_headers={"x-session-id": "abc"})
    from tandem.server.keys import CONFIG, JOURNAL
    from tandem.server.sessions import hash_session, load_secret

    journal = server.app[JOURNAL]
    rows = journal.tail(10)
    assert [r["status"] for r in rows] == [200, 404]
    ok = rows[0]
    key = load_secret(server.app[CONFIG].home_path())  # the home's: joinable across restarts
    assert ok["session"] == hash_session("conv-42", key) and len(ok["session"]) == 16
    assert ok["completion_tokens"] == 3 and ok["cache_source"] == "cold"
    assert ok["cache_tier"] == "none"  # the usage frame's tier, in the spec's names
    assert ok["ttft_ms"] > 0 and ok["route"] == "chat" and ok["finish_reason"] == "length"
    assert rows[1]["session"] == hash_session("abc", key)
    text = journal.path.read_text()
    assert secret not in text and "conv-42" not in text
    assert [json.loads(line)["request_id"] for line in text.splitlines()] == \
        [r["request_id"] for r in rows]
