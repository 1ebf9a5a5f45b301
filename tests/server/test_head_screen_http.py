"""Greedy decode through the head's screen (tandem/kernels/screen.py) end to end: a server
answers the same requests with the screen and another (a home of its own) with it taken away.
Gate: identical greedy tokens (text) for chats and completions, streamed or not, with
speculation's drafts and without; a request that wants logprobs gets the same tokens and
logprobs (it reads the full head either way). The screened server's greedy tokens do come
through the screen (the model's step answers with Chosen), and /metrics counts them."""

import aiohttp
import msgspec
import pytest

from tandem.config import SpeculationConfig
from tandem.kernels import native
from tandem.models import hybrid
from tandem.models.base import Chosen
from tandem.server.app import build_app

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel does not build on this machine")

USER = "Write a few words about the sea, the wind and the boats. " * 6


async def _answers(client):
    out = []
    chat = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": USER}], max_tokens=24,
        temperature=0)
    msg = chat.choices[0].message
    out.append((msg.content, msg.model_extra.get("reasoning_content")))
    done = await client.completions.create(model="small", prompt=USER + USER, max_tokens=32,
                                           temperature=0)
    out.append(done.choices[0].text)
    stream = await client.completions.create(model="small", prompt=USER * 3, max_tokens=32,
                                             temperature=0, stream=True)
    out.append("".join([c.choices[0].text async for c in stream if c.choices]))
    scored = await client.completions.create(model="small", prompt=USER, max_tokens=8,
                                             temperature=0, logprobs=2)
    out.append((scored.choices[0].text, scored.choices[0].logprobs.token_logprobs))
    return out


@pytest.mark.parametrize("speculation", [True, False])
async def test_the_screen_answers_as_the_full_head_does(small_loaded, make_config, serve, sdk,
                                                        speculation, tmp_path, monkeypatch):
    plan = small_loaded.model._native_step()
    assert plan is not None and plan.screen is not None
    config = make_config(window=4096)
    if not speculation:
        config = msgspec.structs.replace(config, speculation=SpeculationConfig(speculation="off"))
    chosen = []

    class Counted(Chosen):
        def __init__(self, token):
            chosen.append(token)
            super().__init__(token)

    monkeypatch.setattr(hybrid, "Chosen", Counted)
    before = dict(small_loaded.model.screen_counts)
    async with serve(build_app(config, small_loaded)) as server:
        screened = await _answers(sdk(server))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                metrics = await r.text()
    monkeypatch.undo()
    assert len(chosen) >= 24  # greedy tokens came through the screen (96 were asked for)
    # /metrics counts them: the model's counters since its load, this run's among them
    counts = small_loaded.model.screen_counts
    assert counts["screened"] - before["screened"] == len(chosen)
    assert f"tandem_head_screen_tokens {float(counts['screened'])}" in metrics
    assert f"tandem_head_screen_full_rows {float(counts['full'])}" in metrics
    kept = plan.screen
    plan.set_screen(None)
    try:
        # a home of its own: nothing the first server spilled is read back at this one's start
        config = msgspec.structs.replace(config, home=str(tmp_path / "full"))
        async with serve(build_app(config, small_loaded)) as server:
            full = await _answers(sdk(server))
    finally:
        plan.set_screen(kept)
    assert screened == full


async def test_greedy_requests_through_http_leave_the_heads_pages_unmapped(make_config, serve,
                                                                            sdk, tmp_path):
    """A model of its own (a fresh mapping): greedy chats and completions through the server,
    streamed and not, leave the tied head's pages unmapped (its screen, exact rows and
    embedding rows read from the file: tests/kernels/test_rows_file.py); a sampled request,
    which reads the whole head, maps it (the count is not blind)."""
    import os
    from pathlib import Path

    from small_hybrid import make_small_hybrid
    from tandem.models import load_model

    path = make_small_hybrid(tmp_path / "models" / "small")
    loaded = load_model(str(path), Path(path).parent, "float32")
    head = loaded.model.w["lm_head.weight"]
    page = os.sysconf("SC_PAGE_SIZE")

    def mapped() -> float:
        lo = head.data_ptr() // page
        hi = (head.data_ptr() + head.numel() * 4 + page - 1) // page
        try:
            with open("/proc/self/pagemap", "rb") as f:
                f.seek(lo * 8)
                entries = memoryview(f.read((hi - lo) * 8)).cast("Q")
        except OSError:
            pytest.skip("no /proc/self/pagemap here")
        return sum(1 for e in entries if e >> 63) / (hi - lo)

    async with serve(build_app(make_config(window=4096), loaded)) as server:
        client = sdk(server)
        await _answers_greedy(client)
        assert mapped() < 0.01
        await client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": USER}], max_tokens=4,
            temperature=0.8, seed=1)
        assert mapped() > 0.9


async def _answers_greedy(client):
    await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": USER}], max_tokens=24,
        temperature=0)
    stream = await client.completions.create(model="small", prompt=USER * 3, max_tokens=32,
                                             temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices])
