"""The off-grid sequence through the HTTP server (prefix_chunk 64): a 130-token prompt answered
with one token (nothing generated is forwarded), then 220 tokens extending it, resumed at 130,
off the grid. Taint marks row 130, so the anchor at line 192 that prefill took is served under
the greedy gate, the state store keeps no prefix snapshot there, and a grid anchor at or below
taint is still a cold prefill's (taint unset again after that resume)."""

import aiohttp

from tandem.config import CacheConfig, Config, EngineConfig
from tandem.server.app import build_app

P1 = list(range(1000, 1130))
P2 = P1 + list(range(2000, 2090))


async def test_a_resume_off_the_grid_marks_taint_and_keeps_no_bit_exact_copy_above_it(
        small_loaded, serve, sdk, tmp_path):
    cfg = Config(home=str(tmp_path / "home"), engine=EngineConfig(window=512, prefix_chunk=64,
                                                                   parallel=1),
                 cache=CacheConfig(resident_park_gb=0))  # no park: the store is the only copy
    async with serve(build_app(cfg, small_loaded)) as server, aiohttp.ClientSession() as http:
        client = sdk(server)

        async def send(ids):
            resp = await client.completions.create(model="small", prompt=ids, max_tokens=1,
                                                   temperature=0)
            async with http.get(f"http://127.0.0.1:{server.port}/v1/cache/stats") as got:
                tiers = (await got.json())["tiers"]
            return resp.usage.model_extra["tandem"]["cache"], tiers

        cache, tiers = await send(P1)
        assert cache["source"] == "cold" and tiers["resident"]["taint"] is None
        cache, tiers = await send(P2)
        assert (cache["source"], cache["cached"]) == ("end", 130)
        assert tiers["resident"]["taint"] == 130
        assert tiers["resident"]["anchors"] == [64, 128, 192]
        assert tiers["store"]["prefix_puts"] == 1  # line 128 only: 192 is above taint

        cache, tiers = await send(P2[:200] + list(range(4000, 4060)))
        assert (cache["source"], cache["cached"]) == ("resident", 192)
        assert tiers["resident"]["taint"] == 130  # the anchor at 192 holds the greedy gate
        cache, tiers = await send(P2[:129] + list(range(5000, 5040)))
        assert (cache["source"], cache["cached"]) == ("resident", 128)
        assert tiers["resident"]["taint"] is None  # at or below taint: a cold prefill's

        # The rows in place go to another prompt; the store then has no snapshot at 192 to
        # pass for a cold prefill's, only the first prompt's session at its end.
        await send(list(range(3000, 3200)))
        cache, tiers = await send(P2[:200] + list(range(6000, 6020)))
        assert (cache["source"], cache["cached"]) == ("store", 130)
        assert tiers["resident"]["taint"] == 130
