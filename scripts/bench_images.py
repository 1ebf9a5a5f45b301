"""Images in a prompt (issue 19): preprocessing and tower time per image, and an Open WebUI-shaped
chat that resends its image every turn, with the caches on against off, side by side in one run.

1. Per image size: the image processor's time (decode, resize, patches, digest) and the vision
   tower's (its rows), the median of ``--reps`` runs each, on this process's threads.
2. A chat of ``--turns`` turns whose first user message carries the same image every turn (as
   Open WebUI sends it), thinking off, ``--max-tokens`` a turn, through an in-process server:
   once with the caches on (the resident prefix, the tower's cache) and once with them off
   (``caches`` false and ``image_cache_mb`` 0: the engine alone, which still goes on over the
   rows in place when a prompt extends them). Each turn's TTFT (streamed: the first content
   chunk), cached tokens and tower runs (the journal's). With ``--between`` (on by default)
   another user's text chat takes the only slot (``parallel`` 1) between two turns, as a second
   conversation on a shared server does: then the engine alone has lost the image's rows at every
   turn, and the caches (the park, the tower's cache) are what brings them back.

Absolute times on a shared machine mean little; on against off, turn by turn, is the figure.

    .venv/bin/python scripts/bench_images.py [--turns 6] [--sizes 256x256,640x480,1024x768]
        [tandem config flags: --model tiny --prefix-chunk ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_setup import bench_config  # noqa: E402

from tandem.models import image_processor as ip  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.state import STATE  # noqa: E402

SYSTEM = "You look at pictures and answer in a sentence or two. " * 20


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    rng.integers(0, 256, (height, width))], axis=-1).astype(np.uint8)
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def per_image(loaded: Any, sizes: list[tuple[int, int]], reps: int) -> list[dict]:
    import torch

    support = loaded.model.images
    rows = []
    for width, height in sizes:
        data = png(width, height)
        pre_ms, tower_ms = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            pre = ip.preprocess_bytes(data, support.processor)
            pre.digest()
            t1 = time.perf_counter()
            with torch.inference_mode():
                support.tower.encode(pre.pixel_values, pre.grid)
            t2 = time.perf_counter()
            pre_ms.append((t1 - t0) * 1000)
            tower_ms.append((t2 - t1) * 1000)
        rows.append({"size": f"{width}x{height}", "tokens": pre.num_tokens,
                     "preprocess_ms": statistics.median(pre_ms),
                     "tower_ms": statistics.median(tower_ms)})
    return rows


OTHER = [{"role": "user", "content": "Summarise the plot of a long novel for me. " * 30}]


async def chat(config: Any, loaded: Any, image: bytes, turns: int, max_tokens: int,
               between: bool = False) -> list[dict]:
    import aiohttp
    from aiohttp.test_utils import TestServer

    app = build_app(config, loaded)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this picture?"}]}]
    out = []
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
            for turn in range(turns):
                body = {"model": loaded.name, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True},
                        "chat_template_kwargs": {"enable_thinking": False}}
                t0 = time.perf_counter()
                ttft, text, usage = None, "", None
                async with http.post("/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        raise SystemExit(f"turn {turn}: {resp.status} {await resp.text()}")
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        doc = msgspec.json.decode(line[6:])
                        if doc.get("usage"):
                            usage = doc["usage"]
                        for choice in doc.get("choices") or ():
                            piece = choice["delta"].get("content")
                            if piece and ttft is None:
                                ttft = (time.perf_counter() - t0) * 1000
                            text += piece or ""
                row = app[STATE].journal.tail(1)[-1]
                images = (row.get("extra") or {}).get("images") or {}
                out.append({"turn": turn, "prompt": usage["prompt_tokens"],
                            "cached": usage["prompt_tokens_details"]["cached_tokens"],
                            "ttft_ms": ttft if ttft is not None else float("nan"),
                            "tower_runs": images.get("tower_runs", 0)})
                messages = messages + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": f"And then? ({turn})"}]
                if between:
                    other = {"model": loaded.name, "messages": OTHER, "max_tokens": 2,
                             "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
                    async with http.post("/v1/chat/completions", json=other) as resp:
                        if resp.status != 200:
                            raise SystemExit(f"the other chat: {resp.status}")
    finally:
        await server.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5, help="runs of each image's timing")
    parser.add_argument("--sizes", default="256x256,640x480,1024x768")
    parser.add_argument("--chat-size", default="640x480", help="the chat's image")
    parser.add_argument("--between", action=argparse.BooleanOptionalAction, default=True,
                        help="another user's chat takes the only slot between two turns")
    args, config, loaded = bench_config(parser)
    if getattr(loaded.model, "images", None) is None:
        raise SystemExit(f"{loaded.name} has no vision tower")
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    image = png(*(int(v) for v in args.chat_size.split("x")), seed=1)
    rows = per_image(loaded, sizes, args.reps)
    print(f"model {loaded.name}, tower {loaded.model.images.describe()}\n")
    print("| image | rows | preprocess ms | tower ms |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['tokens']} | {r['preprocess_ms']:.1f} | "
              f"{r['tower_ms']:.1f} |")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-images-") as home:
        for name, caches, mb in (("on", True, 512.0), ("off", False, 0.0)):
            c = msgspec.structs.replace(
                config, home=f"{home}/{name}",
                cache=msgspec.structs.replace(config.cache, caches=caches),
                images=msgspec.structs.replace(config.images, image_cache_mb=mb))
            if args.between:
                c = msgspec.structs.replace(
                    c, engine=msgspec.structs.replace(c.engine, parallel=1))
            runs[name] = asyncio.run(chat(c, loaded, image, args.turns, args.max_tokens,
                                          args.between))
    print(f"\nOpen WebUI-shaped chat, its {args.chat_size} image resent every turn, "
          f"prefix_chunk {config.engine.prefix_chunk}"
          + (", another user's chat in the only slot between turns" if args.between else "")
          + "\n")
    print("| turn | prompt | cached on | TTFT on ms | tower on | cached off | TTFT off ms "
          "| tower off |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for on, off in zip(runs["on"], runs["off"]):
        print(f"| {on['turn']} | {on['prompt']} | {on['cached']} | {on['ttft_ms']:.1f} | "
              f"{on['tower_runs']} | {off['cached']} | {off['ttft_ms']:.1f} | "
              f"{off['tower_runs']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
