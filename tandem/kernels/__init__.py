"""One dispatch point for the ops a model calls.

A model calls ``kernels.causal_conv1d`` and friends, never a backend directly, so a Triton version
can register itself under the same name (for the device it supports) without a change in the
model. The pure-torch references in ``reference.py`` are the default everywhere.

A CUDA tensor takes the op registered for CUDA (``register_cuda``: the Triton kernels in
``triton_gdn``, ``triton_conv`` and ``triton_spill``, registered at import where torch sees a GPU
and triton imports); every other tensor, and a CUDA one with nothing registered, takes ``_OPS``,
so the CPU path runs the references bit for bit as before. Triton is never needed on a CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.kernels import decode, reference

_OPS: dict[str, Callable] = {
    "causal_conv1d": reference.causal_conv1d,
    "causal_conv1d_step": reference.causal_conv1d_step,
    "chunk_gated_delta_rule": reference.chunk_gated_delta_rule,
    "recurrent_gated_delta_step": reference.recurrent_gated_delta_step,
    "recurrent_gated_delta_block": reference.recurrent_gated_delta_block,
    "moe_experts": reference.moe_experts,
    "rows_linear": decode.rows_linear,
    "causal_conv1d_rows": decode.causal_conv1d_rows,
    "recurrent_gated_delta_rows": decode.recurrent_gated_delta_rows,
}


# Ops registered for CUDA tensors; the names are _OPS's, plus the spill's byte moves
# (planes.py, blocksums.py), which look theirs up with ``cuda_op``.
CUDA_ONLY_OPS = ("cut_planes_bytes", "join_planes_bytes", "block_sums_of_bytes")
_CUDA_OPS: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> Callable:
    """Replace an op; returns the previous one so a test can put it back."""
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known: {sorted(_OPS)}")
    previous, _OPS[name] = _OPS[name], fn
    return previous


def register_cuda(name: str, fn: Callable | None) -> Callable | None:
    """Set (or with None remove) the op a CUDA tensor takes; returns the previous one."""
    if name not in _OPS and name not in CUDA_ONLY_OPS:
        raise KeyError(f"unknown op {name!r}; known: {sorted(_OPS) + list(CUDA_ONLY_OPS)}")
    previous = _CUDA_OPS.pop(name, None)
    if fn is not None:
        _CUDA_OPS[name] = fn
    return previous


def implementation(name: str) -> Callable:
    return _OPS[name]


def cuda_op(name: str) -> Callable | None:
    return _CUDA_OPS.get(name)


# rows_linear and moe_experts skip _op: no kernel of ours replaces them (a GPU's matmuls are
# torch's), and decode calls rows_linear hundreds of times a token.
def _op(name: str, x) -> Callable:
    if x.is_cuda:
        fn = _CUDA_OPS.get(name)
        if fn is not None:
            return fn
    return _OPS[name]


def causal_conv1d(x, tail, weight):
    return _op("causal_conv1d", x)(x, tail, weight)


def causal_conv1d_step(x, tail, weight):
    return _op("causal_conv1d_step", x)(x, tail, weight)


def chunk_gated_delta_rule(q, k, v, g, beta, state):
    return _op("chunk_gated_delta_rule", q)(q, k, v, g, beta, state)


def recurrent_gated_delta_step(q, k, v, g, beta, state):
    return _op("recurrent_gated_delta_step", q)(q, k, v, g, beta, state)


def recurrent_gated_delta_block(q, k, v, g, beta, state):
    return _op("recurrent_gated_delta_block", q)(q, k, v, g, beta, state)


def moe_experts(x, gate_up, down, top_w, top_i):
    return _OPS["moe_experts"](x, gate_up, down, top_w, top_i)


def rows_linear(x, weight, weight_t=None):
    return _OPS["rows_linear"](x, weight, weight_t)


def causal_conv1d_rows(x, tails, weight):
    return _op("causal_conv1d_rows", x)(x, tails, weight)


def recurrent_gated_delta_rows(q, k, v, decay, beta, states):
    return _op("recurrent_gated_delta_rows", q)(q, k, v, decay, beta, states)


def _register_triton() -> None:
    """The Triton kernels for CUDA tensors, where there is a GPU and triton imports."""
    if not torch.cuda.is_available():
        return
    try:
        from tandem.kernels import triton_conv, triton_gdn, triton_spill
    except ImportError:  # triton absent: CUDA tensors run the references
        return
    for module in (triton_conv, triton_gdn, triton_spill):
        for name, fn in module.CUDA_OPS.items():
            register_cuda(name, fn)


_register_triton()
