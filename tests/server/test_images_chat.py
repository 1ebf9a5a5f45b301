"""Images in a chat through the HTTP server (issue 19, parts 1, 3, 4, 5, 7): the route renders,
caps, preprocesses and keys the images, the engine runs the tower through its cache, and every
cache compares key ids.

Gates: the greedy tokens of a chat with an image are the reference loop's
(tests/models/test_vision.py's, on the grid the engine prefills on: the same bits); a resumed
image conversation gives a cold server's greedy tokens, identical."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from small_hybrid import make_small_vl
from tandem.config import CacheConfig, ImagesConfig
from tandem.models import image_keys, load_model, vision
from tandem.models import image_processor as ip
from tandem.models.chat import encode_chat, parse_output
from tandem.server.app import build_app
from tandem.server.state import STATE

SYSTEM = "You describe pictures carefully, briefly and in plain words. " * 10
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def vl_loaded(tmp_path_factory):
    path = make_small_vl(tmp_path_factory.mktemp("models") / "small")
    return load_model(str(path), path.parent, "float32")


def _png(seed: int, size=(160, 128), level: int = 6) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
        out, format="PNG", compress_level=level)
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _user(url: str, text: str = "What is in this picture?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def _config(make_config, **images):
    config = make_config(window=1024)
    return msgspec.structs.replace(config, images=ImagesConfig(**images))


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


def _reference(loaded, messages, images: list[bytes], steps: int, chunk: int) -> str:
    """The reference loop's greedy text: the prompt as the processor expands it, prefilled on
    the grid from token 0, decoded at the images' delta."""
    model, tok = loaded.model, loaded.tokenizer
    ids = encode_chat(tok, messages, None, enable_thinking=False)
    pre = [ip.preprocess(ip.decode(d), model.images.processor) for d in images]
    real = vision.expand_placeholders(ids, [p.num_tokens for p in pre],
                                      model.images.image_token_id)
    rows = [model.images.tower.encode(p.pixel_values, p.grid) for p in pre]
    placed = vision.PromptImages.build(real, [p.grid for p in pre], rows,
                                       model.images.image_token_id, 2)
    state = model.new_state(1024)
    with torch.inference_mode():
        logits = vision.prefill(model, state, real, placed, chunk)
        out, at = [], len(real)
        for _ in range(steps):
            t = int(torch.argmax(logits))
            if t in tok.eos_ids:
                break
            out.append(t)
            logits = model.forward(state, torch.tensor([t]), at, decode=True,
                                   rope_offset=placed.delta)
            at += 1
    return parse_output(tok.decode(out), thinking=False, tools=None).content


async def test_a_chat_with_an_image_gives_the_reference_loops_greedy_tokens_and_counts_it(
        vl_loaded, make_config, serve, sdk):
    data = _png(1)
    messages = [{"role": "system", "content": SYSTEM}, _user(_url(data))]
    app = build_app(_config(make_config), vl_loaded)
    async with serve(app) as server:
        resp = await sdk(server).chat.completions.create(
            model="small", messages=messages, max_tokens=12, temperature=0, extra_body=OFF)
        rows = app[STATE].journal.tail(1)
    want = _reference(vl_loaded, messages, [data], 12, 64)
    assert resp.choices[0].message.content == want
    parts = resp.usage.model_extra["tandem"]["parts"]
    assert parts["images"] == 20  # 160 x 128 pixels: 5 x 4 merged patches
    assert sum(parts[k] for k in ("system", "tools", "history", "images")) == \
        resp.usage.prompt_tokens
    extra = rows[-1]["extra"]["images"]
    assert extra == {"count": 1, "left_out": 0, "tokens": 20, "tower_runs": 1, "tower_hits": 0}
    assert "data:" not in str(rows[-1])  # counts only: no URL, no pixel


