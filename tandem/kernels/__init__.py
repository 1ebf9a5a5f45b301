"""One dispatch point for the ops a model calls.

A model calls ``kernels.causal_conv1d`` and friends, never a backend directly, so a Triton version
can register itself under the same name (for the device it supports) without a change in the
model. The pure-torch references in ``reference.py`` are the default everywhere.
"""

from __future__ import annotations

from typing import Callable

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


def register(name: str, fn: Callable) -> Callable:
    """Replace an op; returns the previous one so a test can put it back."""
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known: {sorted(_OPS)}")
    previous, _OPS[name] = _OPS[name], fn
    return previous


def implementation(name: str) -> Callable:
    return _OPS[name]


def causal_conv1d(x, tail, weight):
    return _OPS["causal_conv1d"](x, tail, weight)


def causal_conv1d_step(x, tail, weight):
    return _OPS["causal_conv1d_step"](x, tail, weight)


def chunk_gated_delta_rule(q, k, v, g, beta, state):
    return _OPS["chunk_gated_delta_rule"](q, k, v, g, beta, state)


def recurrent_gated_delta_step(q, k, v, g, beta, state):
    return _OPS["recurrent_gated_delta_step"](q, k, v, g, beta, state)


def recurrent_gated_delta_block(q, k, v, g, beta, state):
    return _OPS["recurrent_gated_delta_block"](q, k, v, g, beta, state)


def moe_experts(x, gate_up, down, top_w, top_i):
    return _OPS["moe_experts"](x, gate_up, down, top_w, top_i)


def rows_linear(x, weight, weight_t=None):
    return _OPS["rows_linear"](x, weight, weight_t)


def causal_conv1d_rows(x, tails, weight):
    return _OPS["causal_conv1d_rows"](x, tails, weight)


def recurrent_gated_delta_rows(q, k, v, decay, beta, states):
    return _OPS["recurrent_gated_delta_rows"](q, k, v, decay, beta, states)
