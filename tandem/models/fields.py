"""The config fields that change the arithmetic and that the hybrid adapter does not compute:
refused with the field's name, never loaded to answer as a different model.

Honoured elsewhere (hybrid.HybridConfig.from_dict, rope, quant): rope_parameters / rope_scaling
(rope_type default, linear, yarn; mrope sections), partial_rotary_factor, rope_theta,
rms_norm_eps, attention_bias, tie_word_embeddings, head_dim, layer_types, the GDN sizes, the MoE
fields, quantization_config (fp8 blocks). Ignored because they change nothing at inference:
attention_dropout, initializer_range, use_cache, router_aux_loss_coef, output_router_logits,
``mtp_*`` (the multi-token-prediction head's weights are skipped at load).
"""

from __future__ import annotations

from tandem.models.base import ModelError

# hidden_act is the MLP's activation and, in transformers' GDN, the conv's and the gated norm's;
# ACT2FN maps both names to SiLU.
ACTIVATIONS = ("silu", "swish")

# Fields of other families that would change the arithmetic, with the values that change
# nothing. A Qwen3.5 / Qwen3-Next config has none of them; one that sets them is not such a model.
_NEUTRAL = {
    "use_sliding_window": (None, False),
    "mlp_bias": (None, False),
    "final_logit_softcapping": (None,),
    "attn_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),
    "clip_qkv": (None,),
}


def check_arithmetic(cfg: dict) -> None:
    """Raise a ModelError naming the first field whose value tandem would compute wrongly."""
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ModelError(f"config.json hidden_act {act!r} is not implemented; the hybrid adapter "
                         f"computes silu (the MLP, the GDN conv and its gated norm)")
    gate = cfg.get("attn_output_gate", True)
    if gate is not True:
        # q_proj then holds no gate half; transformers' Qwen3.5 / Qwen3-Next always gate.
        raise ModelError(f"config.json attn_output_gate {gate!r} is not implemented; the "
                         f"attention output is always gated (q_proj holds query and gate)")
    for key, neutral in _NEUTRAL.items():
        value = cfg.get(key)
        if value not in neutral:
            raise ModelError(f"config.json {key} {value!r} is not implemented by the hybrid "
                             f"adapter (Qwen3.5 / Qwen3-Next compute no such term)")
