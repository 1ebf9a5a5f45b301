"""`tandem serve`'s loop: it listens, drains on SIGTERM (the running answer completes, new
requests get 503), then stops; a model that cannot load is a clean exit status."""

import argparse
import asyncio
import os
import signal

import aiohttp

from scripted_engine import ScriptedEngine
from tandem.actors.engine_actor import EngineActor
from tandem.config import add_config_flags
from tandem.serve import serve, serve_main

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


async def test_sigterm_drains_the_running_request_and_refuses_new_ones(small_loaded,
                                                                      make_config):
    config = make_config(port=0)
    engine = ScriptedEngine(list(range(100, 110)), window=config.engine.window, gated=True)
    actor = EngineActor("engine", make_engine=lambda: engine)
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(config, small_loaded, engine=actor, ready=ready))
    async with asyncio.timeout(10):
        port = await ready
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/health") as r:
            assert r.status == 200
        running = asyncio.create_task(http.post(base + "/v1/chat/completions", json=CHAT))
        await asyncio.to_thread(engine.running.wait, 5)
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            while not actor.draining:
                await asyncio.sleep(0.01)
        async with http.post(base + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and "Retry-After" in r.headers
            assert (await r.json())["error"]["code"] == "draining"
        async with http.get(base + "/health") as r:
            assert r.status == 503
        engine.step(10)
        resp = await running
        body = await resp.json()
        assert resp.status == 200
        assert body["usage"]["completion_tokens"] == 10
    async with asyncio.timeout(10):
        assert await served == 0


def test_a_model_that_cannot_load_exits_with_status_2(tmp_path):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--model", str(tmp_path / "missing"), "--home", str(tmp_path)])
    assert serve_main(args) == 2


async def test_the_start_heap_is_frozen_while_serving_and_given_back_at_the_stop(small_loaded,
                                                                                 make_config):
    """gc.freeze once the site listens (tandem.serve.freeze_startup_heap: a full collection
    would otherwise walk the start's objects, holding the GIL from every stream), and
    gc.unfreeze when the server stops (a process serving again, a test's, collects as ever)."""
    import gc

    config = make_config(port=0)
    engine = ScriptedEngine(list(range(100, 103)), window=config.engine.window)
    actor = EngineActor("engine", make_engine=lambda: engine)
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    served = asyncio.create_task(serve(config, small_loaded, engine=actor, ready=ready,
                                       stop=stop))
    async with asyncio.timeout(10):
        await ready
    assert gc.get_freeze_count() > 1000
    stop.set()
    async with asyncio.timeout(10):
        assert await served == 0
    assert gc.get_freeze_count() == 0
