"""The prompt-end anchor through the HTTP server (the small real model, the real tokenizer): the
same prompt sent twice (a retry, a regenerate) forwards nothing the second time, reports source
``prompt_end`` with nothing re-read, and answers what a cold server answers (greedy: the first
token comes from the prefill's own logits, kept bit for bit); a prompt that differs in its last
token does not take it, and the knob turns it off."""

from __future__ import annotations

import aiohttp
import msgspec

from tandem.config import CacheConfig
from tandem.server.app import build_app

PROMPT = ("The committee met on a cold Tuesday to weigh the harbour plan, the rail link and "
          "the budget for the new school. ") * 12  # about 300 tokens, past four grid lines


def _cache(doc: dict) -> dict:
    return doc["usage"]["tandem"]["cache"]


async def _complete(http, base, prompt, **extra) -> dict:
    body = {"model": "small", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_the_same_prompt_twice_forwards_nothing_and_answers_as_a_cold_server(
        small_loaded, make_config, serve, sdk):
    ids = small_loaded.tokenizer.encode(PROMPT)
    other = ids[:-1] + [ids[-1] + 1]
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        first = await _complete(http, base, ids)
        second = await _complete(http, base, ids)
        third = await _complete(http, base, ids)
        differs = await _complete(http, base, other)
        client = sdk(server)
        messages = [{"role": "user", "content": PROMPT}]
        chats = [await client.chat.completions.create(model="small", messages=messages,
                                                      max_tokens=6, temperature=0)
                 for _ in range(2)]
        async with http.get(f"{base}/v1/cache/stats") as resp:
            stats = (await resp.json())["tiers"]["resident"]
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        cold_differs = await _complete(http, base, other)
    n = len(ids)
    assert _cache(first)["source"] == "cold"
    for doc in (second, third):
        assert _cache(doc) == {"tier": "resident", "source": "prompt_end", "cached": n,
                               "reread": 0, "slot": 0}, _cache(doc)
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == n
        assert doc["choices"][0]["text"] == first["choices"][0]["text"]
    assert _cache(differs)["source"] != "prompt_end" and _cache(differs)["reread"] > 0
    assert differs["choices"][0]["text"] == cold_differs["choices"][0]["text"]
    chat_cache = chats[1].usage.model_extra["tandem"]["cache"]
    assert (chat_cache["source"], chat_cache["reread"]) == ("prompt_end", 0), chat_cache
    assert chats[1].choices[0].message == chats[0].choices[0].message
    assert stats["prompt_end_hits"] == 3 and stats["prompt_end"] is not None


async def test_with_the_knob_off_the_repeat_rereads_its_last_line(small_loaded, make_config,
                                                                   serve):
    config = msgspec.structs.replace(make_config(), cache=CacheConfig(prompt_end_anchor=False))
    ids = small_loaded.tokenizer.encode(PROMPT)
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        first = await _complete(http, base, ids)
        second = await _complete(http, base, ids)
    n = len(ids)
    # Back to the last grid line under the prompt's last token (prefix_chunk 64).
    assert (_cache(second)["source"], _cache(second)["reread"]) == ("resident",
                                                                     n - (n - 1) // 64 * 64)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
