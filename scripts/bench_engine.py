"""Engine speed, tandem against transformers side by side on the same checkpoint in one run.

Prints prefill tokens/s at each length and decode tokens/s, for tandem and for transformers
(on a GPU with flash-linear-attention's kernels where fla is installed: transformers picks them
itself), and tandem's speed over transformers' (at least 1.0 is the aim). On a GPU the decode
row also gives the bound: the weights' bytes over the device's read rate (measured here, a copy
of 1 GiB), as tokens a second, and tandem's share of it. transformers is a test dependency:
`bash scripts/install.sh --test` brings it.

    .venv/bin/python scripts/bench_engine.py [--model tiny|DIR] [--device auto|cpu|cuda]
        [--lengths 1024,8192,32768] [--oracle-max N] [--decode-tokens 64] [--json PATH]

``--cuda-graphs`` (auto) is the knob's: tandem's decode on CUDA replays its graphs. ``--json``
writes the rows for scripts/device_check.sh's table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time

import torch

from tandem.config import load_config
from tandem.devices import resolve_device
from tandem.engine import Engine
from tandem.models import load_model


def _prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_rate(device: torch.device) -> float | None:
    """Bytes a second the device reads: a 1 GiB copy reads and writes it once."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    _sync(device)
    rate = 2 * 5 * a.numel() / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return rate


def _oracle(path, dtype: torch.dtype, device: torch.device):
    """transformers on the same checkpoint, dtype and device (None without transformers), and
    whether it runs flash-linear-attention's kernels."""
    if device.type != "cuda":
        # fla's kernels want a GPU; transformers would take them wherever fla imports
        sys.modules.setdefault("fla", None)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, False
    try:
        import fla  # noqa: F401

        fla_on = True
    except ImportError:
        fla_on = False
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, fla_on


def _oracle_decode(oracle, prompt: list[int], steps: int, device: torch.device) -> float:
    from transformers import DynamicCache

    # transformers renamed past_key_values to cache (5.17, the lent GPU machines' image, takes
    # the old name); a name the forward lacks goes into its **kwargs, and every step would run
    # without the cache
    params = inspect.signature(oracle.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    kw = {name: DynamicCache(config=oracle.config)}
    with torch.inference_mode():
        out = oracle(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1,
                     **kw)
        token = out.logits[0, -1].argmax().view(1, 1)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = oracle(token, use_cache=True, **kw)
            token = out.logits[0, -1].argmax().view(1, 1)
        _sync(device)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--oracle-max", type=int, default=None,
                    help="longest prompt also run through transformers (default: 8192 on a "
                         "CPU, where it is slow, every length on a GPU)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--home", default=None)
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    device = resolve_device(args.device)
    oracle_max = args.oracle_max if args.oracle_max is not None else (
        max(lengths) if device.type == "cuda" else 8192)
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-")  # removed when the run ends
    home = args.home or scratch.name
    config = load_config(cli_args={"home": home})
    loaded = load_model(args.model, config.models_dir(), args.dtype, device, args.cuda_graphs)
    model = loaded.model
    vocab = model.vocab_size
    oracle, fla_on = _oracle(loaded.path, model.dtype, device)
    nbytes = sum(t.numel() * t.element_size()
                 for t in {t.data_ptr(): t for t in model.w.values()}.values())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model={loaded.name} dtype={str(model.dtype).removeprefix('torch.')} device={name} "
          f"threads={torch.get_num_threads()} graphs={'on' if model.graphs else 'off'} "
          f"transformers={'fla' if fla_on else 'torch' if oracle is not None else 'absent'}")
    print(f"{'row':>14} {'tandem tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    rows: list[dict] = []
    head = {"model": loaded.name, "device": name, "dtype": str(model.dtype),
            "graphs": model.graphs is not None, "fla": fla_on, "weights_nbytes": nbytes,
            "read_rate_bytes_s": None}

    def row(what: str, ours: float, theirs: float | None, **extra) -> None:
        ratio = ours / theirs if theirs else None
        rows.append(dict(row=what, tandem_tok_s=ours, transformers_tok_s=theirs, ratio=ratio,
                         **extra))
        if args.json:  # after every row: a run cut short by a timeout still leaves its rows
            with open(args.json, "w") as f:
                json.dump(dict(head, rows=rows), f)
        print(f"{what:>14} {ours:13.0f} {theirs or 0:19.0f} "
              f"{ratio if ratio is not None else float('nan'):6.2f}"
              + "".join(f" {k}={v}" for k, v in extra.items()), flush=True)

    window = max(lengths + [1024]) + args.decode_tokens + 8
    engine = Engine(model, window=window, prefix_chunk=config.engine.prefix_chunk)
    engine.prefill(_prompt(min(lengths), vocab))  # warm: kernels compiled, allocator grown
    _sync(device)
    for n in lengths:
        engine.reset()
        prompt = _prompt(n, vocab)
        _sync(device)
        t0 = time.perf_counter()
        engine.prefill(prompt)
        _sync(device)
        ours = n / (time.perf_counter() - t0)
        theirs = None
        if oracle is not None and n <= oracle_max:
            with torch.inference_mode():
                ids = torch.tensor([prompt], device=device)
                if n == lengths[0]:
                    oracle(ids[:, :64], logits_to_keep=1)  # warm
                _sync(device)
                t0 = time.perf_counter()
                oracle(ids, logits_to_keep=1)
                _sync(device)
                theirs = n / (time.perf_counter() - t0)
        row(f"prefill {n // 1024}k" if n % 1024 == 0 else f"prefill {n}", ours, theirs)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    context = _prompt(1024, vocab)
    engine.reset()
    engine.prefill(context)
    for i in range(3):  # the graphs of this shape captured before the clock starts
        engine.decode(100 + i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.decode_tokens):
        engine.decode(200 + i)
    _sync(device)
    ours = args.decode_tokens / (time.perf_counter() - t0)
    theirs = (_oracle_decode(oracle, context, args.decode_tokens, device)
              if oracle is not None else None)
    rate = head["read_rate_bytes_s"] = _read_rate(device)
    bound = rate / nbytes if rate else None
    extra = {} if bound is None else {"bound_tok_s": round(bound), "of_bound": round(
        ours / bound, 2)}
    row("decode 1k", ours, theirs, **extra)


if __name__ == "__main__":
    main()