async def test_key_ids_hit_for_the_same_pixels_under_another_url_and_miss_for_new_pixels(
        vl_loaded, make_config, serve, sdk):
    """Through the response cache and the resident's anchors: a fetched URL whose image
    changes misses; the same pixels as a data URL (other bytes too) hit."""
    served = {"png": _png(1)}

    async def image(request):
        return web.Response(body=served["png"], content_type="image/png")

    images_app = web.Application()
    images_app.router.add_get("/pic.png", image)
    config = msgspec.structs.replace(_config(make_config, image_fetch="on"),
                                     cache=CacheConfig(response_cache=True))
    origin = TestServer(images_app, host="127.0.0.1")
    await origin.start_server()
    url = f"http://127.0.0.1:{origin.port}/pic.png"
    try:
        async with serve(build_app(config, vl_loaded)) as server:
            client = sdk(server)

            async def ask(image_url, text="What is in this picture?"):
                return await client.chat.completions.create(
                    model="small", messages=[{"role": "system", "content": SYSTEM},
                                             _user(image_url, text)],
                    max_tokens=4, temperature=0, extra_body=OFF)

            first = await ask(url)
            assert _cache(first)["source"] == "cold"
            # the same pixels, other bytes, another URL: the response cache answers
            same = await ask(_url(_png(1, level=9)))
            assert _cache(same)["source"] == "response"
            assert same.choices[0].message.content == first.choices[0].message.content
            # the same URL, new pixels: no cache serves the image's rows
            served["png"] = _png(2)
            new = await ask(url)
            assert _cache(new)["source"] != "response"
            head = len(encode_chat(vl_loaded.tokenizer, [{"role": "system", "content": SYSTEM}],
                                   None, add_generation_prompt=False))
            image_start = head + 3  # <|im_start|>user\n then <|vision_start|>
            assert new.usage.prompt_tokens_details.cached_tokens <= image_start
            # the new pixels again with another question: the anchors past the image serve it
            again = await ask(url, "And its colours?")
            assert _cache(again)["source"] in ("resident", "end", "prompt_end")
            assert again.usage.prompt_tokens_details.cached_tokens >= \
                (image_start + 20) // 64 * 64 > image_start
    finally:
        await origin.close()


async def test_an_image_resent_every_turn_resumes_at_its_end_with_the_tower_run_once_and_a_cold_servers_tokens(
        vl_loaded, make_config, serve, sdk, tmp_path):
    """Open WebUI's shape: the same image in the first user message of every turn."""
    image = _url(_png(3))
    messages = [{"role": "system", "content": SYSTEM}, _user(image)]
    warm_app = build_app(_config(make_config), vl_loaded)
    answers, cached, prompts = [], [], []
    async with serve(warm_app) as server:
        client = sdk(server)
        for turn in range(3):
            resp = await client.chat.completions.create(
                model="small", messages=messages, max_tokens=8, temperature=0, extra_body=OFF)
            answers.append(resp.choices[0].message.content)
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
            prompts.append(resp.usage.prompt_tokens)
            messages = messages + [{"role": "assistant", "content": answers[-1]},
                                   {"role": "user", "content": f"Tell me more, part {turn}."}]
        stats = (await _stats(server))["tiers"]["images"]
    assert stats["misses"] == 1 and stats["entries"] == 1  # the tower ran once
    for turn in (1, 2):
        # resumed at the previous turn's end (its grid anchors reach there at least)
        assert cached[turn] >= prompts[turn - 1] // 64 * 64 > 0, (turn, cached, prompts)
    # The cold server: the same requests, each with empty caches
    cold_config = msgspec.structs.replace(_config(make_config),
                                          home=str(tmp_path / "cold"))
    messages = [{"role": "system", "content": SYSTEM}, _user(image)]
    async with serve(build_app(cold_config, vl_loaded)) as server:
        client = sdk(server)
        for turn in range(3):
            await _clear(server)
            resp = await client.chat.completions.create(
                model="small", messages=messages, max_tokens=8, temperature=0, extra_body=OFF)
            assert resp.usage.prompt_tokens_details.cached_tokens == 0
            assert resp.choices[0].message.content == answers[turn], turn
            messages = messages + [{"role": "assistant", "content": answers[turn]},
                                   {"role": "user", "content": f"Tell me more, part {turn}."}]


async def _stats(server) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{server.port}/v1/cache/stats") as r:
            assert r.status == 200
            return await r.json()


async def _clear(server) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{server.port}/v1/cache/clear?tier=all",
                             json={}) as r:
            assert r.status == 200, await r.text()


async def test_the_caps_leave_out_the_oldest_images_in_steps_through_the_route(
        vl_loaded, make_config, serve, sdk):
    """Three 16-row images: a count cap of 2 leaves out one (step 1), never reading it; a
    token cap of 40 rows leaves out two (the excess 8 rounds up to the step of 20)."""
    small = [_url(_png(s, size=(128, 128))) for s in (4, 5, 6)]

    def chat(urls):
        return [{"role": "system", "content": "Be brief."}] + [
            _user(u, f"picture {i}") for i, u in enumerate(urls)]

    for caps, kept, left in (({"max_images": 2}, 2, 1), ({"max_image_tokens": 40}, 1, 2)):
        app = build_app(_config(make_config, **caps), vl_loaded)
        async with serve(app) as server:
            # past the count cap the oldest is left out before it is read: a broken one is no
            # 400 (the token cap reads each header for its size, never its pixels)
            urls = (["data:image/png;base64,@@"] + small[1:]) if "max_images" in caps else small
            resp = await sdk(server).chat.completions.create(
                model="small", messages=chat(urls), max_tokens=2, temperature=0,
                extra_body=OFF)
            row = app[STATE].journal.tail(1)[-1]
        assert resp.usage.model_extra["tandem"]["parts"]["images"] == 16 * kept, caps
        assert row["extra"]["images"]["left_out"] == left
        assert row["extra"]["images"]["count"] == kept


