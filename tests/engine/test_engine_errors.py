"""Bad input raises one clear error naming the problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine import ContextOverflow, Engine, SamplingParams
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_an_unknown_model_type_is_named(qwen3_5_dir, tmp_path):
    path = _copy_checkpoint(qwen3_5_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unknown model type 'llama'"):
        HybridModel.load(path)


def test_a_missing_tensor_is_named(qwen3_5_dir, tmp_path):
    path = _copy_checkpoint(qwen3_5_dir, tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.3.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelError, match="lacks tensor 'layers.3.self_attn.k_proj.weight'"):
        HybridModel.load(path)


def test_a_misshaped_tensor_is_named_with_both_shapes(qwen3_5_dir, tmp_path):
    path = _copy_checkpoint(qwen3_5_dir, tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.linear_attn.out_proj.weight"] = torch.zeros(64, 32)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelError, match=r"out_proj.weight' has shape \(64, 32\), expected \(64, 64\)"):
        HybridModel.load(path)


def test_a_missing_config_is_named(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        HybridModel.load(tmp_path)


def test_a_prompt_longer_than_the_window_names_both_counts():
    engine = Engine(ThirdModel(), window=100, prefix_chunk=32)
    with pytest.raises(ContextOverflow, match="101 tokens and the window holds 100") as info:
        engine.generate(list(range(101)), SamplingParams(max_tokens=1))
    assert (info.value.num_tokens, info.value.window) == (101, 100)
    assert engine.length == 0


def test_generation_stops_at_the_window_with_reason_length():
    engine = Engine(ThirdModel(), window=40, prefix_chunk=16)
    result = engine.generate(list(range(30)), SamplingParams(max_tokens=100))
    assert result.finish_reason == "length"
    assert engine.length == 40


def test_sampling_parameters_out_of_range_are_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
