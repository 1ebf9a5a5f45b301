"""Every config field that changes the arithmetic: a value tandem honours matches transformers,
the oracle, within 1e-5 in fp32 (prefill logits at chunk-grid cuts); a value it refuses fails
the load with a ModelError that names the field."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import VOCAB, load_oracle, make_qwen3_5, make_qwen3_next
from tandem.engine import Engine
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridConfig, HybridModel

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
CUTS = (64, 256)


def _assert_matches_oracle(path: Path) -> None:
    model, oracle = HybridModel.load(path), load_oracle(path)
    prompt = torch.randint(0, VOCAB, (CUTS[-1],),
                           generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt])).logits[0]
    engine = Engine(model, window=512, prefix_chunk=64)
    for cut in CUTS:
        engine.reset()
        logits = engine.prefill(prompt[:cut])
        assert (logits - ref[cut - 1]).abs().max().item() < 1e-5, cut


HONOURED = {
    # the YaRN window well inside the prompt, so that the ramp and the attention factor count
    "yarn": dict(rope_parameters=dict(ROPE, rope_type="yarn", factor=4.0, partial_rotary_factor=0.5,
                                      original_max_position_embeddings=64)),
    "yarn_beta_mscale": dict(rope_parameters=dict(
        ROPE, rope_type="yarn", factor=8.0, partial_rotary_factor=1.0, beta_fast=16.0,
        beta_slow=2.0, original_max_position_embeddings=32, truncate=False)),
    "linear": dict(rope_parameters=dict(ROPE, rope_type="linear", factor=3.0)),
    # Qwen3.5's own: mRoPE sections; text positions are equal in all three, i.e. 1-D RoPE
    "mrope": dict(rope_parameters=dict(ROPE, mrope_section=[1, 1, 0], mrope_interleaved=True)),
    "partial_rotary_factor": dict(rope_parameters=dict(ROPE, partial_rotary_factor=0.5)),
    "attention_bias": dict(attention_bias=True),
    "rms_norm_eps": dict(rms_norm_eps=1e-2),
    "tie_word_embeddings": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_an_honoured_field_matches_transformers(tmp_path, field):
    _assert_matches_oracle(make_qwen3_5(tmp_path, seed=4, **HONOURED[field]))


def test_yarn_on_qwen3_next_matches_transformers(tmp_path):
    _assert_matches_oracle(make_qwen3_next(tmp_path, seed=4, **HONOURED["yarn"]))


def test_an_absent_partial_rotary_factor_is_a_quarter_as_in_transformers(tmp_path):
    path = make_qwen3_5(tmp_path, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]["partial_rotary_factor"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert HybridModel.load(path).config.rotary_dim == 4
    _assert_matches_oracle(path)


def test_mtp_weights_load_and_are_ignored(tmp_path, qwen3_5_dir):
    tensors = load_file(str(qwen3_5_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    mtp = {"mtp.fc.weight": torch.randn(64, 128, generator=gen),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 64, generator=gen),
           "mtp.norm.weight": torch.randn(64, generator=gen),
           # an MTP head left in FP8 by a quantized checkpoint is never read
           "mtp.layers.0.mlp.gate_proj.weight": torch.randn(96, 64).to(torch.float8_e4m3fn)}
    cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    prompt = list(range(5, 133))
    got = Engine(HybridModel.load(tmp_path), window=256, prefix_chunk=64).prefill(prompt)
    want = Engine(HybridModel.load(qwen3_5_dir), window=256, prefix_chunk=64).prefill(prompt)
    assert torch.equal(got, want)


def _config(**changes) -> dict:
    cfg = json.loads(json.dumps(dict(
        model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, rope_parameters=ROPE)))
    cfg.update(changes)
    return cfg


REFUSED = [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(hidden_act="relu2"), "hidden_act 'relu2'"),
    (dict(attn_output_gate=False), "attn_output_gate False"),
    (dict(rope_parameters=dict(ROPE, rope_type="dynamic", factor=2.0)),
     "rope_parameters.rope_type 'dynamic'"),
    (dict(rope_parameters=dict(ROPE, rope_type="longrope")), "rope_type 'longrope'"),
    (dict(rope_parameters=dict(ROPE, rope_type="llama3", factor=8.0)), "rope_type 'llama3'"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_type 'dynamic'"),
    (dict(rope_parameters=dict(ROPE, rope_type="linear")), "'linear' needs a factor"),
    (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window True"),
    (dict(mlp_bias=True), "mlp_bias True"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0"),
]


@pytest.mark.parametrize("changes, named", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_field_tandem_does_not_compute_is_refused_naming_it(changes, named):
    with pytest.raises(ModelError, match=named.replace(".", r"\.").replace("(", r"\(")):
        HybridConfig.from_dict(_config(**changes))


def test_a_refused_field_fails_the_load_of_a_real_checkpoint(tmp_path, qwen3_5_dir):
    cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(qwen3_5_dir / "model.safetensors")
    with pytest.raises(ModelError, match="hidden_act 'gelu_pytorch_tanh' is not implemented"):
        HybridModel.load(tmp_path)


def test_neutral_values_of_the_refused_fields_load():
    cfg = _config(hidden_act="swish", attn_output_gate=True, use_sliding_window=False,
                  mlp_bias=False, final_logit_softcapping=None, sliding_window=None)
    assert HybridConfig.from_dict(cfg).rope_type == "default"
