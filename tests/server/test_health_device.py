"""/health names where the model runs and its weights' dtype (issue 20: on a GPU a user, and
scripts/serve_check.py, read "cuda:0" and "bfloat16" there; here the CPU's fp32)."""

import aiohttp

from tandem.server.app import build_app


async def test_health_names_the_models_device_and_dtype(small_loaded, make_config, serve):
    async with serve(build_app(make_config(), small_loaded)) as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
                assert resp.status == 200
                body = await resp.json()
    assert body["device"] == str(small_loaded.model.device) == "cpu"
    assert body["dtype"] == "float32"
    assert body["status"] == "ok" and body["model"] == "small"
