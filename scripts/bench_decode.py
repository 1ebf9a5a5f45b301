"""Single-stream and batched decode against the memory-bandwidth bound, on `tiny` and on a random
Qwen3.5-0.8B-like checkpoint (24 layers, hidden 1,024, fp32; issue 14, part 4).

Prints, in one run and for each model:

- the bound: numpy's matvec over every matrix a decode token reads (each GDN/attention/MLP
  projection and the head, once, in the order a token reads them), timed as one pass: the
  model's bytes at numpy's rate, in GB/s and tokens/s; and the read, torch's sum over the same
  matrices (the bytes with no arithmetic: where numpy's matvec is slower than the memory);
- decode tokens/s before (the path tandem decoded with until issue 14: the prefill path at one
  token with the conv and recurrent step kernels, a GEMV per projection), on torch's matmuls
  (the batched step at B = 1: fused projections, MKL at 2 rows), on the native kernels called
  layer by layer ("layers": tandem.kernels.native, one call for any rows, the row ops fused)
  and as one call a step ("native": tandem.kernels.step, the same kernels; where they build),
  and that step asking for greedy's token alone ("screened": the head read through its int8
  screen, tandem.kernels.screen: the same token as native's argmax), alternated in rounds,
  each over the bound (screened reads fewer bytes than the bound counts);
- aggregate tokens/s of forward_batch over B = 1, 2, 4 sequences (each its own state), and each
  over B = 1, on torch's matmuls, on the native kernels, and on them asking for greedy's
  tokens alone (the screen, up to 4 rows reading it once).

The 0.8B-like checkpoint is written once (tandem.models.tiny's recipe at those dims, 3.0 GB) to
``--dir`` and loaded as a real one is, its weights mapped from the file.

    .venv/bin/python scripts/bench_decode.py [--tokens 32] [--rounds 3] [--models tiny,0.8b]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tandem import kernels
from tandem.kernels import decode, native
from tandem.kernels import step as native_step
from tandem.models import load_model
from tandem.models.hybrid import HybridModel, rms_norm
from tandem.models.tiny import TINY_CONFIG, _weights

LIKE_08B = dict(TINY_CONFIG, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16)
LIKE_08B["layer_types"] = LIKE_08B["layer_types"] * 6


def _like_08b(path: Path) -> HybridModel:
    if not (path / "model.safetensors").is_file():
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(LIKE_08B))
        tmp = path / "model.safetensors.tmp"
        save_file(_weights(LIKE_08B), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / "model.safetensors")
    return HybridModel.load(path)


def _matrices(model: HybridModel) -> list[torch.Tensor]:
    """Every matrix a decode token reads, once: a fused projection as one."""
    c, out = model.config, []
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        key = p + ("linear_attn.in_proj" if kind == "linear_attention" else "self_attn.kqv")
        names, _, fused = model._fused[key]
        out += [fused] if fused is not None else [model.w[n] for n in names]
        out.append(model.w[p + ("linear_attn.out_proj.weight" if kind == "linear_attention"
                                else "self_attn.o_proj.weight")])
        names, _, fused = model._fused[p + "mlp.gate_up"]
        out += [fused] if fused is not None else [model.w[n] for n in names]
        out.append(model.w[p + "mlp.down_proj.weight"])
    out.append(model.w["lm_head.weight"])
    return out


def _bound(mats: list[torch.Tensor], passes: int) -> float:
    """Seconds of numpy's fastest pass of a matvec over each matrix."""
    arrays = [m.numpy() for m in mats]
    xs = [np.random.default_rng(0).standard_normal(a.shape[1], dtype=np.float32) for a in arrays]
    best = float("inf")
    for _ in range(passes + 1):
        t0 = time.perf_counter()
        for a, x in zip(arrays, xs):
            a @ x
        best = min(best, time.perf_counter() - t0)
    return best


def _read(mats: list[torch.Tensor], passes: int) -> float:
    """Seconds of the fastest pass of torch's sum over each matrix on every thread: a read of
    the same bytes with no matvec's arithmetic, a stronger bound where numpy's matvec reads
    slower than the memory does (on an EPYC host here: 11 to 18 GB/s against 30 to 36)."""
    best = float("inf")
    for _ in range(passes + 1):
        t0 = time.perf_counter()
        for m in mats:
            m.sum()
        best = min(best, time.perf_counter() - t0)
    return best


def _before(model: HybridModel, state, token: int, pos: int) -> torch.Tensor:
    """Decode as tandem did before issue 14: the layers' one-token path with the conv and the
    recurrent step, each projection its own GEMV, the head F.linear at M = 1."""
    conv = kernels.register("causal_conv1d", kernels.implementation("causal_conv1d_step"))
    rule = kernels.register("chunk_gated_delta_rule",
                            kernels.implementation("recurrent_gated_delta_step"))
    try:
        x = model._layers(state, torch.tensor([token]), pos, "prefill", None)
    finally:
        kernels.register("causal_conv1d", conv)
        kernels.register("chunk_gated_delta_rule", rule)
    last = rms_norm(x[-1:], model.w["norm.weight"], model.config.rms_norm_eps)
    return F.linear(last, model.w["lm_head.weight"]).float()[0]


