"""The rotary embedding's frequencies from a config's ``rope_parameters`` (or the older
``rope_scaling``): ``default``, ``linear`` and ``yarn`` as transformers' modeling_rope_utils
computes them; every other ``rope_type`` is refused.

Refused: ``dynamic`` (NTK) and ``longrope`` recompute the frequencies from the length of the
sequence at each call, so a row's rotation would depend on how long the prompt was when it was
computed and a cached row could not be reused; ``llama3`` and the rest are other families'.

mRoPE (``mrope_section`` in Qwen3.5's ``rope_parameters``) gives each rotary frequency one of
three position ids, temporal, height or width, interleaved as Qwen3.5 interleaves them
(``mrope_axes``). For text every token's three ids are equal (transformers expands the one text
position to all three), so the recomposed cos/sin are the 1-D ones whatever the sections: a
text row is computed by the 1-D path, and only a chunk that holds an image's rows takes the
three ids (models/vision.py).
"""

from __future__ import annotations

import math

import torch

from tandem.models.base import ModelError

ROPE_TYPES = ("default", "linear", "yarn")
# The rope_parameters keys each type reads (transformers' validators); others are ignored there.
_KEYS = {"linear": ("factor",),
         "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                  "beta_slow", "mscale", "mscale_all_dim", "truncate")}


def read_rope(cfg: dict) -> tuple[str, tuple[tuple[str, object], ...]]:
    """``(rope_type, scaling)``: the type and its parameters as sorted pairs (a frozen,
    hashable form for HybridConfig), yarn's defaults filled in as transformers fills them."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelError(f"config.json rope_parameters is {type(rope).__name__}, not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"config.json rope_parameters.rope_type {rope_type!r} is not "
                         f"implemented; the hybrid adapter computes {', '.join(ROPE_TYPES)}")
    params = {k: rope[k] for k in _KEYS.get(rope_type, ()) if rope.get(k) is not None}
    if rope_type == "linear" and "factor" not in params:
        raise ModelError("config.json rope_parameters.rope_type 'linear' needs a factor")
    if rope_type == "yarn":
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings
        # wins, else the model's max_position_embeddings.
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 32768))
        if "factor" not in params:
            params["factor"] = (cfg.get("max_position_embeddings", 32768)
                                / params["original_max_position_embeddings"])
    return rope_type, tuple(sorted(params.items()))


def inv_freq(rope_type: str, scaling: tuple[tuple[str, object], ...], theta: float,
             dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim // 2], attention_scaling)``; cos and sin are multiplied by the latter."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    p = dict(scaling)
    if rope_type == "default":
        return base, 1.0
    if rope_type == "linear":
        return base / float(p["factor"]), 1.0
    return _yarn(p, theta, dim)


def _yarn(p: dict, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' _compute_yarn_parameters: a ramp between the
    interpolated (divided by ``factor``) and the original frequencies over the dimensions whose
    wavelengths fall between ``beta_fast`` and ``beta_slow`` rotations of the original context,
    and cos/sin scaled by ``0.1 * ln(factor) + 1``."""
    factor = float(p["factor"])
    original = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


# transformers' Qwen3_5TextRotaryEmbedding default, for a config that names no sections
DEFAULT_MROPE_SECTION = (11, 11, 10)


def read_mrope_section(cfg: dict) -> tuple[int, ...]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    if section is None:
        return DEFAULT_MROPE_SECTION
    if len(section) != 3 or any(int(v) < 0 for v in section):
        raise ModelError(f"config.json rope_parameters.mrope_section {section!r} is not three "
                         f"counts (temporal, height, width)")
    return tuple(int(v) for v in section)


def mrope_axes(section: tuple[int, ...], num_freqs: int) -> torch.Tensor:
    """Which position id (0 temporal, 1 height, 2 width) turns each of the ``num_freqs``
    frequencies, as transformers' recomposition_frequencies lays them: frequency j takes height
    where j % 3 == 1 and j < 3 * section[1], width where j % 3 == 2 and j < 3 * section[2], and
    temporal everywhere else."""
    axes = torch.zeros(num_freqs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:min(3 * section[axis], num_freqs):3] = axis
    return axes
