"""The prompt-end anchor through the HTTP server (the small real model, the real tokenizer): the
same prompt sent twice (a retry, a regenerate) forwards nothing the second time, reports source
``prompt_end`` with nothing re-read, and answers what a cold server answers (greedy: the first
token comes from the prefill's own logits, kept bit for bit); a prompt that differs in its last
token does not take it, and the knob turns it off."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from tandem.config import CacheConfig
from tandem.models.chat import encode_chat
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


async def test_a_chat_whose_stream_the_client_stopped_resumes_at_its_prompts_end(
        small_loaded, make_config, serve, tmp_path):
    """A user presses stop: the client closes the stream after a few chunks and sends the
    conversation back with the part of the answer it saw. The rows hold more of the answer
    than that (what was decoded before the server saw the close), so no end anchor serves it;
    the turn resumes at the first prompt's end and forwards the part answer and the new
    message, not the whole last grid cell. Greedy gate: a cold server answers the same."""
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "small", "messages": messages, "max_tokens": 200, "temperature": 0,
            "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    config = make_config(window=2048, parallel=1)
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{server.port}"
        seen, chunks = "", 0
        resp = await http.post(f"{base}/v1/chat/completions", json=body)
        assert resp.status == 200
        async for line in resp.content:
            text = line.decode().strip()
            if not text.startswith("data: {"):
                continue
            choices = msgspec.json.decode(text[6:])["choices"]
            if choices:
                seen += choices[0]["delta"].get("content") or ""
                chunks += 1
            if chunks == 4:
                break
        # The server decodes on while the client has not read on; then it stops reading.
        await asyncio.sleep(0.3)
        resp.close()  # stop: the connection goes
        assert seen
        follow = messages + [{"role": "assistant", "content": seen},
                             {"role": "user", "content": "Go on, but shorter."}]
        turn = {"model": "small", "messages": follow, "max_tokens": 8, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}
        async with http.post(f"{base}/v1/chat/completions", json=turn) as r:
            assert r.status == 200, await r.text()
            resumed = await r.json()
    fresh = msgspec.structs.replace(config, home=str(tmp_path / "cold"))
    async with serve(build_app(fresh, small_loaded)) as server, \
            aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                             json=turn) as r:
            cold = await r.json()
    cache = _cache(resumed)
    assert cache["source"] == "prompt_end", cache
    assert cache["cached"] == len(encode_chat(small_loaded.tokenizer, messages,
                                              enable_thinking=False))
    assert cache["reread"] < 40, cache  # the part answer, the new message and the glue
    assert _cache(cold)["source"] == "cold"
    assert resumed["choices"][0]["message"] == cold["choices"][0]["message"]