def _bench(name: str, model: HybridModel, prompt_len: int, tokens: int, rounds: int) -> None:
    mats = _matrices(model)
    nbytes = sum(m.numel() * m.element_size() for m in mats)
    seconds = _bound(mats, passes=5)
    bound_tok_s, bound_gbs = 1 / seconds, nbytes / seconds / 1e9
    print(f"{name}: {nbytes / 1e6:.0f} MB of matrices a token ({len(mats)} matrices, head "
          f"{mats[-1].numel() * mats[-1].element_size() / 1e6:.0f} MB); threads="
          f"{torch.get_num_threads()}")
    print(f"  bound: numpy matvec over the same matrices, {bound_gbs:.1f} GB/s = "
          f"{bound_tok_s:.1f} tok/s")
    read_tok_s = 1 / _read(mats, passes=5)
    print(f"  read:  torch's sum over the same matrices, {read_tok_s * nbytes / 1e9:.1f} GB/s = "
          f"{read_tok_s:.1f} tok/s")
    prompt = torch.randint(0, model.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(1))
    def decoded(on_native: bool, whole: bool = True):
        def run(s, t, p):
            decode.set_native(on_native)
            native_step.set_enabled(whole)
            return model.forward(s, torch.tensor([t]), p, decode=True)
        return run

    paths = {"before": lambda s, t, p: _before(model, s, t, p), "torch": decoded(False)}
    if native.available():
        paths["layers"] = decoded(True, whole=False)
        paths["native"] = decoded(True)

        def screened(s, t, p):  # greedy's token alone, through the head's screen
            decode.set_native(True)
            native_step.set_enabled(True)
            return model.forward_batch([s], [t], [p], choose=[True])[0]
        paths["screened"] = screened
    window = prompt_len + (rounds * len(paths) + 2) * (tokens + 1) + 8  # every path a round
    with torch.inference_mode():
        state = model.new_state(window)
        model.forward(state, prompt, 0)
        base = {k: t.clone() for k, t in state.sections.items()}
        runs: dict[str, list[float]] = {label: [] for label in paths}
        pos = prompt_len
        for _ in range(rounds):
            for label, step in paths.items():
                for k, t in base.items():  # each round decodes on from the same prompt state
                    state.sections[k].copy_(t)
                step(state, 100, pos)  # warm
                t0 = time.perf_counter()
                for i in range(tokens):
                    step(state, 101 + i, pos + 1 + i)
                runs[label].append(tokens / (time.perf_counter() - t0))
                pos += tokens + 1
        for label, r in runs.items():
            best = max(r)
            print(f"  decode {label:6s}: {' '.join(f'{x:.1f}' for x in r)} tok/s; best {best:.1f}"
                  f" = {best * nbytes / 1e9:.1f} GB/s, {best / bound_tok_s:.2f} of the bound, "
                  f"{best / read_tok_s:.2f} of the read")
        last = "native" if "native" in runs else "torch"
        print(f"  {last} over before / over torch (best of each): "
              f"{max(runs[last]) / max(runs['before']):.2f}x / "
              f"{max(runs[last]) / max(runs['torch']):.2f}x")
        if "layers" in runs:
            print(f"  native (the whole step in one call) over its layers called one by one: "
                  f"{max(runs['native']) / max(runs['layers']):.2f}x")
            screen = model._native_step().screen
            print(f"  screened (greedy's token from the head's int8 screen, "
                  f"{screen.nbytes / 1e6:.0f} MB, and the rows it keeps computed exactly) over "
                  f"native: {max(runs['screened']) / max(runs['native']):.2f}x")
        native_step.set_enabled(True)
        for matmuls in (["torch", "native"] if native.available() else ["torch"]):
            decode.set_native(matmuls == "native")
            _aggregate(model, state, base, window, prompt_len, tokens, rounds, matmuls)
            if matmuls == "native":
                _aggregate(model, state, base, window, prompt_len, tokens, rounds, matmuls,
                           screened=True)


def _aggregate(model, state, base, window, prompt_len, tokens, rounds, matmuls,
               screened: bool = False) -> None:
    rates = {}
    extra = {}
    for b in (1, 2, 4):
        states = []
        for _ in range(b):  # copies of the prompt's state
            s = model.new_state(window)
            for k, v in state.views.items():
                s.views[k].tensor.copy_(v.tensor)
            states.append(s)
        best = 0.0
        for _ in range(rounds):
            for s in states:
                for k, t in base.items():
                    s.sections[k].copy_(t)
            extra = {"choose": [True] * b} if screened else {}
            model.forward_batch(states, [100] * b, [prompt_len] * b, **extra)  # warm
            t0 = time.perf_counter()
            for i in range(tokens // 2):
                model.forward_batch(states, [101 + i] * b, [prompt_len + 1 + i] * b, **extra)
            best = max(best, b * (tokens // 2) / (time.perf_counter() - t0))
        rates[b] = best
    label = f"{matmuls} matmuls" + (", greedy's tokens through the screen" if screened else "")
    print(f"  forward_batch aggregate, {label}: " + "; ".join(
        f"B={b} {r:.1f} tok/s ({r / rates[1]:.2f}x)" for b, r in rates.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="tiny,0.8b")
    ap.add_argument("--home", default=None)
    ap.add_argument("--dir", default=os.path.expanduser("~/.cache/tandem-bench/decode-0.8b-like"),
                    help="where the 0.8B-like checkpoint is written once")
    args = ap.parse_args()
    # tiny's weights (265 MB) go to a scratch folder removed when the run ends, unless --home
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")
    for which in args.models.split(","):
        if which == "tiny":
            home = Path(args.home or scratch.name)
            _bench("tiny", load_model("tiny", home / "models").model, 1024, args.tokens,
                   args.rounds)
        else:
            _bench("0.8B-like", _like_08b(Path(args.dir)), 256, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
