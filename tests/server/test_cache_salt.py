"""cache_salt through the HTTP server (the small real model, the real tokenizer): requests with
different salts share no cached state, whatever tier would serve them (the prompt's rows, the
response cache, the suffix store's drafts), requests without a salt share one namespace as
before, a bad salt is a 400, require_cache_salt refuses a request without one, and the salt
never reaches usage, the journal or a log line."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from structlog.testing import capture_logs

from tandem.config import CacheConfig, SpeculationConfig
from tandem.server.app import build_app

SECRET = "tenant-secret-7f3a9c"
PROMPT = ("The committee met on a cold Tuesday to weigh the harbour plan, the rail link and "
          "the budget for the new school. ") * 12  # about 300 tokens: past four grid lines


def _cache(doc: dict) -> dict:
    return doc["usage"]["tandem"]["cache"]


async def _complete(http, base, salt=None, **extra) -> dict:
    body = {"model": "small", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_another_salt_is_served_cold_and_each_salt_its_own_cache(small_loaded, make_config,
                                                                       serve, sdk):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        a1 = await _complete(http, base, "a")
        b1 = await _complete(http, base, "b")  # the very same prompt, another tenant
        b2 = await _complete(http, base, "b")
        # Each tenant's rows stay in a slot of their own: A's are still in place for it.
        a2 = await _complete(http, base, "a")
        n1 = await _complete(http, base)
        n2 = await _complete(http, base)
        # The chat route takes the field too (the OpenAI SDK sends it in extra_body).
        client = sdk(server)
        messages = [{"role": "user", "content": PROMPT}]
        chats = [await client.chat.completions.create(
            model="small", messages=messages, max_tokens=2, temperature=0,
            extra_body={} if salt is None else {"cache_salt": salt})
            for salt in ("a", "b", "b")]
    for doc in (a1, b1, n1):
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _cache(doc)["source"] == "cold" and _cache(doc)["cached"] == 0
    for doc in (b2, a2, n2):
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, _cache(doc)
    # The very same prompt again, in its own namespace: from the prompt's end.
    assert _cache(b2)["source"] == "prompt_end" and _cache(a2)["source"] == "prompt_end"
    assert _cache(n2)["source"] == "prompt_end"
    # Each tenant gets the model's answer all the same.
    assert len({doc["choices"][0]["text"] for doc in (a1, b1, b2, a2, n1, n2)}) == 1
    sources = [c.usage.model_extra["tandem"]["cache"]["source"] for c in chats]
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
    assert sources[:2] == ["cold", "cold"] and cached[:2] == [0, 0]
    assert cached[2] > 0


async def test_a_bad_cache_salt_is_a_400_naming_it_on_both_routes(small_loaded, make_config,
                                                                  serve):
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        bodies = {"completions": {"model": "small", "prompt": "Hi", "max_tokens": 1},
                  "chat/completions": {"model": "small", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "Hi"}]}}
        for route, body in bodies.items():
            for salt in ("", "x" * 1025, 5, ["a"], {"salt": "a"}):
                async with http.post(f"{base}/v1/{route}",
                                     json={**body, "cache_salt": salt}) as resp:
                    assert resp.status == 400, (route, salt)
                    error = (await resp.json())["error"]
                    assert error["param"] == "cache_salt", error
            for salt in ("x" * 1024, "é🔑", None):
                async with http.post(f"{base}/v1/{route}",
                                     json={**body, "cache_salt": salt}) as resp:
                    assert resp.status == 200, await resp.text()


async def test_require_cache_salt_refuses_a_request_without_one(small_loaded, make_config,
                                                                serve):
    config = msgspec.structs.replace(make_config(), cache=CacheConfig(require_cache_salt=True))
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        bodies = {"completions": {"model": "small", "prompt": "Hi", "max_tokens": 1},
                  "chat/completions": {"model": "small", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "Hi"}]}}
        for route, body in bodies.items():
            async with http.post(f"{base}/v1/{route}", json=body) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert (error["param"], error["code"]) == ("cache_salt", "missing_cache_salt")
            async with http.post(f"{base}/v1/{route}",
                                 json={**body, "cache_salt": "a"}) as resp:
                assert resp.status == 200, await resp.text()
    rows = config.journal_path().read_text().splitlines()
    refused = [msgspec.json.decode(r) for r in rows]
    assert [(r["status"], r["error"]) for r in refused if r["status"] == 400] == \
        [(400, "missing_cache_salt")] * 2


async def test_the_salt_never_reaches_usage_the_journal_or_a_log(small_loaded, make_config,
                                                                  serve):
    config = make_config()
    with capture_logs() as logs:
        async with serve(build_app(config, small_loaded)) as server, \
                aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{server.port}"
            body = {"model": "small", "prompt": PROMPT, "max_tokens": 4, "cache_salt": SECRET}
            texts = []
            for stream in (False, True):
                async with http.post(f"{base}/v1/completions",
                                     json={**body, "stream": stream,
                                           "stream_options": {"include_usage": True}}) as resp:
                    assert resp.status == 200
                    texts.append(await resp.text())
            async with http.post(f"{base}/v1/completions",
                                 json={**body, "cache_salt": ""}) as resp:
                texts.append(await resp.text())
            for route in ("/v1/cache/stats", "/health", "/v1/actors"):
                async with http.get(base + route) as resp:
                    texts.append(await resp.text())
    journal = config.journal_path().read_text()
    assert journal.count("\n") == 3
    for text in (*texts, journal, repr(logs)):
        assert SECRET not in text


async def test_the_response_cache_answers_a_salt_from_its_own_requests_only(
        small_loaded, make_config, serve):
    config = msgspec.structs.replace(make_config(), cache=CacheConfig(response_cache=True))
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        sources = [_cache(await _complete(http, base, salt))["source"]
                   for salt in ("a", "a", "b", None, "b", None)]
    assert sources == ["cold", "response", "cold", "cold", "response", "response"]


MESSAGES = [{"role": "user", "content": "Write the numbers from one to twenty in words."}]


async def _chat(http, base, salt=None, content=None) -> dict:
    messages = MESSAGES if content is None else [{"role": "user", "content": content}]
    body = {"model": "small", "messages": messages, "max_tokens": 40, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _suffix(http, base, documents: int) -> dict:
    """/health's suffix store once it holds ``documents`` and its index covers them."""
    for _ in range(200):
        async with http.get(f"{base}/health") as resp:
            store = (await resp.json())["suffix_store"]
        if store["documents"] >= documents and store["indexed_tokens"] == store["tokens"]:
            return store
        await asyncio.sleep(0.05)
    raise AssertionError(f"the suffix store never held {documents} documents: {store}")


