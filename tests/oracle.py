"""Tiny random checkpoints made by transformers, the oracle (a test-only dependency).

Random models from ``from_config`` have trivial 1-D parameters (norm weights of zero, A_log and
dt_bias constant), so noise is added to them, or greedy decoding repeats one token and a
comparison proves little (NOTES.md); A_log and dt_bias are set for long memory (below). Weights are drawn with initializer_range 0.1: at 0.15 the
state grows sensitive enough that fp32 rounding alone moves some logits past 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
# The per-token decay exp(-exp(A_log) * softplus(a + dt_bias)): small A and a negative dt_bias
# put its median near 0.98, so the recurrent state remembers a few hundred tokens, as a trained
# model's does. With transformers' A in [0.5, 4.5] and dt_bias near 1 the median was 0.06: the
# state was forgotten within three tokens, and a restore that brought back no recurrent state
# at all still passed the greedy gate (issue 12, part 7).
LONG_A = 0.3
LONG_DT = -2.0


def _common(**overrides):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    cfg.update(overrides)
    return cfg


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * LONG_A + 0.01))
            elif name.endswith("dt_bias"):
                p.copy_(LONG_DT + torch.randn(p.shape, generator=gen) * 0.5)


def make_qwen3_5(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**_common(**overrides))
    model = Qwen3_5ForCausalLM(config).eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    return path


def make_qwen3_next(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    base = _common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                   shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True,
                   mlp_only_layers=[1])
    base.update(overrides)
    torch.manual_seed(seed)
    config = Qwen3NextConfig(**base)
    model = Qwen3NextForCausalLM(config).eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    return path


def make_qwen3_5_moe(path: Path, seed: int = 0, **overrides) -> Path:
    """A Qwen3.5-MoE checkpoint as the 35B-A3B ships: model_type qwen3_5_moe with the language
    model in text_config, its tensors under model.language_model.*, one expert's tensors apiece
    (transformers saves them so), and a vision tower beside it (temporal patch and merge 1)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = _common(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                   shared_expert_intermediate_size=64)
    del text["intermediate_size"]  # no dense layer
    text.update(overrides)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(seed)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    return path


# A multimodal Qwen3.5's ids inside VOCAB (the real ones are 248053 to 248057).
VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = 498, 499, 500, 501


def make_qwen3_5_vl(path: Path, seed: int = 0, **overrides) -> Path:
    """A Qwen3.5 checkpoint with its vision tower as the real ones ship (model_type qwen3_5,
    text_config and vision_config, ``model.visual.*`` beside ``model.language_model.*``) and its
    image processor's preprocessor_config.json: 8-pixel patches, merge 2, temporal patch 2, so
    a 64 x 64 image is 64 patches and 16 prompt rows. The rotary is 12 of 16 head dims, six
    frequencies split 2/2/2 into mRoPE's temporal, height and width sections."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    text = _common(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.75, "mrope_section": [2, 2, 2],
                                    "mrope_interleaved": True})
    text.update(overrides)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                  num_position_embeddings=36, initializer_range=0.1)
    torch.manual_seed(seed)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                             size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
                             ).save_pretrained(path)
    return path


def load_oracle(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def cache_kwargs(oracle, cache) -> dict:
    """``{keyword: cache}`` for a transformers model's forward: ``cache`` where transformers has
    renamed it (5.25 here), ``past_key_values`` before (5.17, the lent GPU machines' image). A
    keyword the forward does not name is swallowed by its ``**kwargs``, and the model would
    decode each token without its cache, so the name is read off the signature."""
    import inspect

    params = inspect.signature(oracle.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}
