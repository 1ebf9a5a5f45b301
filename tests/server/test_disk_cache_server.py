"""The disk tier through the HTTP server (issue 15), on the small real model: a prompt read cold
in two processes is admitted (the repeated line) and written by the disk writer while its
request decodes; the next process resumes a prompt that extends it from the files, and answers
with the logprobs of a cold server bit for bit (gate 1: the files hold a cold grid prefill's
rows and state). /v1/cache/stats and /metrics report the tier; a clear behind the admin token
empties it, and a file that does not verify is deleted and recomputed, never served."""

import msgspec

from tandem.config import CacheConfig, DiskConfig, SpeculationConfig, SpillConfig
from tandem.server.app import build_app
from tandem.server.keys import CACHE_STATS

HEAD = "You are a careful assistant who keeps a ledger of words. " * 30


def HEAD_IDS(loaded) -> list[int]:
    return loaded.tokenizer.encode_text(HEAD)


def _cache(resp) -> dict:
    return resp.usage.model_extra["tandem"]["cache"]


def _config(make_config, **disk):
    config = make_config(window=4096)
    return msgspec.structs.replace(
        config, speculation=SpeculationConfig(speculation="off"),
        disk=DiskConfig(disk_cache_min_free_gb=0, disk_cache_min_tokens=128, **disk),
        # The disk tier alone: the spill would bring a restarted server's conversation back.
        spill=SpillConfig(session_spill="off"))


async def _complete(server, sdk, prompt: str):
    return await sdk(server).completions.create(model="small", prompt=prompt, max_tokens=5,
                                                temperature=0, logprobs=3)