async def test_the_suffix_store_never_drafts_a_salted_requests_text_nor_for_a_salt(
        small_loaded, make_config, serve):
    """Gate: greedy, so each answer is the model's whatever was drafted. The first request
    drafts from its own tokens only (the store is empty): a salted request must draft exactly
    that much, where an unsalted one drafts more from what the store holds."""
    config = msgspec.structs.replace(make_config(), speculation=SpeculationConfig(
        speculation="lookup", draft_max=8))
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        alone = await _chat(http, base, "a")  # the store is empty: its own tokens only
        await _chat(http, base, "a", "Count from one to ten.")
        await _chat(http, base, "b", "Name the months of the year.")
        first = await _chat(http, base)  # unsalted: written to the store
        store = await _suffix(http, base, 1)
        assert store["documents"] == 1  # the salted requests wrote nothing
        unsalted = await _chat(http, base)
        salted = await _chat(http, base, "b")
    spec = {name: doc["usage"]["tandem"]["speculation"]["drafted"] for name, doc in
            (("alone", alone), ("first", first), ("unsalted", unsalted), ("salted", salted))}
    assert spec["unsalted"] > spec["first"] == spec["alone"], spec
    assert spec["salted"] == spec["alone"], spec
    answers = {doc["choices"][0]["message"]["content"] for doc in (alone, first, unsalted,
                                                                   salted)}
    assert len(answers) == 1