def test_the_route_keys_a_rendered_prompt_once_an_image(vl_loaded):
    from tandem.server.image_prompt import PromptImageSet

    support = vl_loaded.model.images
    pre = ip.preprocess(ip.decode(_png(7)), support.processor)
    digest = pre.digest()
    one = image_keys.ImageInput(key=image_keys.image_key(digest, pre.grid, 2), digest=digest,
                                grid=pre.grid, pixel_values=pre.pixel_values)
    ids = encode_chat(vl_loaded.tokenizer, [_user("data:,")], None, enable_thinking=False)
    keys = PromptImageSet(messages=[], inputs=[one]).key_ids(ids, support.image_token_id)
    assert len(keys) == len(ids) + 19 and keys.count(one.key) == 20
    assert support.image_token_id not in keys


async def test_key_ids_through_the_spill_a_restart_resumes_the_same_pixels_and_not_new_ones(
        vl_loaded, make_config, serve, sdk):
    """A planned stop writes the image conversation to the NVMe (its rows' ids, the images'
    keys among them); the next process reads it back: the same pixels under another URL resume
    inside the image, new pixels resume no further than before it."""
    from tandem.config import DiskConfig, SpeculationConfig, SpillConfig

    config = msgspec.structs.replace(
        _config(make_config), speculation=SpeculationConfig(speculation="off"),
        disk=DiskConfig(disk_cache_min_free_gb=0, disk_cache_min_tokens=1 << 20),
        spill=SpillConfig(session_spill_min_tokens=64, session_spill_park_min_tokens=64))
    system = {"role": "system", "content": SYSTEM}

    async def ask(client, data, text):
        return await client.chat.completions.create(
            model="small", messages=[system, _user(_url(data), text)], max_tokens=4,
            temperature=0, extra_body=dict(OFF, session_id="s"))

    async with serve(build_app(config, vl_loaded)) as server:
        await ask(sdk(server), _png(8), "What is in this picture?")
    head = len(encode_chat(vl_loaded.tokenizer, [system], None, add_generation_prompt=False))
    image_start = head + 3
    app = build_app(config, vl_loaded)
    async with serve(app) as server:
        client = sdk(server)
        same = await ask(client, _png(8, level=9), "What colours does it have?")
        # resumed at the spill's grid line past the image's first rows (the line at 128 lies
        # inside it: the tower runs once for its last rows)
        assert same.usage.prompt_tokens_details.cached_tokens >= \
            (image_start + 20) // 64 * 64 > image_start, _cache(same)
    app = build_app(config, vl_loaded)
    async with serve(app) as server:
        new = await ask(sdk(server), _png(9), "What colours does it have?")
        assert new.usage.prompt_tokens_details.cached_tokens <= image_start, _cache(new)
        assert app[STATE].journal.tail(1)[-1]["extra"]["images"]["tower_runs"] == 1


async def test_the_peek_of_an_image_conversation_is_what_its_next_turn_does(
        vl_loaded, make_config, serve, sdk):
    """The peek keys the images as the chat route does: its tier, line and re-read are the
    next turn's; new pixels under the same place peek cold past the image."""
    import aiohttp

    messages = [{"role": "system", "content": SYSTEM}, _user(_url(_png(5)))]
    async with serve(build_app(_config(make_config), vl_loaded)) as server, \
            aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        client = sdk(server)
        first = await client.chat.completions.create(
            model="small", messages=messages, max_tokens=6, temperature=0, extra_body=OFF)
        after = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And the colours?"}]
        body = {"model": "small", "messages": after, "max_tokens": 6, "temperature": 0, **OFF}
        async with http.post("/v1/cache/peek", json=body) as resp:
            peek = await resp.json()
            assert resp.status == 200, peek
        other = [after[0], _user(_url(_png(6)))] + after[2:]
        async with http.post("/v1/cache/peek", json={**body, "messages": other}) as resp:
            new_pixels = await resp.json()
        resp = await client.chat.completions.create(
            model="small", messages=after, max_tokens=6, temperature=0, extra_body=OFF)
    cache = _cache(resp)
    assert (peek["tier"], peek["cached_tokens"], peek["reread_tokens"]) == \
        (cache["tier"], cache["cached"], cache["reread"]), (peek, cache)
    assert peek["tier"] == "resident" and peek["cached_tokens"] > 0
    # The system text is shared; the image's rows are not: the line stops before them.
    assert new_pixels["cached_tokens"] < peek["cached_tokens"]


