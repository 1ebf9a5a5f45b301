"""Through the HTTP server (issue 11, findings 1 and 9): every sampling value the schema accepts
is answered and the server lives on; an engine failure is one request's 500; penalties and
logit_bias are honoured or refused with a 400, never ignored; Retry-After is estimated from the
queue."""

import asyncio

import aiohttp
import pytest

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.actors.engine_messages import GenerationParams
from tandem.actors.harness import FakeClock
from tandem.cache.response import CachedResponse, ResponseCache
from tandem.server.app import build_app
from tandem.server.keys import ENGINE

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def post(server, path, json):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", json=json) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)


async def health(server) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/health") as r:
            return r.status


def scripted(loaded, config, clock=None, **options):
    engine = ScriptedEngine([11, 12, 13], window=config.engine.window, **options)
    actor = EngineActor("engine", make_engine=lambda: engine,
                        queue_limit=config.server.queue_limit,
                        **({"clock": clock} if clock is not None else {}))
    return build_app(config, loaded, engine=actor), engine


@pytest.fixture
async def real_server(small_loaded, make_config, serve):
    async with serve(build_app(make_config(), small_loaded)) as server:
        yield server


@pytest.mark.parametrize("sampling", [{"temperature": 1e-40}, {"temperature": 1e-38},
                                      {"temperature": 5e-324},
                                      {"temperature": 1.0, "top_p": 1e-46},
                                      {"temperature": 2.0, "top_p": 5e-324, "seed": 1},
                                      {"temperature": 1e-39, "top_p": 1e-45, "top_k": 3}])
async def test_tiny_temperatures_and_top_ps_are_answered_and_the_server_lives(real_server,
                                                                             sampling):
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "small", "prompt": "Once", "max_tokens": 3})):
        status, _, answer = await post(real_server, path, {**body, **sampling})
        assert status == 200, answer
        assert await health(real_server) == 200


async def test_an_engine_failure_is_that_requests_500_and_the_next_request_runs(
        small_loaded, make_config, serve):
    app, engine = scripted(small_loaded, make_config(), fail_with=RuntimeError("kaboom"))
    async with serve(app) as server:
        status, _, body = await post(server, "/v1/chat/completions", CHAT)
        assert status == 500 and body["error"]["code"] == "engine_error"
        assert "kaboom" not in body["error"]["message"]
        assert await health(server) == 200
        engine.fail_with = None
        status, _, body = await post(server, "/v1/chat/completions", CHAT)
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


# -- penalties and logit_bias -----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", "high"), ("logit_bias", {"5": 101}),
    ("logit_bias", {"5": -100.5}), ("logit_bias", {"abc": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1e3": 1}), ("logit_bias", {" 5": 1}), ("logit_bias", {"999999999": 1}),
    ("logit_bias", {"5": "x"}), ("logit_bias", [5, 1])])
async def test_penalties_and_biases_out_of_range_or_off_the_vocabulary_are_400(real_server,
                                                                              field, value):
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "small", "prompt": "x", "max_tokens": 1})):
        status, _, answer = await post(real_server, path, {**body, field: value})
        assert status == 400, (path, answer)
        assert answer["error"]["param"].startswith(field)


async def test_a_logit_bias_of_100_makes_greedy_write_that_token(real_server, small_loaded):
    tok = small_loaded.tokenizer
    (word,) = tok.encode(" hello")
    body = {"model": "small", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(word): 100}}
    status, _, answer = await post(real_server, "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == tok.decode([word] * 5)
    # Sampled too.
    status, _, answer = await post(real_server, "/v1/completions",
                                   {**body, "temperature": 1.0, "seed": 3})
    assert answer["choices"][0]["text"] == tok.decode([word] * 5)


async def test_zero_penalties_answer_what_absent_ones_do(real_server):
    body = {"model": "small", "prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0}
    _, _, absent = await post(real_server, "/v1/completions", body)
    _, _, zero = await post(real_server, "/v1/completions", {
        **body, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {"9": 0}})
    assert zero["choices"][0]["text"] == absent["choices"][0]["text"]


async def test_penalties_and_biases_reach_the_engine_in_its_terms(small_loaded, make_config,
                                                                  serve):
    app, engine = scripted(small_loaded, make_config())
    async with serve(app) as server:
        status, _, _ = await post(server, "/v1/chat/completions", {
            **CHAT, "presence_penalty": 1.5, "frequency_penalty": -0.5,
            "logit_bias": {"7": -3, "5": 10.5, "9": 0}})
        assert status == 200
        status, _, _ = await post(server, "/v1/completions", {"model": "small", "prompt": "x"})
        assert status == 200
    penalised, plain = engine.params
    assert (penalised.presence_penalty, penalised.frequency_penalty) == (1.5, -0.5)
    assert penalised.logit_bias == ((5, 10.5), (7, -3.0))  # sorted by id, the zero left out
    assert (plain.presence_penalty, plain.frequency_penalty, plain.logit_bias) == (0, 0, ())


def test_the_response_cache_keys_on_the_penalties_and_the_bias():
    cache = ResponseCache(1 << 20)
    greedy = GenerationParams(max_tokens=4)
    answer = CachedResponse(((5, False),), finished=None)
    assert cache.put([1, 2, 3], greedy, [], answer)
    assert cache.lookup([1, 2, 3], GenerationParams(max_tokens=4, presence_penalty=0.0)) is answer
    for change in ({"presence_penalty": 0.5}, {"frequency_penalty": -1.0},
                   {"logit_bias": ((5, 1.0),)}):
        assert cache.lookup([1, 2, 3], GenerationParams(max_tokens=4, **change)) is None, change


# -- Retry-After ------------------------------------------------------------------------------

async def test_a_full_queue_answers_a_retry_after_estimated_from_the_queue(small_loaded,
                                                                         make_config, serve):
    clock = FakeClock()
    app, engine = scripted(small_loaded, make_config(queue_limit=1), clock=clock, gated=True)
    async with serve(app) as server:
        for _ in range(3):  # three generations of 7 s each, on the actor's clock
            done = asyncio.create_task(post(server, "/v1/chat/completions", CHAT))
            await asyncio.to_thread(engine.running.wait, 5)
            clock.advance(7.0)
            engine.step(2)  # max_tokens 2: two tokens out
            assert (await done)[0] == 200
        running = asyncio.create_task(post(server, "/v1/chat/completions", CHAT))
        await asyncio.to_thread(engine.running.wait, 5)
        clock.advance(2.0)
        waiting = asyncio.create_task(post(server, "/v1/chat/completions", CHAT))
        await until(lambda: app[ENGINE].waiting == 1)
        status, headers, body = await post(server, "/v1/chat/completions", CHAT)
        assert status == 503 and body["error"]["code"] == "queue_full"
        assert headers["Retry-After"] == str(1 * 7 + 5)  # one waiting, 5 s left of the running
        engine.step(4)
        assert (await running)[0] == 200 and (await waiting)[0] == 200


async def until(predicate, timeout_s=5.0):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)
