"""A small Qwen3.5-layout checkpoint (hidden 64, 4 layers) with the real Qwen tokenizer: the
embedded tiny's recipe at a size that decodes fast on two cores."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from tandem.models.tiny import TINY_CONFIG, _weights
from tandem.models.tokenizer import write_qwen_tokenizer

SMALL_CONFIG = dict(
    TINY_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=16,
    linear_key_head_dim=16, linear_value_head_dim=16)


def make_small_hybrid(path: Path, *, tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    save_file(_weights(SMALL_CONFIG), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        write_qwen_tokenizer(path)
    return path
