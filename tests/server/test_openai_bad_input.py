"""Bad input and overload answer in the OpenAI error format, never a traceback; a client that
is slow or leaves does not hold the engine."""

import asyncio

import aiohttp
import openai
import pytest

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.server.app import build_app
from tandem.server.keys import ENGINE, JOURNAL

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def scripted(loaded, config, script=(11, 12, 13), **options):
    engine = ScriptedEngine(list(script), window=config.engine.window, **options)
    actor = EngineActor("engine", make_engine=lambda: engine,
                        queue_limit=config.server.queue_limit)
    return build_app(config, loaded, engine=actor), engine


async def until(predicate, timeout_s=5.0):
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def post(server, path, data=None, *, json=None, headers=None):
    headers = {"Content-Type": "application/json", **(headers or {})}  # the guard wants JSON
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}{path}", data=data, json=json,
                             headers=headers) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)


def assert_openai_error(body, *, param=None, code=None):
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code


@pytest.fixture
async def server(small_loaded, make_config, serve):
    app, _ = scripted(small_loaded, make_config(window=64, max_body_bytes=4096))
    async with serve(app) as server:
        yield server


async def test_malformed_json_is_a_400(server):
    status, _, body = await post(server, "/v1/chat/completions", b'{"model": "small", ')
    assert status == 400
    assert_openai_error(body, code="invalid_json")
    status, _, body = await post(server, "/v1/chat/completions", b"[1, 2]")
    assert status == 400


@pytest.mark.parametrize("field,value", [("max_tokens", "ten"), ("temperature", -1),
                                         ("messages", "hi"), ("stream", "yes"),
                                         ("top_p", 0), ("stop", 3)])
async def test_a_wrong_type_is_a_400_naming_the_field(server, field, value):
    status, _, body = await post(server, "/v1/chat/completions", json={**CHAT, field: value})
    assert status == 400
    assert_openai_error(body, param=field)


async def test_a_missing_model_or_bad_messages_are_400(server):
    status, _, body = await post(server, "/v1/chat/completions",
                                 json={"messages": CHAT["messages"]})
    assert status == 400 and body["error"]["param"] == "model"
    status, _, body = await post(server, "/v1/chat/completions",
                                 json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "messages"
    assert "wizard" in body["error"]["message"]


@pytest.mark.parametrize("field,value", [("n", 9)])
async def test_fields_that_matter_and_cannot_be_honoured_are_refused(server, field, value):
    status, _, body = await post(server, "/v1/chat/completions", json={**CHAT, field: value})
    assert status == 400
    assert_openai_error(body, param=field, code="unsupported_parameter")


async def test_harmless_unknown_fields_are_ignored(server):
    status, _, body = await post(server, "/v1/chat/completions", json={
        **CHAT, "n": 1, "user": "u", "presence_penalty": 0, "metadata": {"a": 1},
        "some_future_field": [1, 2]})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


async def test_a_prompt_over_the_window_names_both_counts(server, sdk):
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(server).completions.create(model="small", prompt=list(range(100)))
    error = err.value.body
    assert error["code"] == "context_length_exceeded"
    assert "100 tokens" in error["message"] and "64" in error["message"]
    with pytest.raises(openai.BadRequestError):
        await sdk(server).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "word " * 200}])


async def test_an_unknown_model_is_a_404(server, sdk):
    with pytest.raises(openai.NotFoundError) as err:
        await sdk(server).chat.completions.create(model="gpt-9", messages=CHAT["messages"])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await sdk(server).completions.create(model="gpt-9", prompt="x")


async def test_a_body_over_the_limit_is_a_413(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    status, headers, body = await post(server, "/v1/chat/completions", json=big)
    assert status == 413
    assert_openai_error(body, code="request_too_large")


async def test_unknown_routes_and_methods_answer_in_the_error_format(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/v1/nothing") as r:
            assert r.status == 404
            assert_openai_error(await r.json())
        async with http.get(f"http://127.0.0.1:{server.port}/v1/chat/completions") as r:
            assert r.status == 405
            assert_openai_error(await r.json())


async def test_a_queue_over_its_limit_gets_503_with_retry_after(small_loaded, make_config,
                                                               serve):
    app, engine = scripted(small_loaded, make_config(queue_limit=1), gated=True)
    async with serve(app) as server:
        running = asyncio.create_task(post(server, "/v1/chat/completions", json=CHAT))
        await asyncio.to_thread(engine.running.wait, 5)
        waiting = asyncio.create_task(post(server, "/v1/chat/completions", json=CHAT))
        await until(lambda: app[ENGINE].waiting == 1)
        status, headers, body = await post(server, "/v1/chat/completions", json=CHAT)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert_openai_error(body, code="queue_full")
        engine.step(10)
        assert (await running)[0] == 200 and (await waiting)[0] == 200


async def test_a_client_that_sends_its_body_too_slowly_is_cut_off(small_loaded, make_config,
                                                                  serve):
    app, _ = scripted(small_loaded, make_config(request_read_timeout_s=0.3))
    async with serve(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()  # until the server closes the connection
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"request_timeout"' in answer


async def test_a_client_leaving_mid_stream_cancels_and_frees_the_engine(small_loaded,
                                                                       make_config, serve):
    app, engine = scripted(small_loaded, make_config(), script=range(100, 200), gated=True)
    async with serve(app) as server:
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={**CHAT, "max_tokens": 100, "stream": True}) as r:
                engine.step(2)
                first = await r.content.readline()
                assert first.startswith(b"data: ")
            # leaving the block closed the connection mid-stream
        journal = app[JOURNAL]
        await until(lambda: journal.tail(1))
        row = journal.tail(1)[0]
        assert row["status"] == 499 and row["finish_reason"] == "cancelled"
        await until(lambda: not engine.running.is_set())
        assert len(engine.prompts) == 1
        engine.gate = None
        status, _, body = await post(server, "/v1/chat/completions", json=CHAT)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
