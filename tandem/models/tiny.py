"""The embedded default model ``tiny``: a small Qwen3.5-layout checkpoint tandem writes itself.

It is an ordinary checkpoint directory (config.json, model.safetensors, the Qwen3.5/3.6 tokenizer
and tandem's chat template), drawn from a fixed seed, so the default goes through the same loader
as a real checkpoint and is the same on every machine. Sized so that a cold 32k prefill takes
several seconds on 2 cores (the caches have something to save) and a few hundred tokens well
under a second.

It carries a small random vision tower (``model.visual.*``, Qwen3.5's layout and patch size) and
its image processor's preprocessor_config.json, so the embedded default reads images too. The
tower is drawn from a generator of its own: the language model's tensors are the ones version 1
drew, bit for bit, and so is its text.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import structlog
import torch

TINY_NAME = "tiny"
TINY_VERSION = 2  # bump when the recipe changes: the folder name carries it (2: the tower)
TINY_SEED = 20261129
VOCAB_SIZE = 248320  # Qwen3.5's padded vocabulary: 248,044 ranks + specials, rounded up

TINY_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "dtype": "float32",
    "eos_token_id": 248046,
    "bos_token_id": None,
    "pad_token_id": None,
}

# The tower: Qwen3.5's patch, temporal patch and merge sizes, narrow and two blocks deep.
TINY_VISION_CONFIG = {
    "model_type": "qwen3_5_vision",
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": TINY_CONFIG["hidden_size"],
    "num_position_embeddings": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}
# What the written config.json adds to TINY_CONFIG for images: the tower, Qwen3.5's placeholder
# ids, and mRoPE's sections over tiny's 4 rotary frequencies (temporal 2, height 1, width 1).
TINY_IMAGE_FIELDS = {
    "vision_config": TINY_VISION_CONFIG,
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "rope_parameters": dict(TINY_CONFIG["rope_parameters"], mrope_section=[2, 1, 1]),
}
# An image is 16 to 256 prompt rows: 128 x 128 to 512 x 512 pixels after the resize.
TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255, "resample": 3,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 128 * 128, "longest_edge": 512 * 512},
}

log = structlog.get_logger()


def _weights(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor drawn in name order from one seeded generator."""
    return dict(_draw(config))


def _text_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The language model's tensors' shapes by their unprefixed names."""
    from tandem.models.hybrid import HybridConfig, HybridModel

    cfg = HybridConfig.from_dict(config)
    return HybridModel._expected_shapes(type("S", (), {"config": cfg})())


def _text_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def _draw(config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors, one at a time, in the order the generator draws them
    (name order), each scaled in place: one tensor held at a time, the largest (the embedding,
    254 MB on tiny) once."""
    shapes = _text_shapes(config)
    gen = torch.Generator().manual_seed(TINY_SEED)
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=gen) * 8 + 0.5)
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + torch.randn(shape, generator=gen) * 0.1
        elif name == "norm.weight":
            # Embeddings are tied and small (below), so the final norm's gain sets the logits'
            # spread: about 5 standard deviations.
            t = 4.0 + torch.randn(shape, generator=gen) * 0.1
        elif len(shape) == 1:  # zero-centred RMSNorm weights: x_hat * (1 + w)
            t = torch.randn(shape, generator=gen) * 0.1
        else:
            fan_in = shape[-1]
            # A tied embedding as large as the layers' outputs makes greedy decoding repeat its
            # input token forever; at 0.05 the context decides.
            scale = 0.05 if name == "embed_tokens.weight" else fan_in ** -0.5
            t = torch.randn(shape, generator=gen).mul_(scale)  # x * s's bits, in place
        yield _text_name(name), t


def _vision_weights(vision: dict) -> dict[str, torch.Tensor]:
    """The tower's tensors in name order from a generator of its own (the text's draws stay
    what they were)."""
    return dict(_draw_vision(vision))


def _vision_shapes(vision: dict) -> dict[str, tuple[int, ...]]:
    from tandem.models.vision import VisionConfig

    return VisionConfig.from_dict(vision).expected_shapes()


def _draw_vision(vision: dict) -> Iterator[tuple[str, torch.Tensor]]:
    shapes = _vision_shapes(vision)
    gen = torch.Generator().manual_seed(TINY_SEED + 1)
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") \
                or name == "merger.norm.weight":
            t = 1.0 + torch.randn(shape, generator=gen) * 0.1  # LayerNorm gains
        elif len(shape) == 1:  # biases
            t = torch.randn(shape, generator=gen) * 0.02
        elif name == "pos_embed.weight":
            t = torch.randn(shape, generator=gen) * 0.1
        else:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            # the merger's output sits beside embeddings of 0.05: keep its rows that size
            gain = 0.1 if name == "merger.linear_fc2.weight" else 1.0
            t = torch.randn(shape, generator=gen) * fan_in ** -0.5 * gain
        yield "model.visual." + name, t


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                      tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str]) -> None:
    """A float32 safetensors file written one tensor at a time, in any order ``tensors`` come,
    each at its place: the layout safetensors' ``save_file`` gives (the header's JSON compact,
    ``__metadata__`` first, the tensors' data in name order, the header padded with spaces to
    8 bytes), the same bytes, without holding every tensor and a bytes copy of each at once
    (``save_file`` peaked at 788 MiB writing tiny; this holds its largest tensor)."""
    header: dict = {"__metadata__": metadata}
    offsets, at = {}, 0
    for name in sorted(shapes):
        nbytes = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]),
                        "data_offsets": [at, at + nbytes]}
        offsets[name] = at
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    written = set()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(base + at)
        for name, t in tensors:
            if name not in offsets or name in written or t.dtype != torch.float32 \
                    or tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"tensor {name} is not the header's")
            f.seek(base + offsets[name])
            f.write(t.contiguous().numpy().data)
            written.add(name)
    if written != set(offsets):
        raise ValueError(f"{len(offsets) - len(written)} tensors of the header never came")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tiny_dir(models_dir: Path) -> Path:
    return Path(models_dir) / f"{TINY_NAME}-v{TINY_VERSION}"


def ensure_tiny(models_dir: Path) -> Path:
    """The tiny checkpoint's folder, written on first use (atomically: a temp folder renamed)."""
    final = tiny_dir(models_dir)
    if (final / "model.safetensors").is_file() and (final / "tandem-tiny.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=final.parent))
    try:
        from tandem.models.tokenizer import write_qwen_tokenizer

        (tmp / "config.json").write_text(json.dumps(dict(TINY_CONFIG, **TINY_IMAGE_FIELDS),
                                                    indent=2))
        shapes = {_text_name(k): v for k, v in _text_shapes(TINY_CONFIG).items()}
        shapes.update({"model.visual." + k: v
                       for k, v in _vision_shapes(TINY_VISION_CONFIG).items()})
        write_safetensors(tmp / "model.safetensors", shapes,
                          itertools.chain(_draw(TINY_CONFIG), _draw_vision(TINY_VISION_CONFIG)),
                          metadata={"format": "pt"})
        (tmp / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2))
        write_qwen_tokenizer(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [248046, 248044], "do_sample": False}, indent=2))
        digest = _sha256(tmp / "model.safetensors")
        (tmp / "tandem-tiny.json").write_text(json.dumps(
            {"version": TINY_VERSION, "seed": TINY_SEED, "weights_sha256": digest}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        log.info("tiny_model_written", path=str(final), weights_sha256=digest[:16])
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