async def test_a_prompt_read_cold_twice_is_written_and_a_restart_resumes_from_the_disk(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    follow = HEAD + " Now list three more words."
    for _ in range(2):  # two processes, each reading the head cold: its lines counted twice
        async with serve(build_app(config, small_loaded)) as server:
            first = await _complete(server, sdk, HEAD)
            assert _cache(first)["source"] == "cold"
    # The second one's writes were drained at its stop; the third finds them in the folder.
    async with serve(build_app(config, small_loaded)) as server:
        disk = (await server.app[CACHE_STATS]())["tiers"]["disk"]
        assert disk["anchors"] == 1 and disk["chunks"] == len(HEAD_IDS(small_loaded)) // 64, \
            disk
        got = await _complete(server, sdk, follow)
        stats = await server.app[CACHE_STATS]()
        import aiohttp
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                metrics = await resp.text()
    assert _cache(got)["source"] == "disk" and _cache(got)["cached"] > 0
    assert stats["tiers"]["disk"]["hits"] == 1
    assert "tandem_disk_cache_hits 1.0" in metrics
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        want = await _complete(server, sdk, follow)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
    assert got.choices[0].logprobs.top_logprobs == want.choices[0].logprobs.top_logprobs


async def test_a_corrupt_file_is_deleted_and_the_prompt_recomputed_never_served(
        small_loaded, make_config, serve, sdk):
    config = _config(make_config)
    for _ in range(2):
        async with serve(build_app(config, small_loaded)) as server:
            await _complete(server, sdk, HEAD)
    files = [p for p in config.disk_cache_path().rglob("*") if p.is_file()
             and p.suffix in (".chunk", ".anchor")]
    assert files, "nothing was written"
    for path in files:  # every file: one byte flipped in its data
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    follow = HEAD + " Now list three more words."
    async with serve(build_app(config, small_loaded)) as server:
        got = await _complete(server, sdk, follow)
        stats = (await server.app[CACHE_STATS]())["tiers"]["disk"]
    assert _cache(got)["source"] == "cold"
    assert stats["failed_restores"] == 1
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        want = await _complete(server, sdk, follow)
    assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs


async def test_a_clear_behind_the_admin_token_empties_the_disk_tier(
        small_loaded, make_config, serve, sdk):
    import aiohttp

    config = msgspec.structs.replace(_config(make_config),
                                     server=msgspec.structs.replace(
                                         make_config().server, admin_token="s3cret"))
    for _ in range(2):
        async with serve(build_app(config, small_loaded)) as server:
            await _complete(server, sdk, HEAD)
    async with serve(build_app(config, small_loaded)) as server:
        url = f"http://127.0.0.1:{server.port}/v1/cache/clear"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "?tier=disk", json={}) as resp:
                assert resp.status == 401
            async with http.post(url + "?tier=disk", json={},
                                 headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200
                body = await resp.json()
            async with http.post(url + "?tier=nowhere", json={},
                                 headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] == "tier"
        stats = (await server.app[CACHE_STATS]())["tiers"]["disk"]
        got = await _complete(server, sdk, HEAD + " Now list three more words.")
    assert body["tier"] == "disk" and body["dropped"]["files"] >= 2
    assert stats["chunks"] == stats["anchors"] == 0
    assert _cache(got)["source"] == "cold"


async def test_a_new_sessions_first_chat_writes_its_head_and_another_session_after_a_restart_reads_it(
        small_loaded, make_config, serve, sdk):
    """A session's first long request writes anchors at the last lines below where its last
    user message starts (the head: the system text), read cold once; after a restart a new
    session with the same head resumes there from the disk, as a cold server answers."""
    config = _config(make_config)
    system = {"role": "system", "content": HEAD}

    async def chat(server, user, session):
        return await sdk(server).chat.completions.create(
            model="small", messages=[system, {"role": "user", "content": user}], max_tokens=5,
            temperature=0, logprobs=True, top_logprobs=2,
            extra_headers={"x-session-id": session})

    async with serve(build_app(config, small_loaded)) as server:
        first = await chat(server, "Which words are in the ledger?", "one")
    assert _cache(first)["source"] == "cold"
    async with serve(build_app(config, small_loaded)) as server:
        disk = (await server.app[CACHE_STATS]())["tiers"]["disk"]
        assert disk["anchors"] >= 1, disk
        got = await chat(server, "Name a word that is not in it.", "two")
    assert _cache(got)["source"] == "disk"
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        want = await chat(server, "Name a word that is not in it.", "two")
    assert got.choices[0].message.content == want.choices[0].message.content
    assert [t.logprob for t in got.choices[0].logprobs.content] == \
        [t.logprob for t in want.choices[0].logprobs.content]


async def test_two_folders_a_deploy_then_a_third_session_and_a_new_folder_resume_from_the_disk(
        small_loaded, make_config, serve, sdk):
    """The spec's two folders: sessions in folders A and B share a long head (the tools and the
    system text before the folder's path), then differ. Their first requests write their heads
    (the four lines below the user turn, all in the folder's text here), and B's, the second
    cold read of the shared lines, the last of them: the line where the two went on differently
    (tandem/io/admission.py: the repeated line and the branch rule both name it here; its unit
    tests hold each rule alone). After a deploy (a restart), a third session in A resumes at
    A's head, and a fourth in a new folder C at the shared line, each answering as a cold
    server does (logprobs bit for bit)."""
    config = _config(make_config)
    shared = HEAD  # about six grid lines of the test's 64-row grid

    def system(folder: str) -> dict:
        return {"role": "system",
                "content": shared + f" The working folder is /home/dev/{folder}. " * 40}

    async def chat(server, folder, user, session):
        return await sdk(server).chat.completions.create(
            model="small", messages=[system(folder), {"role": "user", "content": user}],
            max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
            extra_headers={"x-session-id": session})

    async with serve(build_app(config, small_loaded)) as server:
        await chat(server, "ledger", "List the files.", "a")
        await chat(server, "weather", "List the files.", "b")
    async with serve(build_app(config, small_loaded)) as server:  # the deploy
        third = await chat(server, "ledger", "Count the words.", "c")
        fourth = await chat(server, "garden", "Count the words.", "d")
    assert _cache(third)["source"] == "disk" and _cache(fourth)["source"] == "disk"
    # The folder's text is longer than the four head lines a session writes: only the shared
    # line, where A and B went on differently, lies in the head the fourth shares.
    assert _cache(fourth)["cached"] < _cache(third)["cached"]
    assert _cache(fourth)["cached"] <= len(HEAD_IDS(small_loaded)) + 8
    cold = msgspec.structs.replace(config, cache=CacheConfig(caches=False))
    async with serve(build_app(cold, small_loaded)) as server:
        for got, folder in ((third, "ledger"), (fourth, "garden")):
            want = await chat(server, folder, "Count the words.", "x")
            assert [t.logprob for t in got.choices[0].logprobs.content] == \
                [t.logprob for t in want.choices[0].logprobs.content], folder
