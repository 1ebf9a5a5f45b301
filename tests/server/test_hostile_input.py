"""Input a hostile client sends that must be a 400, never a 500 or a dead server: memory limits
that overflow, an x-session-id that is not UTF-8, a Content-Encoding the body does not have."""

import asyncio
import json

import aiohttp
import pytest

from tandem.server.app import build_app
from tandem.server.keys import JOURNAL

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def raw(port: int, request: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    async with asyncio.timeout(10):
        answer = await reader.read()  # each request here asks the server to close
    writer.close()
    head, body = answer.split(b"\r\n\r\n", 1)
    return int(head.split(b" ")[1]), json.loads(body)


def post(path: bytes, body: bytes, *headers: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body)


@pytest.mark.parametrize("body", [b'{"mem_peak_gib": 1e308}', b'{"mem_ceiling_gib": 1e308}',
                                  b'{"reserve_slack_gib": 1e308}',
                                  b'{"mem_peak_gib": 1' + b"0" * 400 + b"}",
                                  b'{"mem_ceiling_gib": -0.5}', b'{"mem_peak_gib": "8"}',
                                  b'{"mem_peak_gib": 1e999}', b'{"mem_peak_gib": 100000000}',
                                  b'{"mem_peak_gib": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
                         ids=lambda b: b[:30].decode())
async def test_a_limit_that_would_overflow_is_a_400_and_the_server_lives(
        body, small_loaded, make_config, serve):
    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/v1/memory") as r:
                before = (await r.json())["limits"]
            async with http.post(base + "/v1/memory/limits", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] in ("invalid_limits", "invalid_json",
                                                              "nested_too_deeply")
            async with http.get(base + "/v1/memory") as r:
                assert (await r.json())["limits"] == before  # nothing changed
            async with http.get(base + "/health") as r:
                assert r.status == 200
            async with http.post(base + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200


async def test_an_x_session_id_that_is_not_utf8_is_hashed_like_any_other(
        small_loaded, make_config, serve):
    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        body = json.dumps(CHAT).encode()
        for _ in range(2):
            status, doc = await raw(server.port, post(
                b"/v1/chat/completions", body, b"x-session-id: caf\xe9\xff\x80 \xed\xa0\x80"))
            assert status == 200, doc
        rows = app[JOURNAL].tail(2)
        assert rows[0]["session"] == rows[1]["session"] and len(rows[0]["session"]) == 16


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"br", b"x-unknown"])
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/memory/limits"])
async def test_a_content_encoding_the_body_does_not_have_is_a_400(
        encoding, path, small_loaded, make_config, serve):
    app = build_app(make_config(), small_loaded)
    body = json.dumps(CHAT if path.endswith(b"completions") else {"mem_peak_gib": 1}).encode()
    async with serve(app) as server:
        status, doc = await raw(server.port, post(path, body, b"Content-Encoding: " + encoding))
        assert status == (415 if encoding == b"x-unknown" else 400)
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/health") as r:
                assert r.status == 200


async def test_a_body_really_gzipped_is_read(small_loaded, make_config, serve):
    import gzip

    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        status, doc = await raw(server.port, post(
            b"/v1/chat/completions", gzip.compress(json.dumps(CHAT).encode()),
            b"Content-Encoding: gzip"))
        assert status == 200, doc


async def test_a_governor_that_stopped_is_a_503_with_retry_after(
        small_loaded, make_config, serve, monkeypatch):
    from tandem.actors import ActorStopped
    from tandem.server.keys import SUPERVISOR

    app = build_app(make_config(), small_loaded)
    async with serve(app) as server:
        async def stopped(*args, **kwargs):
            raise ActorStopped("governor")

        monkeypatch.setattr(app[SUPERVISOR].actors["governor"], "ask", stopped)
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/v1/memory") as r:
                assert r.status == 503
                assert int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == "governor_stopped"
            async with http.get(base + "/health") as r:
                assert r.status == 200


def test_every_503_says_when_to_come_back():
    from tandem.server.errors import ApiError

    assert ApiError(503, "the engine has stopped").response().headers["Retry-After"] == "1"
    assert ApiError(503, "busy", retry_after_s=7.2).response().headers["Retry-After"] == "7"
    assert "Retry-After" not in ApiError(400, "bad").response().headers