async def test_a_compaction_of_an_image_conversation_continues_at_its_end_and_the_server_lives(
        vl_loaded, make_config, serve, sdk):
    """A text-only compaction request of a session whose conversation had an image is served as
    its continuation (the image's rows are resumed, not read again); its rows carry key ids,
    which the prepared answers' key and the suffix store must take (each failed once: a 500
    and a suffix actor that stopped the server)."""
    from test_compaction_continue import COMPACT_SYSTEM, INSTRUCTIONS

    question = "What is in this picture of a ledger?"
    messages = [{"role": "system", "content": SYSTEM}, _user(_url(_png(5)), question)]
    headers = {"x-session-id": "img-compaction"}
    async with serve(build_app(_config(make_config), vl_loaded)) as server:
        client = sdk(server)
        first = await client.chat.completions.create(
            model="small", messages=messages, max_tokens=6, temperature=0, extra_body=OFF,
            extra_headers=headers)
        history = f"[User]: {question}\n\n[Assistant]: {first.choices[0].message.content}"
        compact = [{"role": "system", "content": COMPACT_SYSTEM},
                   {"role": "user", "content": "Here is the conversation so far:\n<conversation>\n"
                    + history + f"\n</conversation>\n\n{INSTRUCTIONS}"}]
        resp = await client.chat.completions.create(
            model="small", messages=compact, max_tokens=6, temperature=0, extra_headers=headers)
        assert _cache(resp)["source"] == "continuation", _cache(resp)
        assert _cache(resp)["cached"] > first.usage.prompt_tokens // 2
        again = await client.chat.completions.create(
            model="small", messages=messages, max_tokens=6, temperature=0, extra_body=OFF)
        assert again.choices  # the server still serves after the continuation's suffix append
        assert (await _stats(server))["tiers"]["images"]["misses"] == 1


@pytest.mark.parametrize("tier", ["disk", "store"])
async def test_key_ids_through_the_disk_tier_and_the_state_store(vl_loaded, make_config, serve,
                                                                 sdk, tier):
    """With the rows in place gone (a clear of the caches in RAM, or another conversation in
    the only slot), the same pixels in other bytes resume past the image from the disk tier or
    the state store; new pixels resume no further than the image's start."""
    from tandem.config import DiskConfig, EngineConfig

    config = _config(make_config)
    if tier == "disk":
        config = msgspec.structs.replace(config, disk=DiskConfig(
            disk_cache="on", disk_cache_min_free_gb=0, disk_cache_min_tokens=64,
            disk_cache_admit_after=1))
    else:
        config = msgspec.structs.replace(
            config, cache=CacheConfig(store=True, resident_park_gb=0),  # no park to resume
            engine=msgspec.structs.replace(config.engine, parallel=1))
    head = len(encode_chat(vl_loaded.tokenizer, [{"role": "system", "content": SYSTEM}], None,
                           add_generation_prompt=False))
    image_start = head + 3
    async with serve(build_app(config, vl_loaded)) as server:
        client = sdk(server)

        async def ask(image, text="What is in this picture?"):
            return await client.chat.completions.create(
                model="small", messages=[{"role": "system", "content": SYSTEM},
                                         _user(_url(image), text)],
                max_tokens=4, temperature=0, extra_body=OFF)

        async def away():
            if tier == "disk":
                import aiohttp
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"http://127.0.0.1:{server.port}/v1/cache/clear",
                                         json={}) as r:
                        assert r.status == 200
            else:
                await client.chat.completions.create(
                    model="small", messages=[{"role": "user", "content": "Another talk. " * 40}],
                    max_tokens=2, temperature=0, extra_body=OFF)

        first = await ask(_png(1))
        await _settle(server)
        await away()
        same = await ask(_png(1, level=9), "And its colours?")
        await away()
        new = await ask(_png(2), "And its colours?")
    assert _cache(same)["source"] == ("disk" if tier == "disk" else "store"), _cache(same)
    assert same.usage.prompt_tokens_details.cached_tokens > image_start  # rows of the image
    assert new.usage.prompt_tokens_details.cached_tokens <= image_start
    assert _cache(first)["source"] == "cold"


async def _settle(server) -> None:
    """The disk writer's queue empty (its writes come after the request)."""
    import asyncio
    for _ in range(200):
        disk = (await _stats(server))["tiers"].get("disk")
        if not disk or not disk.get("queued_jobs"):
            return
        await asyncio.sleep(0.05)
