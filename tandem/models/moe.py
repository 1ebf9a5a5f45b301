"""Sparse mixture-of-experts blocks: Qwen3-Next's and Qwen3.5-MoE's (the 35B-A3B / 122B / 397B).

Both are transformers' SparseMoeBlock: a softmax router over E experts keeps the top k (their
weights renormalised to sum to 1), each a SwiGLU MLP, and a shared expert behind a sigmoid gate
is added for every token. A layer's routed experts are two stacked tensors,
``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]: transformers' layout in
memory and that of checkpoints which ship them fused; a checkpoint's per-expert tensors
(``experts.{e}.gate_proj.weight``, as transformers saves them) are stacked into it at load, and
kernels.moe_experts runs them as grouped matmuls over the routed tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.models.base import ModelError

MOE_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
# transformers' defaults where a config.json leaves a field out: Qwen3NextConfig's and
# Qwen3_5MoeTextConfig's.
_DEFAULTS = {
    "qwen3_next": dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512),
    "qwen3_5_moe": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512),
}
# What transformers' Qwen3.5-MoE does without a field for it: every layer sparse, the top k
# always renormalised. A config asking otherwise would run here unlike where it was trained.
_QWEN3_5_FIXED = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def config_fields(model_type: str, cfg: dict) -> dict:
    """The HybridConfig fields of a model's experts; none for a dense model."""
    if model_type not in MOE_TYPES:
        return {}
    defaults = _DEFAULTS["qwen3_next" if model_type == "qwen3_next" else "qwen3_5_moe"]
    fields = {name: int(cfg.get(name, default)) for name, default in defaults.items()}
    if model_type == "qwen3_next":
        fields.update(decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                      mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
    else:
        for name, fixed in _QWEN3_5_FIXED.items():
            value = cfg.get(name)
            if value is not None and value != fixed:
                raise ModelError(f"config.json sets {name}={value!r}; a {model_type} model runs "
                                 f"{name}={fixed!r} (as transformers does), so this checkpoint "
                                 f"is refused rather than run as it was not trained")
    if not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ModelError(f"num_experts_per_tok {fields['num_experts_per_tok']} is not between 1 "
                         f"and num_experts {fields['num_experts']}")
    return fields


def expected_shapes(m: str, c) -> dict[str, tuple[int, ...]]:
    """The tensors of the MoE block under prefix ``m`` (``layers.{i}.mlp.``), as held."""
    h, e, i, si = (c.hidden_size, c.num_experts, c.moe_intermediate_size,
                   c.shared_expert_intermediate_size)
    return {
        m + "gate.weight": (e, h),
        m + "experts.gate_up_proj": (e, 2 * i, h),
        m + "experts.down_proj": (e, h, i),
        m + "shared_expert.gate_proj.weight": (si, h),
        m + "shared_expert.up_proj.weight": (si, h),
        m + "shared_expert.down_proj.weight": (h, si),
        m + "shared_expert_gate.weight": (1, h),
    }


def fuse_experts(weights: dict[str, torch.Tensor], m: str, c, dtype: torch.dtype) -> None:
    """Stack the per-expert tensors under ``m`` into ``experts.gate_up_proj`` and
    ``experts.down_proj``, in place, in ``dtype``; a checkpoint that ships them fused is left as
    it is. Each expert's tensors leave ``weights`` as they are copied in, so the stacks cost about
    one more copy of one layer's experts, not of the model's."""
    if m + "experts.gate_up_proj" in weights or m + "experts.0.gate_proj.weight" not in weights:
        return  # fused already, or nothing to stack: the shape check names what is missing
    h, i = c.hidden_size, c.moe_intermediate_size
    device = weights[m + "experts.0.gate_proj.weight"].device  # the stacks where the parts are
    gate_up = torch.empty((c.num_experts, 2 * i, h), dtype=dtype, device=device)
    down = torch.empty((c.num_experts, h, i), dtype=dtype, device=device)
    for e in range(c.num_experts):
        for part, dst in (("gate_proj", gate_up[e, :i]), ("up_proj", gate_up[e, i:]),
                          ("down_proj", down[e])):
            name = f"{m}experts.{e}.{part}.weight"
            t = weights.pop(name, None)
            if t is None:
                raise ModelError(f"checkpoint lacks tensor {name!r}")
            if t.shape != dst.shape:
                raise ModelError(f"tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(t)
    weights[m + "experts.gate_up_proj"] = gate_up
    weights[m + "experts.down_proj"] = down


def route(h: torch.Tensor, router: torch.Tensor, top_k: int,
          renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_w [T, k] in h's dtype, top_i [T, k]): softmax in fp32 over the router's logits, the
    top k, renormalised to sum to 1 where the model does (transformers' TopKRouter)."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(h.dtype), top_i


def sparse_moe(h: torch.Tensor, w: dict[str, torch.Tensor], m: str, c) -> torch.Tensor:
    """The MoE block under prefix ``m`` on h [T, H]: routed experts plus the gated shared one."""
    top_w, top_i = route(h, w[m + "gate.weight"], c.num_experts_per_tok, c.norm_topk_prob)
    out = kernels.moe_experts(h, w[m + "experts.gate_up_proj"], w[m + "experts.down_proj"],
                              top_w, top_i)
    s = m + "shared_expert."
    shared = F.linear(F.silu(F.linear(h, w[s + "gate_proj.weight"]))
                      * F.linear(h, w[s + "up_proj.weight"]), w[s + "down_proj.weight"])
    return out + torch.sigmoid(F.linear(h, w[m + "shared_expert_gate.weight"])) * shared
