"""A checkpoint's ``quantization_config``: FP8 block-scaled weights dequantized at load, every
other method refused.

FP8 block scaling (DeepSeek-V3's format, which Qwen's own ``-FP8`` checkpoints use): each
quantized ``X.weight`` is stored as ``float8_e4m3fn`` beside ``X.weight_scale_inv``, one scale a
``weight_block_size`` = ``[block_rows, block_cols]`` tile, a grid of ``ceil(rows / block_rows)``
by ``ceil(cols / block_cols)``, the last tiles partial where the shape is not a multiple. The real
weight is ``fp8.to(float32) * scale_inv`` with the scale broadcast over its tile (transformers'
finegrained_fp8 ``_dequantize_fp8_weight``, vLLM's block dequant, DeepSeek's ``weight_dequant``).

tandem dequantizes to the compute dtype at load and runs ordinary matmuls: the weights answer as
the checkpoint's authors quantized them. ``activation_scheme: dynamic`` (activations quantized
per token group at run time by an FP8 kernel) is not reproduced; the activations stay in the
compute dtype, as in transformers' ``dequantize=True`` path.

Which tensors a checkpoint quantized is read from the tensors themselves (an fp8 dtype and a
scale beside it), not from ``modules_to_not_convert`` / ``ignored_layers``: Qwen's FP8
checkpoints leave the embeddings, ``lm_head``, every norm, the GDN's ``conv1d``, ``A_log``,
``dt_bias``, ``in_proj_a`` / ``in_proj_b`` (``in_proj_ba``), the MoE router (``mlp.gate``), the
``shared_expert_gate``, the vision tower and often ``mtp.*`` in bf16, and those lists name them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.models.base import ModelError

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Fp8Blocks:
    """The one quantization tandem implements: FP8 e4m3 weights, a scale a block."""

    block_rows: int
    block_cols: int
    not_converted: tuple[str, ...] = ()  # the config's own list, for the log; tensors decide

    def describe(self) -> str:
        return f"fp8 blocks {self.block_rows}x{self.block_cols}"


def read_quantization(raw: dict) -> Fp8Blocks | None:
    """The checkpoint's quantization (``None`` for plain weights), or a ModelError that names
    the field: a method tandem does not implement must never load as if its packed integers
    were weights."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    for key in ("compression_config",):  # compressed-tensors' older spelling
        if raw.get(key) is not None or text.get(key) is not None:
            raise ModelError(f"config.json has {key}: compressed-tensors checkpoints are not "
                             f"implemented; use the bf16 or the FP8 block-scaled checkpoint")
    qc = raw.get("quantization_config") or text.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelError(f"config.json quantization_config is {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ModelError(
            f"config.json quantization_config.quant_method {method!r} is not implemented: "
            f"tandem loads unquantized checkpoints and FP8 block-scaled ones (quant_method "
            f"'fp8' with weight_block_size); use the checkpoint's bf16 or FP8 release")
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelError("config.json quantization_config.weight_block_size is missing: "
                         "per-tensor FP8 (quant_method 'fp8' without blocks) is not implemented")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelError(f"config.json quantization_config.weight_block_size {block!r} is not "
                         f"two positive integers")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelError(f"config.json quantization_config.activation_scheme {scheme!r} is not "
                         f"implemented (static activation scales); only 'dynamic' is")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelError(f"config.json quantization_config.fmt {fmt!r} is not implemented; "
                         f"only 'e4m3' is")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Blocks(block_rows=block[0], block_cols=block[1],
                     not_converted=tuple(str(s) for s in skip))


def scale_name(name: str) -> str:
    """Where a quantized tensor's scale lives: ``X.weight`` -> ``X.weight_scale_inv``, a fused
    expert tensor ``X.gate_up_proj`` -> ``X.gate_up_proj_scale_inv`` (transformers' naming)."""
    if name.endswith(".weight"):
        return name[: -len(".weight")] + SCALE_SUFFIX
    return name + "_scale_inv"


def is_scale(name: str) -> bool:
    return name.endswith("_scale_inv")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks,
               name: str) -> torch.Tensor:
    """``weight.float() * scale_inv`` broadcast over its tiles, in float32, the partial tiles
    at the ends included. The last two dims are the matrix; leading dims (fused experts) carry
    their own grids. Only the scale is expanded, over rows, never a second full-size tensor."""
    if weight.ndim < 2:
        raise ModelError(f"tensor {name!r} is a {weight.ndim}-d {weight.dtype} tensor; FP8 "
                         f"block scaling quantizes matrices only")
    rows, cols = weight.shape[-2:]
    br, bc = blocks.block_rows, blocks.block_cols
    grid = (*weight.shape[:-2], math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != grid:
        raise ModelError(f"tensor {name!r} of shape {tuple(weight.shape)} has a scale grid "
                         f"{tuple(scale_inv.shape)}; blocks of {br}x{bc} need {grid}")
    if not scale_inv.dtype.is_floating_point:
        raise ModelError(f"the scale of {name!r} is {scale_inv.dtype}, not a float")
    out = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32).repeat_interleave(br, dim=-2)[..., :rows, :]
    full = cols // bc
    if full:
        out[..., : full * bc].unflatten(-1, (full, bc)).mul_(scale[..., :full, None])
    if cols % bc:
        out[..., full * bc:].mul_(scale[..., full:])
    return out
