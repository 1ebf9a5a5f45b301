"""Through the HTTP server: the memory governor (a prefill that cannot fit under the peak gets a
503 with Retry-After; the limits are edited live; its metrics), and the response cache (an
identical greedy request answered from memory; a sampled one and any changed parameter never)."""

import aiohttp
import pytest

from tandem.cache.governor import CpuAllocator
from tandem.cache.response import CachedResponse, ResponseCache
from tandem.actors.engine_messages import GenerationParams
from tandem.config import CacheConfig, Config, EngineConfig, MemoryConfig
from tandem.server.app import build_app

GiB = 1 << 30


def config(tmp_path, **cache) -> Config:
    # Limits far under what any Python process holds: every prefill is refused.
    return Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64),
                  cache=CacheConfig(**cache),
                  memory=MemoryConfig(mem_ceiling_gib=0.002, mem_peak_gib=0.004,
                                      reserve_slack_gib=0.001))


async def test_a_prefill_that_cannot_fit_gets_503_then_runs_once_the_limits_are_raised(
        small_loaded, serve, tmp_path):
    app = build_app(config(tmp_path), small_loaded)
    async with serve(app) as server, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{server.port}"
        body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 3,
                "temperature": 0}
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_memory"
        # A streamed request is refused before its headers go out: the same 503.
        chat = {"model": "small", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3, "stream": True}
        async with http.post(url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_memory"
        async with http.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 503
        async with http.post(url + "/v1/memory/limits", json={"mem_ceiling_gib": 0.5}) as resp:
            assert resp.status == 400  # over the peak: refused, nothing changed
        machine_gib = CpuAllocator().total_nbytes() / GiB  # an edit must fit in the machine
        async with http.post(url + "/v1/memory/limits", json={
                "mem_ceiling_gib": machine_gib * 0.9, "mem_peak_gib": machine_gib,
                "reserve_slack_gib": 0.25}) as resp:
            assert resp.status == 200
            report = await resp.json()
            assert report["limits"]["mem_peak_gib"] == machine_gib
            assert report["refusals"] == 3
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        async with http.get(url + "/v1/memory") as resp:
            report = await resp.json()
            assert set(report["levels"]) == {"store", "prompt_end", "anchors", "end", "stash",
                                             "park", "pin", "slots"}
            assert report["levels"]["slots"] > 0  # the rows the first slot backed
            assert report["levels"]["anchors"] == 0  # a 5-token prompt reaches no grid line
            assert report["levels"]["end"] > 0
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
            assert 'tandem_memory_bytes{level="end"}' in text
            assert 'tandem_memory_shed_total{level="store"}' in text
            assert 'tandem_memory_bytes{level="engine"}' in text


def test_the_response_cache_keys_on_every_parameter_and_never_answers_sampling():
    cache = ResponseCache(1 << 20)
    greedy = GenerationParams(max_tokens=4, temperature=0.0)
    answer = CachedResponse(((5, False), (6, True)), finished=None)
    assert cache.put([1, 2, 3], greedy, [], answer)
    assert cache.lookup([1, 2, 3], greedy) is answer
    assert cache.lookup([1, 2, 4], greedy) is None
    assert cache.lookup([1, 2, 3], GenerationParams(max_tokens=5, temperature=0.0)) is None
    assert cache.lookup([1, 2, 3], greedy, ["\n"]) is None
    assert cache.lookup([1, 2, 3], GenerationParams(max_tokens=4, temperature=0.0,
                                                    max_reasoning_tokens=2)) is None
    sampled = GenerationParams(max_tokens=4, temperature=0.7, seed=1)
    assert not cache.put([1, 2, 3], sampled, [], answer)
    assert cache.lookup([1, 2, 3], sampled) is None
    assert (cache.hits, cache.sampled) == (1, 1)
    small = ResponseCache(2 * 1024)
    for i in range(4):
        small.put([i] * 10, greedy, [], answer)
    assert small.evictions >= 1 and small.nbytes <= 2 * 1024
    small.check_invariants()


@pytest.fixture
async def cached_server(small_loaded, serve, tmp_path):
    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64),
                 cache=CacheConfig(response_cache=True))
    async with serve(build_app(cfg, small_loaded)) as server:
        yield server


async def test_an_identical_greedy_request_is_answered_from_memory(cached_server, sdk):
    client = sdk(cached_server)
    ask = dict(model="small", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
               temperature=0)
    first = await client.chat.completions.create(**ask)
    second = await client.chat.completions.create(**ask)
    assert first.usage.model_extra["tandem"]["cache"]["source"] != "response"
    assert second.usage.model_extra["tandem"]["cache"]["source"] == "response"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].message.model_extra["reasoning_content"] == \
        first.choices[0].message.model_extra["reasoning_content"]
    assert second.usage.completion_tokens == first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    # Streamed, the same answer from memory.
    stream = await client.chat.completions.create(**ask, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.model_extra["tandem"]["cache"]["source"] == "response"
    # Any changed parameter, or sampling, goes to the engine.
    for change in ({"max_tokens": 5}, {"temperature": 0.7, "seed": 3}, {"top_p": 0.5},
                   {"stop": ["xyz"]}):
        resp = await client.chat.completions.create(**{**ask, **change})
        assert resp.usage.model_extra["tandem"]["cache"]["source"] != "response", change
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{cached_server.port}/v1/cache/stats") as resp:
            stats = (await resp.json())["tiers"]["response"]
    assert stats["hits"] == 2 and stats["sampled"] == 1


async def test_a_request_resumed_from_the_state_store_says_so_in_usage_and_journal(
        small_loaded, serve, sdk, tmp_path):
    from tandem.server.keys import JOURNAL

    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64,
                                                                   parallel=1),
                 cache=CacheConfig(resident_park_gb=0))  # no park: the store is the only copy
    app = build_app(cfg, small_loaded)
    first = list(range(1000, 1200))
    async with serve(app) as server:
        client = sdk(server)

        async def send(ids):
            resp = await client.completions.create(model="small", prompt=ids, max_tokens=2,
                                                   temperature=0)
            return resp.usage.model_extra["tandem"]["cache"]

        await send(first)
        await send(list(range(3000, 3200)))  # replaces the rows in place
        cache = await send(first[:195] + list(range(5000, 5020)))
        assert cache == {"tier": "ram_snapshot", "source": "store", "cached": 192, "reread": 23,
                         "slot": 0}
        rows = app[JOURNAL].tail(1)
        assert rows[-1]["cache_source"] == "store" and rows[-1]["cache_tier"] == "ram_snapshot" and rows[-1]["cached_tokens"] == 192
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/v1/cache/stats") as resp:
                store = (await resp.json())["tiers"]["store"]
        assert store["prefix_hits"] == 1 and store["session_puts"] >= 2
