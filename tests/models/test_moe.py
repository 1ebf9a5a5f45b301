"""Qwen3.5-MoE (qwen3_5_moe) against transformers, the oracle: decode logits within 1e-5 of the
largest logit at every step (sixteen steps compound two fp32 implementations' rounding: the
worst was 9.3e-6 to 1.1e-5 absolute on logits up to 3.5, on either prefill path; prefill cuts,
within 1e-5 absolute, and greedy tokens are in test_oracle.py), both expert layouts a
checkpoint ships, the model served by its model_type, and the fields it refuses. The model's
experts go through kernels.moe_experts, held to a per-expert loop bit for bit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from oracle import VOCAB, cache_kwargs, load_oracle, make_qwen3_5_moe
from tandem import kernels
from tandem.engine import Engine, SamplingParams
from tandem.kernels.naive import moe_naive
from tandem.models import load_model
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridConfig, HybridModel


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fused_copy(src, dst):
    """The checkpoint with each layer's experts fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]), as some Qwen3.5-MoE uploads ship them."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())["text_config"]
    for i in range(config["num_hidden_layers"]):
        m = f"model.language_model.layers.{i}.mlp.experts."
        per = [[weights.pop(f"{m}{e}.{part}.weight") for e in range(config["num_experts"])]
               for part in ("gate_proj", "up_proj", "down_proj")]
        weights[m + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(*per[:2])])
        weights[m + "down_proj"] = torch.stack(per[2])
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_checkpoint_is_the_shipped_layout(qwen3_5_moe_dir):
    raw = json.loads((qwen3_5_moe_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and "text_config" in raw and "vision_config" in raw
    names = load_file(str(qwen3_5_moe_dir / "model.safetensors")).keys()
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert any(name.startswith("model.visual.") for name in names)
    config = HybridModel.load(qwen3_5_moe_dir).config
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert all(config.is_moe_layer(i) for i in range(4))


def test_decode_logits_match_transformers_within_1e_5_of_their_scale_at_every_step(qwen3_5_moe_dir):
    model, oracle = HybridModel.load(qwen3_5_moe_dir), load_oracle(qwen3_5_moe_dir)
    prompt = _prompt(4, 192)
    engine = Engine(model, window=512, prefix_chunk=64)
    logits = engine.prefill(prompt)
    kw = cache_kwargs(oracle, DynamicCache(config=oracle.config))
    worst = scale = 0.0
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt]), use_cache=True, **kw).logits[0, -1]
        tokens = []
        for _ in range(16):
            worst = max(worst, (logits - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
            tok = int(torch.argmax(ref))
            tokens.append(tok)
            logits = engine.decode(tok)
            ref = oracle(torch.tensor([[tok]]), use_cache=True, **kw).logits[0, -1]
    assert len(set(tokens)) > 4, "a degenerate oracle run proves little"
    assert worst < 1e-5 * scale


def test_a_checkpoint_with_fused_experts_gives_the_same_logits(qwen3_5_moe_dir, tmp_path):
    fused = _fused_copy(qwen3_5_moe_dir, tmp_path / "fused")
    prompt = _prompt(5, 100)
    want = Engine(HybridModel.load(qwen3_5_moe_dir), window=256, prefix_chunk=64).prefill(prompt)
    got = Engine(HybridModel.load(fused), window=256, prefix_chunk=64).prefill(prompt)
    assert torch.equal(got, want)


def test_the_model_runs_its_experts_through_the_dispatch_point_and_the_loop_agrees(
        qwen3_5_moe_dir):
    model = HybridModel.load(qwen3_5_moe_dir)
    prompt = _prompt(6, 130)
    grouped = Engine(model, window=256, prefix_chunk=64)
    want = [grouped.prefill(prompt), grouped.decode(3), grouped.decode(4)]
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return moe_naive(*args)

    previous = kernels.register("moe_experts", counted)
    try:
        loop = Engine(model, window=256, prefix_chunk=64)
        got = [loop.prefill(prompt), loop.decode(3), loop.decode(4)]
    finally:
        kernels.register("moe_experts", previous)
    # a call a layer for each of the 3 chunks, then for each of the 2 decode tokens; the last
    # layer's MLP of a chunk feeds its head alone: none before the last chunk, the last row
    # in it (HybridModel._layers' keep)
    assert calls == [64] * 3 + [64] * 3 + [2] * 3 + [1] + [1] * 8
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_load_model_serves_a_qwen3_5_moe_checkpoint_by_its_model_type(qwen3_5_moe_dir, tmp_path):
    loaded = load_model(str(qwen3_5_moe_dir), tmp_path)
    assert loaded.model.model_type == "qwen3_5_moe"
    engine = Engine(loaded.model, window=256, prefix_chunk=64)
    out = engine.generate(_prompt(7, 80), SamplingParams(max_tokens=8)).token_ids
    assert len(out) == 8
    assert json.loads(loaded.model.manifest()["config"])["num_experts"] == 8


def test_a_text_only_qwen3_5_moe_text_checkpoint_loads_too(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    full = make_qwen3_5_moe(tmp_path / "full", seed=3)
    text = tmp_path / "text"
    Qwen3_5MoeForCausalLM.from_pretrained(full).save_pretrained(text)
    assert json.loads((text / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    prompt = _prompt(8, 70)
    want = Engine(HybridModel.load(full), window=128, prefix_chunk=64).prefill(prompt)
    got = Engine(HybridModel.load(text), window=128, prefix_chunk=64).prefill(prompt)
    assert torch.equal(got, want)


def _raw(qwen3_5_moe_dir, **text_overrides) -> dict:
    raw = json.loads((qwen3_5_moe_dir / "config.json").read_text())
    raw["text_config"].update(text_overrides)
    return raw


@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("decoder_sparse_step", 2),
                                         ("mlp_only_layers", [1])])
def test_a_field_transformers_qwen3_5_moe_does_not_honour_is_refused_by_name(
        qwen3_5_moe_dir, field, value):
    with pytest.raises(ModelError, match=field):
        HybridConfig.from_dict(_raw(qwen3_5_moe_dir, **{field: value}))
    # the values transformers runs are accepted
    plain = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}[field]
    HybridConfig.from_dict(_raw(qwen3_5_moe_dir, **{field: plain}))


def test_a_top_k_above_the_experts_is_refused(qwen3_5_moe_dir):
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        HybridConfig.from_dict(_raw(qwen3_5_moe_dir, num_experts_per_tok=9))


def test_a_missing_expert_tensor_is_named(qwen3_5_moe_dir, tmp_path):
    broken = shutil.copytree(qwen3_5_moe_dir, tmp_path / "broken")
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        HybridModel.load(broken)


def test_each_experts_tensors_are_freed_as_they_are_stacked(qwen3_5_moe_dir):
    import gc
    import weakref

    # the loader's dict: the language model's tensors under the model's names
    weights = {name.removeprefix("model.language_model."): t
               for name, t in load_file(str(qwen3_5_moe_dir / "model.safetensors")).items()
               if not name.startswith("model.visual.")}
    expert = weakref.ref(weights["layers.1.mlp.experts.3.gate_proj.weight"])
    model = HybridModel(HybridModel.load(qwen3_5_moe_dir).config, weights)
    gc.collect()
    assert expert() is None  # the loader's dict no longer holds it
    assert model.w["layers.1.mlp.experts.gate_up_proj"].shape == (8, 96, 64)
