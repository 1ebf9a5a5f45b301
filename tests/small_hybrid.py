"""A small Qwen3.5-layout checkpoint (hidden 64, 4 layers) with the real Qwen tokenizer: the
embedded tiny's recipe at a size that decodes fast on two cores, with long recurrent memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.models.tiny import TINY_CONFIG, _weights
from tandem.models.tokenizer import write_qwen_tokenizer

SMALL_CONFIG = dict(
    TINY_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=16,
    linear_key_head_dim=16, linear_value_head_dim=16)


def _long_memory(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A_log and dt_bias redrawn so that the median per-token decay is near 0.98 (tiny's recipe
    gives 0.07: the state forgotten within three tokens, and the greedy gate blind to a restore
    that brings back no recurrent state; issue 12, part 7)."""
    gen = torch.Generator().manual_seed(7)
    for name in sorted(weights):
        shape = weights[name].shape
        if name.endswith("A_log"):
            weights[name] = torch.log(torch.rand(shape, generator=gen) * 0.3 + 0.01)
        elif name.endswith("dt_bias"):
            weights[name] = -2.0 + torch.randn(shape, generator=gen) * 0.5
    return weights


def make_small_hybrid(path: Path, *, tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    save_file(_long_memory(_weights(SMALL_CONFIG)), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        write_qwen_tokenizer(path)
    return path


def make_small_vl(path: Path) -> Path:
    """The small hybrid with tiny's recipe of a vision tower (out to the small width) and
    tiny's image processor (an image is 16 to 256 rows), with the real Qwen tokenizer."""
    from tandem.models.tiny import (TINY_IMAGE_FIELDS, TINY_PREPROCESSOR, TINY_VISION_CONFIG,
                                    _vision_weights)

    vision = dict(TINY_VISION_CONFIG, out_hidden_size=SMALL_CONFIG["hidden_size"])
    config = dict(SMALL_CONFIG, **dict(TINY_IMAGE_FIELDS, vision_config=vision))
    config["rope_parameters"] = dict(SMALL_CONFIG["rope_parameters"], mrope_section=[0, 1, 1])
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(_long_memory(_weights(SMALL_CONFIG)), **_vision_weights(vision))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    write_qwen_tokenizer(path)
    return path
