"""Memory of a served model: what the process holds after load, after the engine is built, and
at the peak of a cold 4k prefill (a greedy request's: its first token through the head's screen),
each over the weights' bytes (issue 14, part 5 and item e).

The checkpoint is a random 0.8B-like Qwen3.5 (24 layers, hidden 1,024, fp32, tied 248k head:
3.0 GB), drawn with tiny's recipe and written once under --dir. Each measurement runs in a
fresh process so that nothing the writer allocated is counted. The model loads as `tandem
serve` loads it (tandem.models.load_model with dtype auto, the Engine with the config's
window and prefix_chunk). RSS is read from /proc/self/status: RssAnon (heap, torch's
buffers: what the governor counts), RssFile (the mapped safetensors pages) and VmHWM (the
peak, reset through /proc/self/clear_refs before the prefill), with a thread sampling RssAnon
every few milliseconds and naming the phase (layer kind) the peak fell in.

    .venv/bin/python scripts/bench_memory.py [--dir DIR] [--tokens 4096] [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20

# The 0.8B-like dims of issue 14 (Qwen3.5-0.8B's shapes), tiny's vocabulary and recipe.
SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16)


def status() -> dict[str, int]:
    """The /proc/self/status memory lines, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def write_checkpoint(path: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    from tandem.models.tiny import TINY_CONFIG, _weights

    config = dict(TINY_CONFIG, **SHAPE, num_hidden_layers=layers,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    path.mkdir(parents=True, exist_ok=True)
    weights = _weights(config)
    # One file per few layers: save_file serialises a file whole, so shards keep the writer's
    # peak near the weights plus one shard.
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights.items():
        layer = name.split("layers.")[1].split(".")[0] if "layers." in name else "top"
        key = "top" if layer == "top" else str(int(layer) // 4)
        shards.setdefault(key, {})[name] = t
    weight_map = {}
    for key, part in sorted(shards.items()):
        fname = f"model-{key}.safetensors"
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in part})
        for name in part:
            weights.pop(name)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def fix_malloc() -> None:
    """glibc's mmap threshold fixed at 64 KiB (the dynamic one climbs to 32 MiB after the first
    frees, and blocks under it stay in the heap when freed) and the heap trimmed at 64 KiB."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 << 10)  # M_TRIM_THRESHOLD


def measure(path: Path, tokens: int, window: int | None, chunk: int | None,
            threads: int, attribute: bool) -> dict:
    import torch

    if attribute:
        fix_malloc()

    from tandem.config import load_config
    from tandem.engine import Engine, run_steps
    from tandem.models.base import HeadRow
    from tandem.models import load_model

    if threads:
        torch.set_num_threads(threads)
    out: dict = {"start": status()}
    config = load_config(cli_args={"home": str(path.parent / "home")})
    e = config.engine
    window = window or e.window
    chunk = chunk or e.prefix_chunk
    loaded = load_model(str(path), config.models_dir(), e.dtype)
    model = loaded.model
    out["load"] = status()
    held = {t.untyped_storage().data_ptr(): t for t in model.w.values()}.values()
    out["weights_nbytes"] = sum(t.numel() * t.element_size() for t in held)
    engine = Engine(model, window=window, prefix_chunk=chunk, num_threads=e.num_threads)
    out["engine"] = status()
    cost = engine.cost()
    out["cost"] = {"workspace": cost.workspace_nbytes(tokens),
                   "rows": cost.row_nbytes * window, "row_nbytes": cost.row_nbytes,
                   "state": cost.state_nbytes}
    out["window"], out["chunk"], out["tokens"] = window, chunk, tokens

    # The phase the sampler names: the layer kind running, wrapped around the model's methods.
    # With --attribute each call also resets VmHWM at entry and records its own peak of
    # anonymous memory over what was held at entry (malloc's thresholds fixed first, so that a
    # freed temporary goes back to the OS at once and RSS follows the live bytes).
    phase = ["other"]
    own: dict[str, int] = {}
    for name in ("_gdn", "_attention", "_mlp", "forward"):
        inner = getattr(model, name)

        def wrapped(*args, _inner=inner, _name=name.lstrip("_"), **kwargs):
            before, phase[0] = phase[0], _name
            if attribute:
                entry = status()
                reset_peak()
            try:
                return _inner(*args, **kwargs)
            finally:
                phase[0] = before
                if attribute:
                    now = status()
                    grew = now["VmHWM"] - entry["VmRSS"] - (now["RssFile"] - entry["RssFile"])
                    own[_name] = max(own.get(_name, 0), grew)
        setattr(model, name, wrapped)
    peaks: dict[str, int] = {}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            anon = status()["RssAnon"]
            where = phase[0]
            peaks[where] = max(peaks.get(where, 0), anon)
            time.sleep(0.002)

    ids = torch.randint(0, 248_000, (tokens,), generator=torch.Generator().manual_seed(1))
    before = status()
    out["peak_reset"] = reset_peak()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    # as a greedy request's prefill: the last position's row, its token through the head's
    # screen (the logits, and the head's mapped pages, only for a request that reads them)
    last = run_steps(engine.prefill_steps(ids.tolist(), row=True))
    if isinstance(last, HeadRow):
        chosen = last.choose()
        out["first_token"] = chosen.token if chosen is not None else None
    out["prefill_s"] = time.perf_counter() - t0
    stop.set()
    sampler.join()
    out["before_prefill"] = before
    out["after_prefill"] = status()
    out["phase_peak_anon"] = peaks
    out["phase_own_peak"] = own
    return out


def report(r: dict) -> None:
    w = r["weights_nbytes"]
    print(f"weights {w / 1e9:.3f} GB ({w / MiB:.0f} MiB); window {r['window']}, chunk "
          f"{r['chunk']}, prefill {r['tokens']} tokens in {r['prefill_s']:.1f} s")
    print(f"{'point':16s} {'RSS MiB':>9s} {'anon MiB':>9s} {'file MiB':>9s} {'RSS/weights':>12s}")
    for key in ("start", "load", "engine", "before_prefill", "after_prefill"):
        s = r[key]
        print(f"{key:16s} {s['VmRSS'] / MiB:9.0f} {s['RssAnon'] / MiB:9.0f} "
              f"{s['RssFile'] / MiB:9.0f} {s['VmRSS'] / w:12.3f}")
    peak = r["after_prefill"]["VmHWM"]
    anon_peak = max(r["phase_peak_anon"].values())
    base = r["before_prefill"]["RssAnon"]
    print(f"peak RSS during the prefill (VmHWM{'' if r['peak_reset'] else ', not reset'}): "
          f"{peak / MiB:.0f} MiB = {peak / w:.3f} x the weights' bytes")
    rows = r["cost"]["row_nbytes"] * r["tokens"]
    print(f"peak anon during the prefill (sampled): {anon_peak / MiB:.0f} MiB, "
          f"{(anon_peak - base) / MiB:.0f} MiB over before it: the rows written "
          f"{rows / MiB:.0f} MiB and a workspace of {(anon_peak - base - rows) / MiB:.0f} MiB "
          f"against cost().workspace_nbytes({r['tokens']}) = {r['cost']['workspace'] / MiB:.0f} MiB")
    print("  by phase (anon peak over before the prefill, MiB): " + ", ".join(
        f"{k} {(v - base) / MiB:.0f}" for k, v in sorted(r["phase_peak_anon"].items())))
    print(f"K/V rows: {r['cost']['row_nbytes']} bytes a token, the window's "
          f"{r['cost']['rows'] / MiB:.0f} MiB; engine built: anon "
          f"{(r['engine']['RssAnon'] - r['load']['RssAnon']) / MiB:+.0f} MiB")
    if r["phase_own_peak"]:
        print("  each call's own anon peak over its entry, the most over the calls (MiB): "
              + ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(r["phase_own_peak"].items())))
    print(f"anon at start (after the engine is built): {r['engine']['RssAnon'] / MiB:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.expanduser("~/.cache/tandem-bench/q35-0.8b-like"))
    ap.add_argument("--layers", type=int, default=24, help="a multiple of 4")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=0, help="0: the config's (tandem serve's)")
    ap.add_argument("--prefix-chunk", type=int, default=0, help="0: the config's")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--attribute", action="store_true",
                    help="each layer call's own peak (malloc's thresholds fixed; VmHWM reset a call)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_write", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = Path(args.dir) if args.layers == 24 else Path(f"{args.dir}-{args.layers}l")
    if args._write:
        write_checkpoint(path, args.layers)
        return
    if args._measure:
        print(json.dumps(measure(path, args.tokens, args.window or None,
                                 args.prefix_chunk or None, args.threads, args.attribute)))
        return
    me = [sys.executable, __file__, "--dir", args.dir, "--layers", str(args.layers)]
    if not (path / "model.safetensors.index.json").is_file():
        print(f"writing the checkpoint to {path}", file=sys.stderr)
        subprocess.run(me + ["--_write"], check=True)
    proc = subprocess.run(me + ["--_measure", "--tokens", str(args.tokens), "--window",
                                str(args.window), "--prefix-chunk", str(args.prefix_chunk),
                                "--threads", str(args.threads)]
                          + (["--attribute"] if args.attribute else []),
                          check=True, stdout=subprocess.PIPE, text=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
