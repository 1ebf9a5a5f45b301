"""A GDN layer's prefill middle (the conv, the gates, the chunked delta rule and the gated norm
between in_proj and out_proj) on the native kernel (csrc/gdn.c, ``tandem_gdn_prefill_f32``)
against the torch reference ops it replaces, side by side in one run, one layer at a time:

- `tiny` (4 heads of 32 x 32), and the 0.8B-like checkpoint (16 heads of 128 x 128) where
  scripts/bench_memory.py has written it (--big DIR);
- each path alternates with the other in rounds, the best of --rounds each (the machine is
  shared: the best is the figure least disturbed by others);
- ``--against LIB.so``: also time another build of the native library (a copy of an earlier
  ``~/.cache/tandem/native/tandem-*.so``), and check that it gives the same bits: a kernel
  change that reorders loops without touching a sum must.

    .venv/bin/python scripts/bench_gdn_prefill.py [--rows 1024] [--rounds 8] [--big DIR]
        [--against OLD.so]
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels import native
from tandem.models import load_model
from tandem.models.hybrid import gated_rms_norm

BIG = Path.home() / ".cache" / "tandem-bench" / "q35-0.8b-like"


def _reference(m, i: int, mixed, a, b, z, tail, s):
    """The layer's middle as HybridModel._gdn computes it without the native kernel."""
    c, w, p = m.config, m.w, m._gdn_dims(i)[2]
    n, hk, hv = mixed.shape[0], c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    x = kernels.causal_conv1d(mixed, tail, w[p + "conv1d.weight"][:, 0, :])
    q, k, v = torch.split(x, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"])
    o = kernels.chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(b), s)
    return gated_rms_norm(o, z, w[p + "norm.weight"], c.rms_norm_eps).reshape(n, -1)


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, argtypes in native.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, native.RESTYPES.get(name)
    return lib


def bench(spec: str, models: Path, rows: int, rounds: int, against: str | None) -> None:
    m = load_model(spec, models).model
    c = m.config
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    width = 2 * hk * dk + hv * dv
    i = next(j for j, t in enumerate(c.layer_types) if t == "linear_attention")
    gen = torch.Generator().manual_seed(0)
    mixed, a, b = (torch.randn(rows, d, generator=gen) for d in (width, hv, hv))
    z = torch.randn(rows, hv, dv, generator=gen)
    tail0 = torch.randn(width, c.linear_conv_kernel_dim - 1, generator=gen)

    ours = native._load()
    paths = {"native": ours, "reference": None}
    if against:
        paths["against"] = _library(against)
    best = dict.fromkeys(paths, float("inf"))
    outs = {}
    for _ in range(rounds):
        for name, lib in paths.items():
            tail, s = tail0.clone(), torch.zeros(hv, dk, dv)
            if lib is not None:
                native._lib = lib
                native._FUNCTIONS.clear()
            t0 = time.perf_counter()
            if lib is None:
                o = _reference(m, i, mixed, a, b, z, tail, s)
            else:
                o = m._gdn_prefill_native(i, mixed, a, b, z, tail, s)
            best[name] = min(best[name], time.perf_counter() - t0)
            outs[name] = (o, tail, s)
    native._lib = ours
    native._FUNCTIONS.clear()
    line = (f"{Path(spec).name:>14}  {hv} heads of {dk} x {dv}, {rows} rows: native "
            f"{best['native'] * 1e3:7.2f} ms, reference ops {best['reference'] * 1e3:7.2f} ms "
            f"({best['reference'] / best['native']:.2f}x)")
    if against:
        same = all(torch.equal(x, y) for x, y in zip(outs["native"], outs["against"]))
        line += (f"; {Path(against).name} {best['against'] * 1e3:.2f} ms (this build "
                 f"{best['against'] / best['native']:.2f}x it, same bits: {same})")
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--big", type=Path, default=BIG, help="the 0.8B-like checkpoint's directory")
    ap.add_argument("--against", help="another build of the native library to time beside")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not native.available():
        raise SystemExit("the native kernels are not available on this machine")
    print(f"native build: {native.flavor()}, {a.threads} threads, best of {a.rounds} rounds")
    with tempfile.TemporaryDirectory() as models:
        bench("tiny", Path(models), a.rows, a.rounds, a.against)
    if (a.big / "config.json").is_file():
        bench(str(a.big), a.big.parent, a.rows, a.rounds, a.against)
    else:
        print(f"no 0.8B-like checkpoint at {a.big} (scripts/bench_memory.py writes it)")


if __name__ == "__main__":
    main()
