"""FP8 block-scaled checkpoints dequantized at load, and every other quantization refused.

The test quantizes a small random checkpoint itself, with blocks that do not divide the shapes
(partial tiles at the ends of rows and columns), and writes beside it the same model with the
weights it dequantized (``fp8.float() * scale_inv`` broadcast over each tile, in its own code):
the FP8 checkpoint's logits must equal that reference's bit for bit, and stay near the
unquantized original's (the FP8 error), where ignoring the scales answers as another model.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import VOCAB, make_qwen3_5
from tandem.engine import Engine
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridModel

BLOCK = (24, 40)  # divides none of 64, 96, 128: every matrix has partial tiles
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# What Qwen's FP8 checkpoints keep in bf16 among the matrices (quant.py's docstring).
NOT_CONVERTED = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b")


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return (scale.repeat_interleave(BLOCK[0], dim=0).repeat_interleave(BLOCK[1], dim=1)
            [:rows, :cols])


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    amax = torch.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            amax[i, j] = tile.abs().max()
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale_inv, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.float() * _expand(scale_inv.float(), *q.shape)


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and ".layers." in name and not any(s in name for s in NOT_CONVERTED)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """(original, fp8, dequantized reference): three checkpoints of one model."""
    root = tmp_path_factory.mktemp("fp8")
    original = make_qwen3_5(root / "original", seed=3)
    tensors = load_file(str(original / "model.safetensors"))
    config = json.loads((original / "config.json").read_text())
    fp8, reference = {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s = _quantize(t)
            fp8[name], fp8[name[: -len(".weight")] + ".weight_scale_inv"] = q, s
            reference[name] = _dequantize(q, s)
        else:
            fp8[name] = reference[name] = t
    assert sum(1 for t in fp8.values() if t.dtype == torch.float8_e4m3fn) >= 20
    dirs = []
    for label, weights, quant in (("fp8", fp8, True), ("reference", reference, False)):
        d = root / label
        d.mkdir()
        cfg = dict(config)
        if quant:
            cfg["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK),
                "modules_to_not_convert": list(NOT_CONVERTED)}
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return original, *dirs


def _logits(model: HybridModel, cuts=(64, 192)) -> list[torch.Tensor]:
    prompt = torch.randint(0, VOCAB, (192,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(model, window=512, prefix_chunk=64)
    out = []
    for cut in cuts:
        engine.reset()
        out.append(engine.prefill(prompt[:cut]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_checkpoint_answers_as_its_dequantized_weights_bit_for_bit(fp8_dirs, dtype):
    _, fp8, reference = fp8_dirs
    got = _logits(HybridModel.load(fp8, dtype=dtype))
    want = _logits(HybridModel.load(reference, dtype=dtype))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_an_fp8_checkpoint_stays_near_the_unquantized_original(fp8_dirs):
    original, fp8, _ = fp8_dirs
    got = _logits(HybridModel.load(fp8))
    want = _logits(HybridModel.load(original))
    for g, w in zip(got, want):
        # e4m3 keeps 3 mantissa bits, and a random 4-layer model compounds them: a cosine of
        # 0.94 to 0.99 here, where the scales ignored give 0.16 and -0.001 and another argmax.
        assert torch.nn.functional.cosine_similarity(g, w, dim=0).item() > 0.9
        assert g.argmax() == w.argmax()


def test_the_scales_multiply_each_tile_the_partial_ones_at_the_ends_included():
    from tandem.models import quant

    w = torch.randn(3, 50, 90)  # fused experts: a grid a leading index
    blocks = quant.Fp8Blocks(block_rows=16, block_cols=32)
    scale = torch.rand(3, 4, 3) + 0.5
    q = w.to(torch.float8_e4m3fn)
    got = quant.dequantize(q, scale, blocks, "experts.gate_up_proj")
    want = q.float() * scale.repeat_interleave(16, 1).repeat_interleave(32, 2)[:, :50, :90]
    assert torch.equal(got, want)
    with pytest.raises(ModelError, match=r"scale grid \(3, 4, 2\).*need \(3, 4, 3\)"):
        quant.dequantize(q, scale[..., :2], blocks, "experts.gate_up_proj")


def _with_config(tmp_path: Path, source: Path, **changes) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(source / "model.safetensors")
    return d


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4",
                                    "bitnet", "torchao"])
def test_a_quantization_tandem_does_not_implement_is_refused_naming_the_field(
        tmp_path, qwen3_5_dir, method):
    d = _with_config(tmp_path, qwen3_5_dir,
                     quantization_config={"quant_method": method, "bits": 4, "group_size": 128})
    with pytest.raises(ModelError, match=rf"quantization_config\.quant_method '{method}' is not "
                                         rf"implemented"):
        HybridModel.load(d)


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "fp8"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
])
def test_an_fp8_layout_tandem_does_not_implement_is_refused_naming_the_field(
        tmp_path, qwen3_5_dir, qc, field):
    d = _with_config(tmp_path, qwen3_5_dir, quantization_config=qc)
    with pytest.raises(ModelError, match=rf"quantization_config\.{field}"):
        HybridModel.load(d)


def test_compressed_tensors_older_spelling_is_refused(tmp_path, qwen3_5_dir):
    d = _with_config(tmp_path, qwen3_5_dir, compression_config={"format": "pack-quantized"})
    with pytest.raises(ModelError, match="compression_config"):
        HybridModel.load(d)


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path, fp8_dirs):
    _, fp8, _ = fp8_dirs
    d = _with_config(tmp_path, fp8, quantization_config=None)
    with pytest.raises(ModelError, match="float8_e4m3fn but config.json has no "
                                         "quantization_config"):
        HybridModel.load(d)


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path, fp8_dirs):
    _, fp8, _ = fp8_dirs
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("weight_scale_inv"))
    del tensors[name]
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(fp8 / "config.json", d / "config.json")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match=f"has no '{name}'"):
        HybridModel.load(d)


def test_a_scale_in_another_shard_than_its_weight_is_found(tmp_path, fp8_dirs):
    _, fp8, _ = fp8_dirs
    tensors = load_file(str(fp8 / "model.safetensors"))
    scales = {n: t for n, t in tensors.items() if n.endswith("weight_scale_inv")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    # The scales' shard sorts first: each is met before its weight, and in another file.
    save_file(scales, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in scales}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in rest})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(fp8 / "config.json", tmp_path / "config.json")
    for g, w in zip(_logits(HybridModel.load(tmp_path)), _logits(HybridModel.load(fp8))):
        assert torch.equal(g, w)
