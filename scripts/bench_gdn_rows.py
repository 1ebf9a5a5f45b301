"""The GDN layers' decode middle on the native kernel (csrc/gdn.c) against the torch path it
replaced (issue 14, part 4), side by side in one run on `tiny`:

- forward_batch's step at B = 1, 2, 4 with the torch middle and with the native one, alternated
  in rounds (the machine is shared and noisy: the best of each), and the aggregate tokens/s;
- one GDN layer's _gdn_rows (its in_proj, middle and out_proj) and the middle's call alone;
- the middle alone at 0.8B-like dims (16 heads of 128 x 128) on 1 and 2 threads, where its
  parallel region runs.

    .venv/bin/python scripts/bench_gdn_rows.py [--rounds 5] [--tokens 24]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tandem.kernels import decode
from tandem.models import load_model
from tandem.models.hybrid import HybridModel

NATIVE_MIDDLE = HybridModel._gdn_native


def _middle(native: bool) -> None:
    HybridModel._gdn_native = NATIVE_MIDDLE if native else (lambda self, i: None)


def _best(fn, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _steps(model: HybridModel, rounds: int, tokens: int) -> None:
    prompt = torch.randint(0, model.vocab_size, (1024,), generator=torch.Generator().manual_seed(1))
    window = 1024 + tokens + 8
    first = model.new_state(window)
    model.forward(first, prompt, 0)
    base = {k: t.clone() for k, t in first.sections.items()}
    states = [first]
    for _ in range(3):
        s = model.new_state(window)
        for k, v in first.views.items():
            s.views[k].tensor.copy_(v.tensor)
        states.append(s)
    best: dict[tuple[bool, int], float] = {}
    for _ in range(rounds):
        for native in (False, True):
            _middle(native)
            for b in (1, 2, 4):
                batch = states[:b]
                for s in batch:
                    for k, t in base.items():
                        s.sections[k].copy_(t)
                model.forward_batch(batch, [100] * b, [1024] * b)  # warm
                t0 = time.perf_counter()
                for i in range(tokens):
                    model.forward_batch(batch, [101 + i] * b, [1025 + i] * b)
                step = (time.perf_counter() - t0) / tokens
                best[native, b] = min(best.get((native, b), float("inf")), step)
    _middle(True)
    for b in (1, 2, 4):
        off, on = best[False, b], best[True, b]
        print(f"  B={b}: step {off * 1e3:.2f} ms torch middle, {on * 1e3:.2f} ms native "
              f"({off / on:.2f}x); aggregate {b / off:.1f} -> {b / on:.1f} tok/s")


def _layer(model: HybridModel, rounds: int) -> None:
    for b in (1, 4):
        states = [model.new_state(8) for _ in range(b)]
        tails = [s.sections["gdn.conv"][0] for s in states]
        recur = [s.sections["gdn.S"][0] for s in states]
        h = torch.randn(b, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        times = {}
        for native in (False, True):
            _middle(native)
            times[native] = _best(lambda: model._gdn_rows(0, h, tails, recur), 300, rounds)
        _middle(True)
        layer = model._gdn_native(0)
        a, bb, mixed, z = model._project("layers.0.linear_attn.in_proj", h)
        out = torch.empty(b, model.config.linear_num_value_heads * model.config.linear_value_head_dim)
        call = _best(lambda: layer(out, None, mixed, a, bb, z, (tails, tails), (recur, recur)),
                     300, rounds)
        print(f"  one GDN layer at B={b}: {times[False] * 1e6:.0f} us torch middle, "
              f"{times[True] * 1e6:.0f} us native ({times[False] / times[True]:.2f}x); "
              f"the native middle's call {call * 1e6:.1f} us")


def _wide(rounds: int) -> None:
    hk = hv = 16
    dk = dv = 128
    c = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(3)
    consts = (torch.randn(c, 4, generator=gen), -torch.rand(hv, generator=gen),
              torch.randn(hv, generator=gen), torch.ones(dv))
    layer = decode.GdnLayer.build(consts, (hk, hv, dk, dv), (1e-6, dk ** -0.5, 1e-6))
    threads = torch.get_num_threads()
    for b in (1, 4):
        proj = torch.randn(b, 2 * hv + c + hv * dv, generator=gen)
        a, bb, mixed, z = proj.split_with_sizes([hv, hv, c, hv * dv], 1)
        tails = list(torch.zeros(b, c, 3))
        states = list(torch.zeros(b, hv, dk, dv))
        out = torch.empty(b, hv * dv)
        got = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = _best(lambda: layer(out, None, mixed, a, bb, z, (tails, tails),
                                         (states, states)), 100, rounds)
        torch.set_num_threads(threads)
        print(f"  0.8B-like middle at B={b}: " + ", ".join(
            f"{t * 1e6:.0f} us on {n} thread{'s' if n > 1 else ''}" for n, t in got.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24, help="decode steps a round")
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    if not decode.set_native(True):
        raise SystemExit("the native kernel does not build on this machine")
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    home = Path(args.home or scratch.name)
    model = load_model("tiny", home / "models").model
    print(f"tiny, threads={torch.get_num_threads()}")
    with torch.inference_mode():
        _steps(model, args.rounds, args.tokens)
        _layer(model, args.rounds)
        _wide(args.rounds)


if __name__ == "__main__":
    main()
