"""Connections: a client that is slow to send its headers is closed, a flood of them never keeps
/health from answering, and what aiohttp cannot parse is answered as an OpenAI error."""

import asyncio
import json

import aiohttp

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.server.app import build_app
from tandem.server.keys import ENGINE

HEADERS = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n\r\n"


def scripted(loaded, config):
    engine = ScriptedEngine([11, 12, 13], window=config.engine.window, gated=True)
    actor = EngineActor("engine", make_engine=lambda: engine)
    return build_app(config, loaded, engine=actor), engine


async def health(port: int, timeout_s: float = 2.0) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        async with http.get(f"http://127.0.0.1:{port}/health") as r:
            return r.status


async def closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What the server sent until it closed the connection (a TimeoutError if it never does)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


async def test_headers_sent_a_byte_at_a_time_are_cut_off_while_health_answers(
        small_loaded, make_config, serve):
    app, _ = scripted(small_loaded, make_config(header_timeout_s=0.5))
    async with serve(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        gone = asyncio.create_task(closed(reader, 5.0))
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 0
        while not gone.done() and sent < len(HEADERS) - 1:  # never the last byte
            writer.write(HEADERS[sent:sent + 1])
            sent += 1
            assert await health(server.port) == 200  # meanwhile the server answers
            await asyncio.wait([gone], timeout=0.05)
        assert await gone == b""  # closed without an answer
        assert 0.5 <= loop.time() - start < 3.0
        writer.close()


async def test_a_keep_alive_connection_gets_the_same_deadline_for_its_next_request(
        small_loaded, make_config, serve):
    app, _ = scripted(small_loaded, make_config(header_timeout_s=0.5))
    async with serve(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(HEADERS)
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(HEADERS[:10])  # the next request never finishes its headers
        assert await closed(reader, 3.0) == b""
        writer.close()


async def test_a_flood_of_slow_connections_at_the_cap_does_not_stop_health(
        small_loaded, make_config, serve):
    # A long header deadline: only the cap can make room.
    app, _ = scripted(small_loaded, make_config(header_timeout_s=60, max_connections=8))
    async with serve(app) as server:
        flood = []
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(HEADERS[:5])
            flood.append((reader, writer))
        for _ in range(5):
            assert await health(server.port) == 200
        # The oldest waiters made room: most of the flood was closed, the newest are still open.
        await asyncio.sleep(0)
        still_open = [r for r, _ in flood if not r.at_eof()]
        assert len(still_open) <= 8
        for _, writer in flood:
            writer.close()


async def test_when_every_connection_is_mid_request_a_new_one_is_refused_at_once(
        small_loaded, make_config, serve):
    app, engine = scripted(small_loaded, make_config(max_connections=2))
    chat = {"model": "small", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    async with serve(app) as server:
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            running = [asyncio.create_task(http.post(url, json=chat)) for _ in range(2)]
            await asyncio.to_thread(engine.running.wait, 5)
            async with asyncio.timeout(5):
                while app[ENGINE].waiting < 1:  # both connections' requests are in
                    await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            answer = await closed(reader, 2.0)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503")
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "too_many_connections"
            engine.step(20)
            for task in running:
                resp = await task
                assert resp.status == 200
                resp.release()


async def test_framing_errors_are_answered_as_openai_errors(small_loaded, make_config, serve):
    app, _ = scripted(small_loaded, make_config())
    async with serve(app) as server:
        for raw in (b"GE\x00T / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                    b"GET / HTTP/1.1\r\nHo st: 127.0.0.1\r\n\r\n",
                    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Encoding: deflate\r\n"
                    b"Content-Length: 2\r\n\r\n{}"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(raw)
            answer = await closed(reader, 5.0)
            writer.close()
            head, body = answer.split(b"\r\n\r\n", 1)
            assert head.split(b" ")[1] == b"400", raw[:40]
            assert b"application/json" in head
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_http" and b"aaaa" not in body
        assert await health(server.port) == 200
