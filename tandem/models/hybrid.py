"""The ``hybrid`` adapter: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next (MoE) checkpoints.

Gated DeltaNet layers (recurrent state ``gdn.S`` in fp32 and a conv tail ``gdn.conv``) beside
gated full-attention layers (views ``K`` and ``V``, one row a token). Weights are plain tensors
applied with ``F.linear`` in the checkpoint's own row order; the math follows transformers'
modeling_qwen3_5 / modeling_qwen3_next / modeling_qwen3_5_moe (the experts: models/moe.py),
which the tests hold it to within 1e-5 in fp32. A checkpoint with a vision tower
(``model.visual.*``) loads it beside the language model (models/vision.py); forward then takes
the tower's rows in place of the image placeholders' embeddings and the rows' 3-D positions.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels import decode as decode_ops, reference
from tandem.kernels.decode import each_row
from tandem.kernels import native as native_ops
from tandem.kernels.native import digest as native_digest
from tandem.kernels.native import fits as native_fits
from tandem.kernels.native import rows_f32 as native_rows
from tandem.kernels.native import rows_fit as native_rows_fit
from tandem.kernels import screen as head_screen
from tandem.kernels import step as native_step
from tandem.models import checkpoint, fields, moe, quant, rope, rows, vision
from tandem.models.base import Chosen, Cost, HeadRow, ModelError, ModelState, View

SUPPORTED = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
LOGITS_SLICE = 64  # positions a slice of forward's on_logits holds

log = structlog.get_logger()
# The native step's rotary rows come from blocks of this many positions (_native_rope), at
# most this many blocks kept (a block is 2 x ROPE_BLOCK x rotary_dim floats: 128 KiB at 64).
ROPE_BLOCK = 256
ROPE_BLOCKS_KEPT = 16


@dataclass(frozen=True)
class ChunkMask:
    """The causal mask of a chunk of ``n`` rows at ``start`` over the keys [0, end), end =
    start + n, held as one diagonal: a row of the mask is the row below it moved one key to
    the right, so a row range read in reverse is a view of a single line of n + end - 1
    values with strides (1, 1), 0 up to key start + n - 1 and -inf from there. A chunk at
    16k keys held 1,024 x 16k floats (64 MiB) as a whole mask; this line is 68 KiB. SDPA's
    CPU kernel reads the view as it is, and the queries run in reverse order beside it
    (``flipped``; ``_attend`` turns its output back): every row gets the bits of the whole
    mask (tests/engine/test_engine_prefill.py)."""

    line: torch.Tensor
    n: int
    end: int

    def flipped(self, a: int, b: int) -> torch.Tensor:
        """The mask of the chunk's rows [a, b) last row first, [b - a, end]: row r is chunk row
        b - 1 - r, which sees keys up to start + b - 1 - r, i.e. those whose key index plus
        r plus n - b lies under start + n."""
        return self.line.as_strided((b - a, self.end), (1, 1), self.n - b)


@dataclass(frozen=True)
class HybridConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool
    dtype: str
    # The mixture of experts, Qwen3-Next's and Qwen3.5-MoE's (num_experts 0 for a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    # rope_parameters beyond theta and the partial factor (tandem.models.rope)
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, object], ...] = ()
    attention_bias: bool = False  # q/k/v/o_proj biases
    # mRoPE's temporal, height and width frequency counts (rope.mrope_axes); read by image rows
    mrope_section: tuple[int, ...] = rope.DEFAULT_MROPE_SECTION
    # the recurrent state's dtype (gdn.S): fp32 unless the checkpoint says otherwise, as
    # transformers and vLLM keep it whatever the weights' dtype
    mamba_ssm_dtype: str = "float32"

    @classmethod
    def from_dict(cls, raw: dict) -> "HybridConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED:
            raise ModelError(f"unknown model type {model_type!r}; the hybrid adapter reads "
                             f"{', '.join(SUPPORTED)}")
        text = raw.get("text_config") if model_type in ("qwen3_5", "qwen3_5_moe") else None
        # A real Qwen3.5 checkpoint nests the language model in text_config.
        cfg = dict(text) if isinstance(text, dict) else dict(raw)
        try:
            num_layers = int(cfg["num_hidden_layers"])
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                interval = int(cfg.get("full_attention_interval", 4))
                layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(num_layers)]
            if len(layer_types) < num_layers or any(
                    t not in ("linear_attention", "full_attention") for t in layer_types):
                raise ModelError(f"layer_types {layer_types!r} do not describe {num_layers} layers")
            fields.check_arithmetic(cfg)
            rope_type, rope_scaling = rope.read_rope(cfg)
            rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            heads = int(cfg["num_attention_heads"])
            out = cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg.get("intermediate_size", 0)),
                layer_types=tuple(layer_types[:num_layers]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg["num_key_value_heads"]),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                rope_theta=float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                # 0.25 when absent, as transformers' Qwen3.5 / Qwen3-Next configs default it.
                partial_rotary_factor=float(rope_params.get("partial_rotary_factor",
                                                            cfg.get("partial_rotary_factor",
                                                                    0.25))),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(cfg["linear_key_head_dim"]),
                linear_value_head_dim=int(cfg["linear_value_head_dim"]),
                linear_num_key_heads=int(cfg["linear_num_key_heads"]),
                linear_num_value_heads=int(cfg["linear_num_value_heads"]),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                                 cfg.get("tie_word_embeddings", False))),
                dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or raw.get("dtype")
                          or "float32"),
                **moe.config_fields(model_type, cfg),
                rope_type=rope_type,
                rope_scaling=rope_scaling,
                attention_bias=bool(cfg.get("attention_bias", False)),
                mrope_section=rope.read_mrope_section(cfg),
                mamba_ssm_dtype=str(cfg.get("mamba_ssm_dtype") or raw.get("mamba_ssm_dtype")
                                    or "float32"),
            )
        except KeyError as exc:
            raise ModelError(f"config.json lacks {exc.args[0]!r}") from exc
        if out.linear_num_value_heads % out.linear_num_key_heads:
            raise ModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        return out

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


def _model_name(name: str, config: HybridConfig) -> str | None:
    """A checkpoint tensor's name in the language model, or None for one it does not use: the
    MTP head (``mtp.*``), a VL checkpoint's vision tower (HybridModel.load reads that through
    vision.visual_name when the config has a vision_config), a tied checkpoint's stray
    lm_head."""
    if name == "lm_head.weight":
        return None if config.tie_word_embeddings else name
    for prefix in ("model.language_model.", "model."):  # Qwen3.5 VL nests the language model
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return None if rest.startswith(("visual.", "mtp.")) else rest
    return None


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ModelError(f"unsupported dtype {name!r}; use one of {sorted(table)}")
    return table[name]


def _auto_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype when none is asked: the checkpoint's on a CPU; on a GPU the
    checkpoint's when it is a half type, else bf16 (vLLM's ``auto``: an fp32 checkpoint runs
    in bf16 on a GPU)."""
    dtype = _dtype(name)
    if device.type != "cpu" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x_hat * (1 + w), computed in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """The GDN output norm: x_hat * w * silu(z)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HybridModel:
    """A Qwen3.5 / Qwen3-Next language model over one sequence's preallocated buffers."""

    chooses = True  # forward_batch takes ``choose`` (a greedy position's token alone)
    # where a weight kept as its file's mapping lies in the file (load's, on the CPU): the
    # head's screen, its exact rows and the embedding's lookups read those bytes from the file
    # (_rows_file), so that those matrices' mapped pages stay untouched until a request reads
    # the whole head
    file_extents: "dict[str, checkpoint.Extent]" = {}

    def __init__(self, config: HybridConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype | None = None, source: Path | None = None,
                 images: "vision.ImageSupport | None" = None,
                 device: torch.device | str | None = None):
        self.config = config
        # Every weight, buffer and state tensor of the language model lives here; the vision
        # tower stays on the host (its rows move in embed).
        self.device = torch.device(device or "cpu")
        # the vision tower and its processor's rules, for a checkpoint that has them
        self.images = images
        self.model_type = config.model_type
        self.vocab_size = config.vocab_size
        self.dtype = dtype or _auto_dtype(config.dtype, self.device)
        self.state_dtype = _dtype(config.mamba_ssm_dtype)
        self.source = source
        self._weights_digest = checkpoint.weights_digest(source) if source else ""
        self.gdn_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
        self.attn_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
        self._slot = {i: n for n, i in enumerate(self.gdn_layers)}
        self._slot.update({i: n for n, i in enumerate(self.attn_layers)})
        self.w = self._check_and_cast(weights)
        self.inv_freq, self.rope_scale = rope.inv_freq(config.rope_type, config.rope_scaling,
                                                       config.rope_theta, config.rotary_dim)
        self._mrope_axes = rope.mrope_axes(config.mrope_section, self.inv_freq.shape[0])
        if self.device.type != "cpu":
            self.inv_freq = self.inv_freq.to(self.device)
            self._mrope_axes = self._mrope_axes.to(self.device)
        self._fused = self._fuse_projections()
        self._gain = self._decode_constants()
        self._k = [f"layers.{i}." for i in range(len(config.layer_types))]
        self._wt = self._decode_transposed()
        self._eps = _scalar(config.rms_norm_eps)
        self._eps_value = float(self._eps)  # the same fp32 value, for the native row ops
        self._l2_eps = _scalar(1e-6)  # reference.l2norm's
        self._q_scale = _scalar(config.linear_key_head_dim ** -0.5)
        # The captured decode and verify steps (tandem.models.graphs.StepGraphs) on a CUDA
        # device with cuda_graphs on; None: every step runs eagerly (always on a CPU).
        self.graphs = None
        # greedy-only rows (forward_batch's and forward_ragged's ``choose``, a prefill's
        # HeadRow): their token through the head's screen, or the full head's logits (over
        # STEP_ROWS_MAX, no screen, or an input it does not take); /metrics reads them
        self.screen_counts = {"screened": 0, "full": 0}

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> "HybridModel":
        """``device``: where the language model goes (the CPU by default). The files are read
        on the host a tensor at a time and each moves to the device as the model takes it
        (_check_and_cast), so the host holds one tensor (or one layer's stacked experts) at a
        time; FP8 blocks are dequantised on the device where it has FP8 matmuls, else on the
        host."""
        model_dir = Path(model_dir)
        device = torch.device(device or "cpu")
        raw = checkpoint.read_config(model_dir)
        config = HybridConfig.from_dict(raw)
        fp8 = quant.read_quantization(raw)
        dtype = dtype or _auto_dtype(config.dtype, device)
        if device.type == "cuda":
            from tandem import devices

            devices.pin_staging()  # the caches' staging now copies device rows
        with_tower = isinstance(raw.get("vision_config"), dict)

        def rename(name: str) -> str | None:
            if with_tower and (inside := vision.visual_name(name)) is not None:
                return "visual." + inside
            return _model_name(name, config)

        fp8_device = device if fp8 is not None and _fp8_on(device) else None
        # where the device multiplies FP8, the language model's matrices stay FP8 (models/
        # fp8.py); the stacked experts and the vision tower are dequantised
        weights, report = checkpoint.read_weights(
            model_dir, rename, dtype, fp8, fp8_device=fp8_device,
            keep_fp8=lambda n: not n.startswith("visual.") and ".experts." not in n)
        images = None
        if with_tower:
            tower = {k[len("visual."):]: weights.pop(k) for k in list(weights)
                     if k.startswith("visual.")}
            images = vision.ImageSupport.load(model_dir, raw, tower, dtype)
            del tower
        model = cls(config, weights, dtype=dtype, source=model_dir, images=images,
                    device=device)
        del weights  # what the model did not take over (it stacks the experts as it frees them)
        if device.type == "cpu":
            model.file_extents = dict(report.views)
            if config.tie_word_embeddings and "embed_tokens.weight" in report.views:
                model.file_extents["lm_head.weight"] = report.views["embed_tokens.weight"]
        held = {t.data_ptr(): t for t in model.w.values()}.values()  # tied: one tensor
        log.info("checkpoint_loaded", model_type=config.model_type,
                 dtype=str(dtype).removeprefix("torch."), device=str(device),
                 state_dtype=str(model.state_dtype).removeprefix("torch."),
                 parameters=sum(t.numel() for t in held),
                 nbytes=sum(t.numel() * t.element_size() for t in held),
                 files=report.files, tensors=report.tensors, skipped_tensors=report.skipped,
                 quantization=fp8.describe() if fp8 else "none",
                 dequantized_tensors=report.dequantized, fp8_tensors=report.native,
                 vision_tower=images.describe() if images else "none")
        return model

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        h = c.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, h),
                                              "norm.weight": (h,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, h)
        ratio = c.linear_num_value_heads // c.linear_num_key_heads
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if kind == "linear_attention":
                a = p + "linear_attn."
                if c.model_type == "qwen3_next":
                    per_head = 2 * c.linear_key_head_dim + 2 * ratio * c.linear_value_head_dim
                    shapes[a + "in_proj_qkvz.weight"] = (c.linear_num_key_heads * per_head, h)
                    shapes[a + "in_proj_ba.weight"] = (2 * c.linear_num_value_heads, h)
                else:
                    shapes[a + "in_proj_qkv.weight"] = (c.conv_dim, h)
                    shapes[a + "in_proj_z.weight"] = (c.value_dim, h)
                    shapes[a + "in_proj_b.weight"] = (c.linear_num_value_heads, h)
                    shapes[a + "in_proj_a.weight"] = (c.linear_num_value_heads, h)
                shapes[a + "conv1d.weight"] = (c.conv_dim, 1, c.linear_conv_kernel_dim)
                shapes[a + "dt_bias"] = (c.linear_num_value_heads,)
                shapes[a + "A_log"] = (c.linear_num_value_heads,)
                shapes[a + "norm.weight"] = (c.linear_value_head_dim,)
                shapes[a + "out_proj.weight"] = (h, c.value_dim)
            else:
                a = p + "self_attn."
                shapes[a + "q_proj.weight"] = (2 * c.num_attention_heads * c.head_dim, h)
                shapes[a + "k_proj.weight"] = (c.num_key_value_heads * c.head_dim, h)
                shapes[a + "v_proj.weight"] = (c.num_key_value_heads * c.head_dim, h)
                shapes[a + "o_proj.weight"] = (h, c.num_attention_heads * c.head_dim)
                shapes[a + "q_norm.weight"] = (c.head_dim,)
                shapes[a + "k_norm.weight"] = (c.head_dim,)
                if c.attention_bias:
                    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        shapes[f"{a}{proj}.bias"] = shapes[f"{a}{proj}.weight"][:1]
            m = p + "mlp."
            if c.is_moe_layer(i):
                shapes.update(moe.expected_shapes(m, c))
            else:
                shapes[m + "gate_proj.weight"] = (c.intermediate_size, h)
                shapes[m + "up_proj.weight"] = (c.intermediate_size, h)
                shapes[m + "down_proj.weight"] = (h, c.intermediate_size)
        return shapes

    def _check_and_cast(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        c = self.config
        # The experts are held stacked, as transformers holds them, for the grouped matmuls.
        # Each expert's tensors leave the caller's dict (the model owns it) as they are copied
        # in, so that the load's peak is the stacks plus one expert, not two copies of them all.
        for i in range(len(c.layer_types)):
            if c.is_moe_layer(i):
                moe.fuse_experts(weights, f"layers.{i}.mlp.", c, self.dtype)
        out = {}
        for name, shape in self._expected_shapes().items():
            t = weights.get(name)
            if t is None:
                raise ModelError(f"checkpoint lacks tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ModelError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            # A_log and dt_bias are cast too, as transformers does: the decay math then upcasts.
            out[name] = t.to(self.dtype).contiguous()
            if self.device.type != "cpu":
                # to the device as it is taken, its host copy dropped: the host never holds
                # the model whole beside the device's
                out[name] = out[name].to(self.device)
                del weights[name], t
        if c.tie_word_embeddings:
            out["lm_head.weight"] = out["embed_tokens.weight"]
        return out

    # -- state -----------------------------------------------------------------------------

    def new_state(self, window: int) -> ModelState:
        c = self.config
        s = torch.zeros(len(self.gdn_layers), c.linear_num_value_heads, c.linear_key_head_dim,
                        c.linear_value_head_dim, dtype=self.state_dtype, device=self.device)
        conv = torch.zeros(len(self.gdn_layers), c.conv_dim, c.linear_conv_kernel_dim - 1,
                           dtype=self.dtype, device=self.device)
        kv_shape = (len(self.attn_layers), c.num_key_value_heads, window, c.head_dim)
        # Untouched pages: a page of rows is backed only once a forward writes it (the window's
        # zeros touched every page up front, 1.5 GiB at 0.8B-like dims and 64k rows), and
        # rows.release_rows gives pages above a length back. No read sees a row above the
        # length: attention slices the keys to [0, end) and writes rows [start, end) first,
        # and every cache copies views by rows under the length.
        k = rows.empty_rows(kv_shape, self.dtype, self.device)
        v = rows.empty_rows(kv_shape, self.dtype, self.device)
        return ModelState(sections={"gdn.S": s, "gdn.conv": conv},
                          views={"K": View(k, 2), "V": View(v, 2)})

    def cost(self, window: int, prefix_chunk: int = 1024) -> Cost:
        c = self.config
        el = torch.tensor([], dtype=self.dtype).element_size()
        state = (len(self.gdn_layers) * c.linear_num_value_heads * c.linear_key_head_dim
                 * c.linear_value_head_dim * torch.tensor([], dtype=self.state_dtype).element_size()
                 + len(self.gdn_layers) * c.conv_dim * (c.linear_conv_kernel_dim - 1) * el)
        row = 2 * len(self.attn_layers) * c.num_key_value_heads * c.head_dim * el
        inter = max(c.intermediate_size, c.moe_intermediate_size * max(c.num_experts_per_tok, 1),
                    c.shared_expert_intermediate_size)
        # Activations of one chunk token: residual, norms, projections, MLP (fp32 upper bound),
        # and a MoE token's k routed copies of its row with their outputs. Measured at 0.8B-like
        # dims (scripts/bench_memory.py --attribute): a GDN layer's call peaks at 123 KiB a chunk
        # token over its input (the conv's input, padded copy and output side by side), attention
        # at 65, the MLP at 42, under this bound's 162.
        per_token = 4 * (8 * c.hidden_size + 3 * inter + 3 * c.conv_dim + 2 * c.value_dim
                         + 2 * c.num_experts_per_tok * c.hidden_size)
        # SDPA never holds a chunk's scores (its CPU flash kernel and CUDA's work in blocks), and
        # the chunk's mask is one line, a value a key (ChunkMask). CUDA's kernels copy the
        # mask whole, a layer at a time: a chunk's row of it a key.
        per_context = el * (prefix_chunk if self.device.type == "cuda" else 1)
        # Prompt logprobs: a slice of logits and its log-softmax, fp32.
        floor = (32 << 20) + 2 * LOGITS_SLICE * c.vocab_size * 4
        return Cost(state_nbytes=state, row_nbytes=row, workspace_floor_nbytes=floor,
                    workspace_per_token_nbytes=per_token,
                    workspace_cap_nbytes=floor + per_token * prefix_chunk,
                    workspace_per_context_token_nbytes=per_context)

    def manifest(self) -> dict[str, str]:
        return {
            "model_type": self.model_type,
            "config": json.dumps(self.config.__dict__, sort_keys=True, default=list),
            "dtype": str(self.dtype),
            **({"state_dtype": str(self.state_dtype)}
               if self.state_dtype != torch.float32 else {}),
            "weights": self._weights_digest,
            "code": checkpoint.code_digest(__import__(__name__, fromlist=["x"]), moe, reference,
                                          decode_ops, *((vision,) if self.images else ())),
            # decode's matmuls and a prefill's GDN middle round otherwise on the native
            # kernels than on torch's
            "decode": native_digest() if decode_ops.block() == 1 else "torch",
            # MKL's reproducible mode (tandem/__init__.py): another rounds prefill otherwise
            "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        }

    # -- forward ---------------------------------------------------------------------------

    def _rope(self, start: int, num_tokens: int):
        pos = torch.arange(start, start + num_tokens, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:  # YaRN's attention factor, on cos and sin as transformers
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(self.dtype), sin.to(self.dtype)

    def _mrope(self, positions: torch.Tensor):
        """cos and sin at 3-D positions ``[3, n]``: each frequency turned by the axis
        rope.mrope_axes gives it. Where a row's three ids are equal these are _rope's bits
        (the same products, picked rather than recomputed)."""
        n = positions.shape[1]
        freqs = positions.to(self.device, torch.float32)[:, :, None] * self.inv_freq[None, None, :]
        axes = self._mrope_axes[None, None, :].expand(1, n, -1)
        freqs = torch.gather(freqs, 0, axes)[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(self.dtype), sin.to(self.dtype)

    def _rows_file(self, name: str) -> "head_screen.RowsFile | None":
        """Weight ``name`` as rows its file holds (screen.RowsFile), where load kept it as the
        file's mapping on the CPU: opened once (None where it cannot be, or the bytes differ).
        A tied head and embedding share one."""
        files = self.__dict__.setdefault("_rows_files", {})
        extent = self.file_extents.get(name)
        if extent is None or self.device.type != "cpu":
            return None
        if extent not in files:
            files[extent] = head_screen.RowsFile.open(extent, self.w[name])
        return files[extent]

    def _embed_file(self) -> "head_screen.RowsFile | None":
        """embed_tokens as rows its file holds, where load kept the table as the file's mapping:
        a lookup by pread maps none of its pages (screen.RowsFile), so the process holds the
        rows it reads, never the table. A tied table is the head: only where the head's screen
        reads its rows from the file too (else greedy decode reads the whole head anyway).
        None: look the rows up in the mapping."""
        if self.config.tie_word_embeddings:
            plan = self.__dict__.get("_native_plan")
            if plan is None or plan.screen is None or plan.screen.file is None:
                return None
        return self._rows_file("embed_tokens.weight")

    def _embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """F.embedding over embed_tokens, its rows read from the file where _embed_file says
        so: the same bytes."""
        table = self.w["embed_tokens.weight"]
        f = self._embed_file()
        if f is None or token_ids.device.type != "cpu" or token_ids.numel() == 0 \
                or token_ids.dtype not in (torch.int64, torch.int32):
            return F.embedding(token_ids, table)
        rows = f.gather(token_ids.reshape(-1))
        if rows is None:  # an id out of range (F.embedding's error says so) or a short read
            return F.embedding(token_ids, table)
        return rows.view(*token_ids.shape, table.shape[1])

    def embed(self, token_ids: torch.Tensor,
              image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The input rows of ``token_ids``; ``image_rows`` ``(index, rows)`` put the tower's
        rows in place of the placeholders' embeddings at those indices."""
        x = self._embedding(token_ids)
        if image_rows is not None:
            index, rows_ = image_rows
            x[index.to(x.device)] = rows_.to(x.device, x.dtype)
        return x

    def forward(self, state: ModelState, token_ids: torch.Tensor, start: int,
                decode: bool = False,
                on_logits: Callable[[int, torch.Tensor], None] | None = None,
                logits: bool | str = True, *,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None,
                rope_offset: int = 0) -> torch.Tensor | HeadRow | None:
        """As Model.forward; ``logits="row"`` (without ``on_logits``) returns the last position
        as a `HeadRow` (its logits computed when read, its greedy token through the head's
        screen without them). For a prompt with images (models/vision.py PromptImages.chunk)
        ``image_rows`` replace placeholder embeddings and ``rope_positions`` ``[3, n]`` are the
        chunk's 3-D positions, and ``rope_offset`` (the images' delta) shifts the rotary
        position of rows after a prompt with images: rows at ``start + i`` turn as
        ``start + i + rope_offset``. Without them the path is the text-only one, unchanged."""
        if decode:
            # The batched step at B = 1: a sequence decoded alone gets the bits it gets in a batch.
            if token_ids.shape[0] != 1:
                raise ValueError(f"decode forwards one token, not {token_ids.shape[0]}")
            return self.forward_batch([state], [int(token_ids[0])], [start],
                                      rope_offsets=[rope_offset] if rope_offset else None)[0]
        # The rows the head reads: every one for on_logits, the last for the logits, none for
        # a chunk before the last (the head reads the whole vocab matrix)
        keep = token_ids.shape[0] if on_logits is not None else 1 if logits else 0
        x = self._layers(state, token_ids, start, "prefill", None, image_rows=image_rows,
                         rope_positions=rope_positions, rope_offset=rope_offset, keep=keep)
        if keep == 0:
            return None
        eps = self.config.rms_norm_eps
        if on_logits is not None:
            # Every position but the last, a slice at a time: a chunk's logits whole are
            # chunk x vocab floats (1 GiB at 1,024 x 248k).
            for a in range(0, x.shape[0] - 1, LOGITS_SLICE):
                b = min(a + LOGITS_SLICE, x.shape[0] - 1)
                rows = rms_norm(x[a:b], self.w["norm.weight"], eps)
                on_logits(a, self._prefill_head(rows))
        last = rms_norm(x[-1:], self.w["norm.weight"], eps)
        if logits == "row" and on_logits is None:
            return HeadRow(last.contiguous().clone(), lambda row: self._prefill_head(row)[0],
                           self._screen_row)
        return self._prefill_head(last)[0]

    def _prefill_head(self, rows: torch.Tensor) -> torch.Tensor:
        """A prefill's logits of ``rows`` (normed) [n, vocab] fp32: on the native kernel where
        decode runs on it, one read of the vocabulary matrix for every row. F.linear at one
        row is MKL's GEMV, which on an EPYC host read tiny's 254 MB head at 7 GB/s: 30 ms of a
        230-token turn's 64 ms, where the native kernel reads it in 8."""
        head = self.w["lm_head.weight"]
        if decode_ops.block() == 1 and native_fits(rows, head):
            return native_rows(rows, head)
        return F.linear(rows, head).float()

    def forward_verify(self, state: ModelState, token_ids: torch.Tensor, start: int,
                       rope_offset: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A speculative verify block in one forward: every position's logits ``[n, vocab]``
        and every position's sections (``gdn.S`` ``[n, ...]``, ``gdn.conv`` ``[n, ...]``: the
        state after that token). The K/V rows of all ``n`` positions are written; the sections
        in ``state`` are left as they were, for the engine to land the accepted position."""
        steps: dict[str, list[torch.Tensor]] = {"gdn.S": [], "gdn.conv": []}
        x = self._layers(state, token_ids, start, "verify", steps, rope_offset=rope_offset)
        normed = rms_norm(x, self.w["norm.weight"], self.config.rms_norm_eps)
        # W @ x^T rather than x @ W^T: for the few rows of a block, CPU BLAS streams the
        # 248k-row head once this way (16-25 ms for 2 to 9 rows on 2 cores, as one row's
        # decode), where F.linear takes a path 2 to 3.5 times slower.
        logits = torch.mm(self.w["lm_head.weight"], normed.transpose(0, 1)).transpose(0, 1)
        logits = logits.float()
        return logits, {name: torch.stack(per_layer, dim=1)
                        for name, per_layer in steps.items() if per_layer}

    def _layers(self, state: ModelState, token_ids: torch.Tensor, start: int, mode: str,
                steps: dict[str, list[torch.Tensor]] | None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None,
                rope_offset: int = 0, keep: int | None = None) -> torch.Tensor:
        """The last layer's output rows: all of them (``keep`` None), or the last ``keep``: 1,
        every row, or 0 (an empty tensor). The rows and sections every layer writes are the same
        either way; what ``keep`` skips is the last layer's work that feeds only its output
        (its attention's queries and out projection, a GDN's out projection, its MLP) for the
        rows the head does not read: an eighth of a chunk's matmuls on tiny, as llama.cpp
        prunes its last layer to the rows it outputs. With a ``keep``, the last row's output
        is computed apart, by the same calls at 1 row as for ``keep`` 1, so that a prefill
        that scores every row (prompt logprobs) gives its last row the bits of one that does
        not."""
        c = self.config
        num_tokens = token_ids.shape[0]
        if keep is not None and keep not in (0, 1, num_tokens):
            raise ValueError(f"keep is 0, 1 or every row, not {keep} of {num_tokens}")
        parts = (None if keep is None else [] if keep == 0 else
                 [(num_tokens - 1, num_tokens)] if keep == 1 or num_tokens == 1 else
                 [(0, num_tokens - 1), (num_tokens - 1, num_tokens)])
        token_ids = token_ids.to(self.device)  # the engine's ids are the host's
        x = self.embed(token_ids, image_rows)
        if rope_positions is not None:
            if tuple(rope_positions.shape) != (3, num_tokens):
                raise ValueError(f"rope_positions {tuple(rope_positions.shape)} for "
                                 f"{num_tokens} tokens")
            cos, sin = self._mrope(rope_positions)
        else:
            cos, sin = self._rope(start + rope_offset, num_tokens)
        # A first chunk is causal over its own keys alone: SDPA's is_causal, which skips the
        # blocks above the diagonal (1.6 against 2.4 ms a layer at 1k rows on tiny, the same
        # bits as the mask on every shape tried); later chunks see every key before them.
        mask = self._causal_mask(start, num_tokens) if num_tokens > 1 and start > 0 else None
        last = len(c.layer_types) - 1
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            rows = parts if i == last else None
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            if kind == "linear_attention":
                h = self._gdn(i, h, state, mode, steps, parts=rows)
            else:
                h = self._attention(i, h, state, start, cos, sin, mask, parts=rows)
            if rows is not None:  # the last layer, its output rows a part at a time
                outs = [self._residual_mlp(i, x[a:b] + hp) for (a, b), hp in zip(rows, h)]
                return torch.cat(outs) if len(outs) > 1 else outs[0] if outs else x[:0]
            x = self._residual_mlp(i, x + h)
        return x

    def _residual_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x plus layer i's MLP (or MoE block) of its post-attention norm."""
        c, p = self.config, f"layers.{i}."
        h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        return x + (self._moe(i, h) if c.is_moe_layer(i) else self._mlp(p + "mlp.", h))

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        # silu and the product in place: two of a chunk's intermediate-wide tensors live at
        # once instead of four (14 MiB each at 0.8B-like dims), with the same bits
        act = F.silu(F.linear(h, w[p + "gate_proj.weight"]), inplace=True)
        return F.linear(act.mul_(F.linear(h, w[p + "up_proj.weight"])), w[p + "down_proj.weight"])

    def _moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return moe.sparse_moe(h, self.w, f"layers.{i}.mlp.", self.config)

    def _gdn_dims(self, i: int):
        """A GDN layer's config, weights, weight prefix, state slot and head sizes."""
        c = self.config
        return (c, self.w, f"layers.{i}.linear_attn.", self._slot[i], c.linear_num_key_heads,
                c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)

    def _gdn(self, i: int, h: torch.Tensor, state: ModelState, mode: str,
             steps: dict[str, list[torch.Tensor]] | None,
             parts: list[tuple[int, int]] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """The layer's output rows, or where ``parts`` are given (_layers) those of each row
        range [a, b), one out projection each; the state and the conv tail advance over every
        row."""
        c, w, p, slot, hk, hv, dk, dv = self._gdn_dims(i)
        n = h.shape[0]
        if c.model_type == "qwen3_next":
            # Fused projections grouped per key head: [q, k, v, z] and [b, a] for each group.
            ratio = hv // hk
            qkvz = F.linear(h, w[p + "in_proj_qkvz.weight"]).view(n, hk, -1)
            q, k, v, z = torch.split(qkvz, [dk, dk, ratio * dv, ratio * dv], dim=-1)
            mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
            z = z.reshape(n, hv, dv)
            ba = F.linear(h, w[p + "in_proj_ba.weight"]).view(n, hk, 2 * ratio)
            b, a = torch.split(ba, [ratio, ratio], dim=-1)
            b, a = b.reshape(n, hv), a.reshape(n, hv)
        else:
            mixed = F.linear(h, w[p + "in_proj_qkv.weight"])
            z = F.linear(h, w[p + "in_proj_z.weight"]).view(n, hv, dv)
            b = F.linear(h, w[p + "in_proj_b.weight"])
            a = F.linear(h, w[p + "in_proj_a.weight"])
        tail = state.sections["gdn.conv"][slot]
        s = state.sections["gdn.S"][slot]
        if mode == "prefill":
            o = self._gdn_prefill_native(i, mixed, a, b, z, tail, s)
            if o is not None:
                return self._out_rows(o, w[p + "out_proj.weight"], parts)
        conv_w = w[p + "conv1d.weight"][:, 0, :]
        if mode == "verify":
            # The tail after each token: the K-1 inputs ending there, from the tail in place
            # and the block's inputs; the tail in place stays as it was.
            width = tail.shape[1]
            full = torch.cat([tail.to(mixed.dtype), mixed.transpose(0, 1)], dim=1)
            steps["gdn.conv"].append(full.unfold(1, width, 1)[:, 1:].transpose(0, 1)
                                     .to(tail.dtype))
            tail = tail.clone()
        mixed = kernels.causal_conv1d(mixed, tail, conv_w)
        q, k, v = torch.split(mixed, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
        beta = torch.sigmoid(b)
        g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"])
        if mode == "verify":
            o, states = kernels.recurrent_gated_delta_block(q, k, v, g, beta, s)
            steps["gdn.S"].append(states)
        else:
            o = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s)
        o = gated_rms_norm(o, z, w[p + "norm.weight"], c.rms_norm_eps)
        return self._out_rows(o.reshape(n, -1), w[p + "out_proj.weight"], parts)

    @staticmethod
    def _out_rows(o: torch.Tensor, weight: torch.Tensor,
                  parts: list[tuple[int, int]] | None) -> torch.Tensor | list[torch.Tensor]:
        """A mixer's out projection of every row, or of each part's rows (_layers)."""
        if parts is None:
            return F.linear(o, weight)
        return [F.linear(o[a:b], weight) for a, b in parts]

    def _gdn_prefill_native(self, i: int, mixed: torch.Tensor, a: torch.Tensor,
                            b: torch.Tensor, z: torch.Tensor, tail: torch.Tensor,
                            s: torch.Tensor) -> torch.Tensor | None:
        """A prefill chunk's GDN middle on the native kernel (csrc/gdn.c): the conv, the gates,
        the chunked delta rule and the gated norm in one call, where decode runs on the native
        kernels and the layer's operands fit it; None otherwise (the reference path). On tiny
        its torch path took some sixty ops a layer over [16, 4, 64, 64] blocks, 4 ms a layer at
        1k rows, for 0.1 GFLOP of work; the kernel does the same rule in a fraction of that."""
        if not (decode_ops.block() == 1 and self.dtype == torch.float32
                and self.state_dtype == torch.float32):
            return None
        layer = self._gdn_native(i)
        n, hv, dv = mixed.shape[0], self.config.linear_num_value_heads, \
            self.config.linear_value_head_dim
        z2 = z.reshape(n, hv * dv)
        a, b = (t if t.stride(-1) == 1 and t.dim() == 2 else t.reshape(n, hv).contiguous()
                for t in (a, b))
        if layer is None or not layer.fits(mixed, a, b, z2, [tail, s]):
            return None
        o = torch.empty(n, hv * dv, dtype=torch.float32)
        return o if layer.prefill(o, mixed, a, b, z2, tail, s) else None

    def _causal_mask(self, start: int, num_tokens: int) -> ChunkMask:
        """The additive mask of a chunk at ``start`` over keys [0, start + num_tokens): 0 where a
        query sees a key, -inf past its own position, as one line (ChunkMask). One a forward,
        for every attention layer: SDPA turns a boolean mask into an additive one in each call
        (35 ms a layer at 16k keys on tiny)."""
        end = start + num_tokens
        line = torch.zeros(num_tokens + end - 1, dtype=self.dtype, device=self.device)
        line[end:] = float("-inf")
        return ChunkMask(line, num_tokens, end)

    def _attention(self, i: int, h: torch.Tensor, state: ModelState, start: int,
                   cos: torch.Tensor, sin: torch.Tensor,
                   mask: ChunkMask | None,
                   parts: list[tuple[int, int]] | None = None
                   ) -> torch.Tensor | list[torch.Tensor]:
        """The layer's output rows, or where ``parts`` are given (_layers) those of each row
        range [a, b): its queries alone are formed and attend; every row's key and value are
        written."""
        c, w, p = self.config, self.w, f"layers.{i}.self_attn."
        slot = self._slot[i]
        n, hd = h.shape[0], c.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        rd = c.rotary_dim
        k = rms_norm(F.linear(h, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))
                     .view(n, nkv, hd), w[p + "k_norm.weight"], c.rms_norm_eps)
        v = F.linear(h, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(n, nkv, hd)
        cs, sn = cos[:, None, :], sin[:, None, :]
        k = torch.cat([k[..., :rd] * cs + rotate_half(k[..., :rd]) * sn, k[..., rd:]], dim=-1)
        kbuf, vbuf = state.views["K"].tensor[slot], state.views["V"].tensor[slot]
        end = start + n
        kbuf[:, start:end] = k.transpose(0, 1)
        vbuf[:, start:end] = v.transpose(0, 1)
        if parts is not None:
            # Each part's queries: the last row alone sees every key (no mask); the rows
            # before it are causal from row 0 (rows [0, n-1) of the mask, or is_causal's
            # top-left triangle where the chunk starts the sequence).
            return [self._attend(i, h[a:b], cs[a:b], sn[a:b], kbuf, vbuf, end,
                                 None if b == n or mask is None else mask.flipped(a, b),
                                 causal=b < n and mask is None)
                    for a, b in parts]
        return self._attend(i, h, cs, sn, kbuf, vbuf, end,
                            None if mask is None else mask.flipped(0, n),
                            causal=mask is None and n > 1)

    def _attend(self, i: int, h: torch.Tensor, cs: torch.Tensor, sn: torch.Tensor,
                kbuf: torch.Tensor, vbuf: torch.Tensor, end: int, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
        """Rows h's queries (their rotation cs, sn) over the keys [0, end) in place, gated, out
        projected. A ``mask`` is a ChunkMask's ``flipped`` view: the queries attend last row
        first beside it."""
        c, w, p = self.config, self.w, f"layers.{i}.self_attn."
        n, hd = h.shape[0], c.head_dim
        nh, rd = c.num_attention_heads, c.rotary_dim
        qg = F.linear(h, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(n, nh, 2 * hd)
        q, gate = torch.chunk(qg, 2, dim=-1)
        gate = gate.reshape(n, nh * hd)
        q = rms_norm(q, w[p + "q_norm.weight"], c.rms_norm_eps)
        q = torch.cat([q[..., :rd] * cs + rotate_half(q[..., :rd]) * sn, q[..., rd:]], dim=-1)
        # Chunk k attends over keys [0, end): the same shapes whether the rows below start were
        # computed now or restored from a cache. A decode token sees every key: no mask; a
        # first chunk of several rows is causal (no mask either, _layers).
        keys, values = kbuf[:, :end], vbuf[:, :end]
        if mask is not None:
            q = q.flip(0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, is_causal=causal,
                                             scale=hd ** -0.5, enable_gqa=True)
        out = out[0].transpose(0, 1)
        if mask is not None:  # the rows back in order, gathered into one contiguous copy
            out = out[torch.arange(n - 1, -1, -1, device=out.device)]
        out = out.reshape(n, nh * hd)
        out = out * torch.sigmoid(gate)
        return F.linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))

    # -- decode: one token for each of B sequences ------------------------------------------

    def _fuse_projections(self) -> dict[str, tuple[tuple[str, ...], tuple[int, ...],
                                                   torch.Tensor | None]]:
        """The projections decode runs as one matmul each (a GDN's in_proj, attention's k/q/v,
        an MLP's gate/up), with their weight as one tensor where the parts lie end to end."""
        c = self.config
        groups: dict[str, tuple[str, ...]] = {}
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            if kind == "linear_attention":
                a = p + "linear_attn."
                parts = (("in_proj_ba", "in_proj_qkvz") if c.model_type == "qwen3_next"
                         else ("in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z"))
                groups[a + "in_proj"] = tuple(f"{a}{n}.weight" for n in parts)
            else:
                a = p + "self_attn."
                groups[a + "kqv"] = tuple(f"{a}{n}.weight" for n in ("k_proj", "q_proj", "v_proj"))
            if not c.is_moe_layer(i):
                groups[p + "mlp.gate_up"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        return {key: (names, tuple(self.w[n].shape[0] for n in names),
                      _adjacent_rows([self.w[n] for n in names]))
                for key, names in groups.items()}

    def _decode_constants(self) -> dict[str, torch.Tensor]:
        """What decode would recompute from the weights every token: the norms' 1 + w, a GDN's
        -exp(A_log) and its conv taps in fp32 (the same values the prefill path computes)."""
        out = {}
        for name, t in self.w.items():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) \
                    or name == "norm.weight":
                out[name] = 1.0 + t.float()
            elif name.endswith("A_log"):
                out[name] = -t.float().exp()
            elif name.endswith("conv1d.weight"):
                out[name] = t[:, 0, :].float()
        return out

    def _decode_transposed(self) -> dict[str, torch.Tensor]:
        """Every matrix decode multiplies by, as the ``t()`` view rows_linear takes (a view a
        call made once), by weight name and by fused projection."""
        out = {name: t.t() for name, t in self.w.items() if t.dim() == 2}
        out.update({key: fused.t() for key, (_, _, fused) in self._fused.items()
                    if fused is not None})
        return out

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return kernels.rows_linear(x, self.w[name], self._wt[name])

    def _project(self, key: str, h: torch.Tensor) -> list[torch.Tensor]:
        names, sizes, fused = self._fused[key]
        if fused is None:
            return [self._linear(h, n) for n in names]
        return kernels.rows_linear(h, fused, self._wt[key]).split_with_sizes(sizes, 1)

    def forward_batch(self, states: list[ModelState], token_ids: list[int],
                      positions: list[int],
                      rope_offsets: list[int] | None = None,
                      choose: list[bool] | None = None) -> torch.Tensor | list:
        """One decode step for each of B independent sequences: token ``token_ids[b]`` at
        position ``positions[b]`` of ``states[b]`` (its rows below in place), whose row is
        written and sections advanced. Returns the fp32 logits ``[B, vocab]``.
        ``rope_offsets[b]`` (a sequence whose prompt held images: their delta) shifts only the
        rotary position; the row is still written at ``positions[b]``.

        Every projection, MLP and the head is one matmul over the B rows (the weights read once
        a step, kernels.rows_linear: a row's bits are its own); the conv, the recurrent step
        and attention run on each sequence's own sections and rows. A sequence's logits are the
        same bits alone (forward with decode=True is this at B = 1) and at any place of any
        batch. A MoE block runs each sequence's row alone: its router and grouped experts batch
        rows by expert, which is not invariant.

        On torch's matmuls a lone sequence carries a pad row from the embedding on (its own
        token again), so that every matmul gets its TORCH_BLOCK rows as they are rather than a
        copy padded at each call; the pad row's conv, recurrence and attention outputs are
        zeros (it has no state), and its results are dropped. A row's bits at those rows are
        its own whatever the other row holds, so the lone sequence's logits are those it gets
        in any batch. The native kernel needs no pad (decode_ops.block() is 1 there).

        ``choose[b]``: sequence b wants its greedy token alone (no logprobs, processors or
        grammar). With ``choose`` the result is a list: a `Chosen` (the token the full head's
        argmax gives, found through the head's screen, tandem.kernels.screen) where the native
        step screens, else that sequence's logits row."""
        for s, at in zip(states, positions):
            view = s.views["K"]
            if not 0 <= at < view.tensor.shape[view.token_axis]:
                # before any layer advances a state: a row past the window is never written
                raise IndexError(f"position {at} is outside a window of "
                                 f"{view.tensor.shape[view.token_axis]} rows")
        if self.graphs is not None and self.graphs.takes(self):
            out = self.graphs.decode(self, states, token_ids, positions, rope_offsets)
            return out if choose is None else list(out)
        n = len(states)
        embed = self.w["embed_tokens.weight"]
        block = decode_ops.block()
        if n == 1 and 0 <= token_ids[0] < embed.shape[0]:
            # the row and its pad, one view (x is never written in place); F.embedding refuses
            # an id out of range, where indexing would take a negative one from the end
            f = self._embed_file()
            row = f.gather(torch.tensor(token_ids[:1])) if f is not None else None
            x = (embed[token_ids[0]].expand(block, -1) if row is None
                 else row if block == 1 else row[0].expand(block, -1))
        else:
            ids = token_ids if n >= block else token_ids * block
            x = self._embedding(torch.tensor(ids, dtype=torch.long, device=self.device))
        turns = positions if rope_offsets is None else [p + o for p, o in
                                                          zip(positions, rope_offsets)]
        step = self._native_step()
        if step is not None and x.shape[0] == n and x.stride(1) == 1 and step.fits(states):
            # every layer and the head in one native call: the layer path's kernels, its bits
            cos, sin = self._native_rope(turns)
            out = self._screened(step, choose, lambda rows: step(
                x, states, positions, cos, sin, rows))
            return out if choose is None or isinstance(out, list) else list(out)
        # every sequence's sections and rows by layer slot, viewed once a step
        tails = [s.sections["gdn.conv"].unbind(0) for s in states]
        recur = [s.sections["gdn.S"].unbind(0) for s in states]
        keys = [s.views["K"].tensor for s in states]
        values = [s.views["V"].tensor for s in states]
        x = self._step_layers(x, n, turns, positions, keys, values, tails, recur, None)
        _, x = self._residual_norm(x, None, "norm.weight",
                                   decode_ops.block() == 1 and native_rows_fit(x))
        logits = self._linear(x, "lm_head.weight")
        logits = logits if x.shape[0] == n else logits[:n]
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return logits if choose is None else list(logits)

    def forward_ragged(self, states: list[ModelState], blocks: list[list[int]],
                       positions: list[int], rope_offsets: list[int] | None = None,
                       verify: list[bool] | None = None, choose: list[bool] | None = None,
                       tail: list[bool] | None = None
                       ) -> tuple[list, list[dict[str, torch.Tensor] | None]]:
        """One step over a ragged batch: sequence b forwards ``blocks[b]`` at positions
        ``positions[b]...``: one token (a decode: its row written, its sections advanced, as
        forward_batch) or a verify block of several (every row written, the sections in place
        left as they were, and each section's value after every position returned, as
        forward_verify; ``verify[b]`` says which, by default a block of more than one token).
        Returns each sequence's fp32 logits ``[len(blocks[b]), vocab]`` and its steps (None
        for a decode).

        Every projection and MLP is one rows_linear over all the batch's rows (the weights read
        once a step for every sequence, decodes and verify blocks together). A verify block's
        row runs the decode step's own arithmetic at its position: its conv and recurrent step
        on the state after the row before it (a copy kept per position: the steps), its
        attention over its sequence's keys up to itself. So a block's rows are, up to the head,
        the bits decoding its tokens one by one gives, and its steps are the sections those
        decodes leave. The head of the decode rows is rows_linear's (forward_batch's bits);
        that of the verify rows one ``torch.mm(W, X^T)`` for up to VERIFY_HEAD_ROWS of them,
        which reads the vocabulary matrix once for any number of rows and gives a row the
        same bits for every M from 2 to 39 on every head shape measured (248,320 x 64, 256 and
        1,024, fp32, 2 threads) where rows_linear reads it once a pair. A sequence's logits
        and steps are therefore the same bits alone (Engine.verify runs this at B = 1) and at
        any place of any batch. Batches of decodes only go to forward_batch: the same bits.

        ``choose[b]``: every row of sequence b wants its greedy token alone; where the native
        step screens them (at most head_screen.STEP_ROWS_MAX rows in the step), that sequence's
        entry is a list of `Chosen`, one a row, in place of its logits.

        ``tail[b]``: sequence b's block is a prefill's short tail (Engine.prefill_steps): its
        rows run as decode rows do, one after another in the waves, each on its sections in
        place (forward_tail's arithmetic); only its last row is read, and its entry is that
        row's `HeadRow`, its greedy token screened already where ``choose[b]`` asks for it.
        Only the native step runs a tail (``takes_tail``): elsewhere a ValueError, before any
        row is written."""
        tail = tail or [False] * len(blocks)
        verify = verify or [len(b) > 1 and not t for b, t in zip(blocks, tail)]
        if any(not b or (len(b) > 1 and not v and not t) or (v and t)
               for b, v, t in zip(blocks, verify, tail)):
            raise ValueError("a decode forwards one token, a verify block or a tail one or more")
        if any(tail):
            got = self._ragged_tails(states, blocks, positions, rope_offsets, verify, choose,
                                     tail)
            if got is None:
                raise ValueError("a tail runs on the native step only")
            return got
        if not any(verify):
            logits = self.forward_batch(states, [b[0] for b in blocks], positions,
                                        rope_offsets=rope_offsets, choose=choose)
            return ([[row] if isinstance(row, Chosen) else row[None] for row in logits],
                    [None] * len(blocks))
        if self.graphs is not None and self.graphs.takes(self):
            return self.graphs.verify(self, states, blocks, positions, rope_offsets, verify)
        ragged = _Ragged(states, blocks, verify, self.device)
        ids = [t for b in blocks for t in b]
        offsets = rope_offsets or [0] * len(blocks)
        at = [p + j for p, b in zip(positions, blocks) for j in range(len(b))]
        turns = [p + o + j for p, o, b in zip(positions, offsets, blocks) for j in range(len(b))]
        keys = [s.views["K"].tensor for s, b in zip(states, blocks) for _ in b]
        values = [s.views["V"].tensor for s, b in zip(states, blocks) for _ in b]
        x = self._embedding(torch.tensor(ids, dtype=torch.long, device=self.device))
        logits: list[torch.Tensor | None] = [None] * len(blocks)
        step = self._native_step()
        if step is not None and x.stride(1) == 1 and step.fits(states):
            # every layer and the head in one native call, the GDN middle in the waves the
            # layer path runs: its kernels in its order, its bits (decode rows and verify rows)
            cos, sin = self._native_rope(turns)
            wanted = None if choose is None else [c for c, b in zip(choose, blocks) for _ in b]
            rows = self._screened(step, wanted, lambda want: step.ragged(
                x, states, ragged, at, cos, sin, want))
            first = 0
            for b, block in enumerate(blocks):
                logits[b] = rows[first:first + len(block)]
                first += len(block)
            return logits, ragged.steps()
        x = self._step_layers(x, len(ids), turns, at, keys, values, None, None, ragged)
        _, x = self._residual_norm(x, None, "norm.weight",
                                   decode_ops.block() == 1 and native_rows_fit(x))
        if ragged.decode_rows:
            heads = self._linear(x[ragged.decode_index], "lm_head.weight").float()
            for row, (b, _) in zip(heads, (ragged.rows[r] for r in ragged.decode_rows)):
                logits[b] = row[None]
        # the verify rows' head a group of whole blocks at a time, each block's logits a view
        # of its group's result (no copy of rows x vocab floats)
        for group, idx in verify_head_groups(blocks, verify, self.device):
            res = self._verify_head(x[idx])
            at = 0
            for g in group:
                logits[g] = res[at:at + len(blocks[g])]
                at += len(blocks[g])
        return logits, ragged.steps()

    def _verify_head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of verify rows ``[M, vocab]`` fp32 (a transposed view): torch.mm(W, X^T)
        over at most VERIFY_HEAD_ROWS rows a call and at least 2 (a lone row twice, a last
        group reaching back), every call in the class that gives a row its own bits."""
        head, m = self.w["lm_head.weight"], x.shape[0]
        if decode_ops.block() == 1 and native_fits(x, head):
            # the native kernel: a verify row's logits are then the very bits its decode gets
            return native_rows(x, head)
        if m == 1:
            return torch.mm(head, x.expand(2, -1).transpose(0, 1))[:, :1].transpose(0, 1).float()
        if m <= VERIFY_HEAD_ROWS:
            return torch.mm(head, x.transpose(0, 1)).transpose(0, 1).float()
        parts = []
        for a in range(0, m, VERIFY_HEAD_ROWS):
            s = min(a, m - 2)
            part = torch.mm(head, x[s:a + VERIFY_HEAD_ROWS].transpose(0, 1)).transpose(0, 1)
            parts.append(part[a - s:])
        return torch.cat(parts).float()

    def _step_layers(self, x: torch.Tensor, n: int, turns: list[int], positions: list[int],
                     keys: list[torch.Tensor], values: list[torch.Tensor],
                     tails: list | None, recur: list | None,
                     ragged: "_Ragged | None", attend=None) -> torch.Tensor:
        """The layers of a step over ``n`` rows (x may carry a pad row past them): row r turns
        at ``turns[r]`` and writes its K/V row at ``positions[r]`` of ``keys[r]``/``values[r]``.
        The GDN layers run on ``tails``/``recur`` (a sequence a row, forward_batch) or on
        ``ragged``'s per-row states (forward_ragged). A captured step (models/graphs.py) gives
        ``turns`` as a device tensor and its own ``attend``, which reads positions from one."""
        c, k = self.config, self._k
        rows = x.shape[0]
        cos, sin = self._step_rope(turns, rows, n)
        cos, sin = cos[:, None, :], sin[:, None, :]
        # On the native kernels (fp32 on the CPU) each residual add runs with the norm after it
        # and the MLP's silu with its product, one call each (csrc/norms.c); torch's path keeps
        # its own ops, and its bits, as they were.
        fast = decode_ops.block() == 1 and native_rows_fit(x)
        out = None  # the last block's output, not yet added to x
        for i, kind in enumerate(c.layer_types):
            p = k[i]
            x, h = self._residual_norm(x, out, p + "input_layernorm.weight", fast)
            if kind == "linear_attention":
                slot = self._slot[i]
                if ragged is None:
                    h = self._gdn_rows(i, h, [t[slot] for t in tails], [t[slot] for t in recur])
                else:
                    h = self._gdn_rows(i, h, None, None, ragged)
            else:
                h = self._attention_rows(i, h, keys, values, positions, cos, sin, attend)
            x, h = self._residual_norm(x, h, p + "post_attention_layernorm.weight", fast)
            if c.is_moe_layer(i):
                out = torch.cat([self._moe(i, h[b:b + 1]) for b in range(n)]
                                + ([h.new_zeros(rows - n, h.shape[1])] if rows > n else []))
            else:
                gate, up = self._project(p + "mlp.gate_up", h)
                act = (native_ops.silu_mul_rows(gate, up) if fast and native_rows_fit(gate, up)
                       else each_row(F.silu, gate) * up)
                out = self._linear(act, p + "mlp.down_proj.weight")
        return x + out

    def _native_rope(self, turns: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``_step_rope(turns, n, n)`` for the native step (fp32 on the CPU), contiguous: each
        row taken from blocks of ROPE_BLOCK positions that _step_rope computed (each_row gives
        every row its bits alone, so a row is the same bits in a block as in a step), with
        numpy. A step's rotary rows cost some ten torch calls, each of which lets go of the GIL
        (ATen's bindings do): the event loop, woken by the last step's tokens, took it there
        and the step waited for it before its native call, where it would have run beside."""
        blocks = self.__dict__.setdefault("_rope_blocks", {})
        parts = []
        for t in turns:
            b = t // ROPE_BLOCK
            block = blocks.get(b)
            if block is None:
                if len(blocks) >= ROPE_BLOCKS_KEPT:
                    blocks.pop(next(iter(blocks)))  # the oldest computed
                cos, sin = self._step_rope(list(range(b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK)),
                                           ROPE_BLOCK, ROPE_BLOCK)
                block = blocks[b] = (cos.contiguous().numpy(), sin.contiguous().numpy())
            parts.append((block, t - b * ROPE_BLOCK))
        if len(parts) == 1:
            (cos, sin), i = parts[0]
            return torch.from_numpy(cos[i:i + 1]), torch.from_numpy(sin[i:i + 1])
        return (torch.from_numpy(np.stack([blk[0][i] for blk, i in parts])),
                torch.from_numpy(np.stack([blk[1][i] for blk, i in parts])))

    def _step_rope(self, turns, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's rotary cos and sin [rows, rd], row r's at ``turns[r]`` (a pad row past n
        row 0's), sin's first half negated: rotate_half(q) * sin as roll(q) * sin with the
        sign moved onto sin ((-a) * b and a * (-b) are the same bits)."""
        pos = (turns if isinstance(turns, torch.Tensor)
               else torch.tensor(turns, dtype=torch.float32, device=self.device))
        freqs = pos[:, None] * self.inv_freq[None, :]  # as _rope, a row a sequence
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = each_row(torch.cos, emb), each_row(torch.sin, emb)
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        if rows > n:
            cos, sin = cos.expand(rows, -1), sin.expand(rows, -1)
        if self.dtype != torch.float32:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        half = self.config.rotary_dim // 2
        return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def _ragged_tails(self, states: list[ModelState], blocks: list[list[int]],
                      positions: list[int], rope_offsets: list[int] | None,
                      verify: list[bool], choose: list[bool] | None, tail: list[bool]
                      ) -> tuple[list, list[dict[str, torch.Tensor] | None]] | None:
        """forward_ragged with tails among its blocks: one native step, as forward_ragged's
        native path runs it, where a tail's rows other than its last get no head at all and
        its last row's final normed row (``h_out``) makes its HeadRow. None where the native
        step does not take these sequences (nothing is then written)."""
        if not self.takes_tail(states):
            return None
        step = self._native_step()
        ids = [t for b in blocks for t in b]
        x = self._embedding(torch.tensor(ids, dtype=torch.long, device=self.device))
        if x.stride(1) != 1:
            return None
        ragged = _Ragged(states, blocks, verify, self.device)
        offsets = rope_offsets or [0] * len(blocks)
        at = [p + j for p, b in zip(positions, blocks) for j in range(len(b))]
        cos, sin = self._native_rope([p + o + j for p, o, b in zip(positions, offsets, blocks)
                                      for j in range(len(b))])
        # A row's wish: True its greedy token through the screen, False its logits, None no
        # head (a tail's rows before its last; its last where nothing screens it: the HeadRow
        # computes its logits when read).
        wishes = [bool(choose[b]) if choose is not None else False for b in range(len(blocks))]
        asked = sum(1 if tail[b] else len(block)
                    for b, block in enumerate(blocks) if wishes[b])
        # past the screen's rows the full head, read once for every row, is cheaper
        screens = step.screen is not None and asked <= head_screen.STEP_ROWS_MAX
        want: list[bool | None] = []
        for b, block in enumerate(blocks):
            if tail[b]:
                want += [None] * (len(block) - 1) + [True if wishes[b] and screens else None]
            else:
                want += [wishes[b] and screens] * len(block)
                if wishes[b] and not screens:
                    self.screen_counts["full"] += len(block)
        h = torch.empty(len(ids), x.shape[1], dtype=torch.float32)
        logits, tokens = step.ragged(x, states, ragged, at, cos, sin, want, h_out=h)
        out: list = []
        first = 0
        for b, block in enumerate(blocks):
            rows = range(first, first + len(block))
            first += len(block)
            if tail[b]:
                r = rows[-1]
                row = h[r:r + 1].clone()
                box = []
                if tokens[r] >= 0:
                    box = [(row.clone(), Chosen(tokens[r]))]
                    self.screen_counts["screened"] += 1
                head = HeadRow(row, lambda v: self._prefill_head(v)[0], self._screen_row, box)
                if tokens[r] == -1:
                    # the screen did not take the row: the step wrote its logits (tandem_rows_f32,
                    # the bits _prefill_head gives), which the HeadRow then reads
                    self.screen_counts["full"] += 1
                    head._logits = logits[r].clone()
                out.append(head)
                continue
            got = []
            for r in rows:
                if tokens[r] >= 0:
                    got.append(Chosen(tokens[r]))
                    self.screen_counts["screened"] += 1
                else:
                    got.append(logits[r])
                    if want[r] is True:
                        self.screen_counts["full"] += 1
            out.append(got if any(want[r] for r in rows) else logits[rows[0]:rows[-1] + 1])
        return out, ragged.steps()

    def takes_tail(self, states: list[ModelState]) -> bool:
        """Whether a prefill's tail on these sequences runs in a step (forward_ragged's
        ``tail``, forward_tail): where the native step runs them."""
        step = self._native_step()
        return (step is not None and not (self.graphs is not None and self.graphs.takes(self))
                and step.fits(states))

    def forward_tail(self, state: ModelState, token_ids: list[int], start: int,
                     rope_offset: int = 0) -> HeadRow | None:
        """A short prefill past the rows in place, run as decode runs its tokens: ``token_ids``
        at positions ``start...`` in one native step, row j's conv and recurrent step on the
        sections as row j - 1 left them (in place, wave by wave), its attention over the rows
        up to itself. The rows and sections are therefore the bits that decoding those tokens
        one by one writes (tests/models/test_forward_tail.py), which is the greedy gate's
        arithmetic: the engine takes this path only where the rows it resumed on are held to
        that gate already (Engine.prefill_steps). Returns the last position's `HeadRow` (no
        row gets a head here: the greedy token is screened when read, as a prefill's), or None
        where the native step does not run this model or state (nothing is then written).
        The step forward_ragged runs a batch's tail in, with this one sequence."""
        if not token_ids:
            return None
        got = self._ragged_tails([state], [list(token_ids)], [start], [rope_offset], [False],
                                 None, [True])
        return None if got is None else got[0][0]

    def _native_step(self) -> "native_step.NativeStep | None":
        """The whole decode step as one native call (tandem.kernels.step), where this model's
        decode is all the native kernels' (None elsewhere, or with the step turned off)."""
        if not native_step.enabled() or decode_ops.block() != 1:
            return None
        if "_native_plan" not in self.__dict__:  # built on the first step, kept (or None)
            self._native_plan = plan = native_step.NativeStep.build(self)
            if plan is not None and head_screen.enabled():
                t0 = time.perf_counter()
                screen = head_screen.build(self.w["lm_head.weight"],
                                           self._rows_file("lm_head.weight"))
                plan.set_screen(screen)
                log.info("head_screen_built", nbytes=screen.nbytes,
                         seconds=round(time.perf_counter() - t0, 2))
        return self._native_plan

    def _screened(self, step: "native_step.NativeStep", wanted: list[bool] | None,
                  run: Callable[[list[bool] | None], object]) -> torch.Tensor | list:
        """The native step's rows, ``run(None)``'s logits, or where rows want their greedy token
        alone (``wanted``, one a row) and the step screens at most head_screen.STEP_ROWS_MAX of
        them (past that the full head, read once for every row, is cheaper), a list: a `Chosen`
        where the screen answered, the logits row elsewhere. Counted in screen_counts."""
        asked = 0 if wanted is None else sum(wanted)
        if not asked or asked > head_screen.STEP_ROWS_MAX or step.screen is None:
            self.screen_counts["full"] += asked
            return run(None)
        logits, tokens = run(wanted)
        rows = [Chosen(t) if t >= 0 else logits[r] for r, t in enumerate(tokens)]
        chosen = sum(isinstance(row, Chosen) for row in rows)
        self.screen_counts["screened"] += chosen
        self.screen_counts["full"] += asked - chosen
        return rows

    def _screen_row(self, row: torch.Tensor) -> Chosen | None:
        """A prefill's last row's greedy token through the head's screen: the argmax of the
        logits ``_prefill_head`` gives it (the native kernel's, whose bits the screen's exact
        rows are); None where there is no screen or it does not take the row."""
        step = self._native_step()
        head = self.w["lm_head.weight"]
        if step is None or step.screen is None or not native_fits(row, head):
            return None
        if "_screen_scratch" not in self.__dict__:  # the screened logits, kept for the next
            self._screen_scratch = torch.empty(head.shape[0], dtype=torch.float32)
        token = head_screen.argmax_rows(row, head, step.screen,
                                        approx=self._screen_scratch).tokens[0]
        self.screen_counts["screened" if token >= 0 else "full"] += 1
        return Chosen(token) if token >= 0 else None

    def prepare_decode(self) -> None:
        """Build what decode's first step would (the native step's plan, the head's screen), so
        that no request waits for it."""
        self._native_step()

    def _residual_norm(self, x: torch.Tensor, h: torch.Tensor | None, gain: str,
                       fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + h`` (x itself when h is None) and its rms norm by ``gain``."""
        if fast and (h is None or native_rows_fit(h)):
            if h is None:
                return x, native_ops.rms_rows(x, self._gain[gain], self._eps_value)
            return native_ops.add_rms_rows(x, h, self._gain[gain], self._eps_value)
        x = x if h is None else x + h
        return x, _rms_rows(x, self._gain[gain], self._eps)

    def _gdn_rows(self, i: int, h: torch.Tensor, tails: list[torch.Tensor] | None,
                  recur: list[torch.Tensor] | None,
                  ragged: "_Ragged | None" = None) -> torch.Tensor:
        c, w, p, slot, hk, hv, dk, dv = self._gdn_dims(i)
        n = h.shape[0]
        if c.model_type == "qwen3_next":
            ratio = hv // hk
            ba, qkvz = self._project(p + "in_proj", h)
            q, k, v, z = torch.split(qkvz.reshape(n, hk, -1),
                                     [dk, dk, ratio * dv, ratio * dv], dim=-1)
            mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
            b, a = torch.split(ba.reshape(n, hk, 2 * ratio), [ratio, ratio], dim=-1)
            b, a = b.reshape(n, hv), a.reshape(n, hv)
        else:
            a, b, mixed, z = self._project(p + "in_proj", h)
        conv_w = self._gain[p + "conv1d.weight"]
        if decode_ops.block() == 1 and self.dtype == torch.float32 \
                and self.state_dtype == torch.float32:
            # the native kernel's whole middle (csrc/gdn.c), one call a layer (a wave of a
            # ragged step); forward_batch and forward_ragged call the same one
            layer = self._gdn_native(i)
            z2 = z if z.dim() == 2 else z.reshape(n, hv * dv)
            sections = (tails + recur if ragged is None else
                        [t[name][slot] for t in ragged.sections for name in t])
            if layer is not None and layer.fits(mixed, a, b, z2, sections):
                o = torch.empty(n, hv * dv, dtype=torch.float32)
                if ragged is None:
                    layer(o, None, mixed, a, b, z2, (tails, tails), (recur, recur))
                    if n > len(tails):  # a pad row (none on the native path): row 0's, as ever
                        o[len(tails):] = o[0]
                else:
                    ragged.run_native(lambda rows, t, s: layer(o, rows, mixed, a, b, z2, t, s),
                                      slot)
                return self._linear(o, p + "out_proj.weight")
        if ragged is None:
            mixed = kernels.causal_conv1d_rows(mixed, tails, conv_w)
        else:
            mixed = ragged.run(lambda x, s: kernels.causal_conv1d_rows(x, s, conv_w),
                               "gdn.conv", slot, (mixed,))
        if mixed.dtype != torch.float32:
            mixed = mixed.float()
        kd = c.key_dim
        # reference.l2norm over q and k at once (the same per-head rows), its constants as
        # tensors (a Python float costs a conversion a call; the same bits); heads repeated
        # after it, which gives the same values
        qk = mixed[:, :2 * kd].reshape(n, 2 * hk, dk)
        qk = qk * torch.rsqrt((qk * qk).sum(dim=-1, keepdim=True) + self._l2_eps)
        q, k = qk[:, :hk], qk[:, hk:]
        if hv != hk:
            q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
        q = q * self._q_scale
        v = mixed[:, 2 * kd:].reshape(n, hv, dv)
        beta = each_row(torch.sigmoid, b)
        if beta.dtype != torch.float32:
            beta = beta.float()
        neg_a, dt_bias = self._gain[p + "A_log"], w[p + "dt_bias"]
        # exp(-exp(A_log) * softplus(a + dt_bias)); each_row takes one op at a time: only the
        # add reads a's rows where they lie
        decay = each_row(torch.exp, neg_a * each_row(F.softplus, (a if a.dtype == torch.float32
                                                                  else a.float()) + dt_bias))
        if ragged is None:
            o = kernels.recurrent_gated_delta_rows(q, k, v, decay, beta, recur)
        else:
            o = ragged.run(kernels.recurrent_gated_delta_rows, "gdn.S", slot,
                           (q, k, v, decay, beta))
        # gated_rms_norm, its silu a row at a time
        of = o if self.dtype == torch.float32 else o.to(self.dtype).float()
        of = of * torch.rsqrt(_mean_last(of * of).add_(self._eps))
        if self.dtype != torch.float32:
            of = of.to(self.dtype)
        zf = z.reshape(n, hv, dv)
        o = w[p + "norm.weight"] * of * each_row(F.silu, zf if zf.dtype == torch.float32
                                                  else zf.float())
        if o.dtype != self.dtype:
            o = o.to(self.dtype)
        return self._linear(o.reshape(n, -1), p + "out_proj.weight")

    def _gdn_native(self, i: int) -> "decode_ops.GdnLayer | None":
        """Layer i's constants for the native GDN middle, built on its first decode step (None
        where they do not fit it)."""
        layers = self.__dict__.setdefault("_gdn_layers", {})
        if i not in layers:
            c, w, p, _, hk, hv, dk, dv = self._gdn_dims(i)
            layers[i] = decode_ops.GdnLayer.build(
                (self._gain[p + "conv1d.weight"], self._gain[p + "A_log"], w[p + "dt_bias"],
                 w[p + "norm.weight"]), (hk, hv, dk, dv), (1e-6, dk ** -0.5, c.rms_norm_eps))
        return layers[i]

    def _attention_rows(self, i: int, h: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], positions: list[int], cos: torch.Tensor,
                        sin: torch.Tensor, attend=None) -> torch.Tensor:
        c, w, p = self.config, self.w, f"layers.{i}.self_attn."
        slot = self._slot[i]
        n, hd = h.shape[0], c.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        k, qg, v = self._project(p + "kqv", h)
        if c.attention_bias:
            k, qg, v = (t + w[f"{p}{name}.bias"] for t, name in
                        ((k, "k_proj"), (qg, "q_proj"), (v, "v_proj")))
        if (attend is None and decode_ops.block() == 1 and native_rows_fit(qg, k, v)
                and cos.dtype == torch.float32):
            # one native call: the norms, the rotation, the row writes, attention and its gate
            out = native_ops.attention_rows(
                qg, k, v, nh, nkv, hd, self._gain[p + "q_norm.weight"],
                self._gain[p + "k_norm.weight"], self._eps_value, cos[:, 0].contiguous(),
                sin[:, 0].contiguous(), [t[slot] for t in keys[:n]],
                [t[slot] for t in values[:n]], positions, hd ** -0.5)
            out = self._linear(out, p + "o_proj.weight")
            return out + w[p + "o_proj.bias"] if c.attention_bias else out
        qg = qg.view(n, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        # a copy, as the sigmoid read it before (on its view, a head at a time, it rounds a
        # head dim that is no multiple of the loop's step otherwise)
        gate = gate.reshape(n, nh * hd)
        q = _rms_rows(q, self._gain[p + "q_norm.weight"], self._eps)
        k = _rms_rows(k.reshape(n, nkv, hd), self._gain[p + "k_norm.weight"], self._eps)
        v = v.reshape(n, nkv, hd)
        rd, half = c.rotary_dim, c.rotary_dim // 2
        # q, k fresh from the norms: rotated in place
        qr, kr = q[..., :rd], k[..., :rd]
        qr.copy_(qr * cos + qr.roll(half, -1) * sin)
        kr.copy_(kr * cos + kr.roll(half, -1) * sin)
        q5 = q[:, None, :, None]  # [R, 1, nh, 1, hd]: row b is SDPA's [1, nh, 1, hd]
        scale = hd ** -0.5
        # a captured step's attention reads the positions from the device (models/graphs.py)
        out = [] if attend is None else attend(slot, q5, k, v, keys, values, scale)
        for b, at in enumerate(positions if attend is None else ()):
            kbuf, vbuf = keys[b][slot], values[b][slot]
            kbuf[:, at] = k[b]
            vbuf[:, at] = v[b]
            # A decode token sees every key of its own sequence: no mask.
            out.append(F.scaled_dot_product_attention(
                q5[b], kbuf[None, :, :at + 1], vbuf[None, :, :at + 1],
                scale=scale, enable_gqa=True))
        out = torch.stack(out + out[:1] * (n - len(positions)))  # [R, 1, nh, 1, hd]
        out = out.view(n, nh * hd) * each_row(torch.sigmoid, gate)
        out = self._linear(out, p + "o_proj.weight")
        return out + w[p + "o_proj.bias"] if c.attention_bias else out


def verify_head_groups(blocks: list[list[int]], verify: list[bool],
                       device) -> list[tuple[list[int], torch.Tensor]]:
    """The verify blocks of a ragged step in groups of whole blocks of at most VERIFY_HEAD_ROWS
    rows (a block over it alone), each with the index of its rows among the step's."""
    first = [0]
    for b in blocks:
        first.append(first[-1] + len(b))
    out: list[tuple[list[int], torch.Tensor]] = []
    group: list[int] = []
    for b in [b for b, v in enumerate(verify) if v] + [None]:
        if b is None or (group and sum(len(blocks[g]) for g in group) + len(blocks[b])
                         > VERIFY_HEAD_ROWS):
            if group:
                idx = torch.cat([torch.arange(first[g], first[g + 1]) for g in group])
                out.append((group, idx.to(device)))
            group = []
        if b is not None:
            group.append(b)
    return out


# The most verify rows one head call takes (torch.mm(W, X^T) gave a row the same bits for every
# M from 2 to 39 measured; past it the call splits, a last group reaching back to 2 rows).
VERIFY_HEAD_ROWS = 32


class _Ragged:
    """A ragged step's rows and states: the rows of sequence b lie together, in order, a decode
    one row and a verify block one a position. The per-sequence kernels (the conv, the
    recurrent step) run in waves, wave t taking every sequence's row t, so that a block's row
    t runs on the state its row t - 1 left: a decode on its sections in place (advanced), a
    verify row on ``work[b][name][t]``, a copy of the state before it, kept (the steps)."""

    def __init__(self, states: list[ModelState], blocks: list[list[int]], verify: list[bool],
                 device, work: list[dict[str, torch.Tensor] | None] | None = None):
        """``work``: the verify blocks' copies, given (a captured step's, models/graphs.py,
        which lie where its graph reads them); by default made here."""
        self.sections = [{name: s.sections[name].unbind(0) for name in ("gdn.conv", "gdn.S")}
                         for s in states]
        self.work: list[dict[str, torch.Tensor] | None] = work if work is not None else [
            {name: s.sections[name].new_empty((len(b),) + tuple(s.sections[name].shape))
             for name in ("gdn.conv", "gdn.S")} if v else None
            for s, b, v in zip(states, blocks, verify)]
        self.rows: list[tuple[int, int]] = [(b, j) for b, blk in enumerate(blocks)
                                            for j in range(len(blk))]
        self.decode_rows = [r for r, (b, _) in enumerate(self.rows) if self.work[b] is None]
        self.verify_rows = [r for r, (b, _) in enumerate(self.rows) if self.work[b] is not None]
        self.decode_index = torch.tensor(self.decode_rows, dtype=torch.long, device=device)
        waves: dict[int, list[int]] = {}
        for r, (_, j) in enumerate(self.rows):
            waves.setdefault(j, []).append(r)
        self.waves = [(wave, torch.tensor(wave, dtype=torch.long, device=device))
                      for _, wave in sorted(waves.items())]

    def run(self, fn, name: str, slot: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``fn(*rows of inputs, states)`` wave by wave; its outputs at their rows."""
        out = None
        for wave, idx in self.waves:
            states = []
            for r in wave:
                b, j = self.rows[r]
                work = self.work[b]
                if work is None:
                    states.append(self.sections[b][name][slot])
                    continue
                dst = work[name][j, slot]
                dst.copy_(self.sections[b][name][slot] if j == 0 else work[name][j - 1, slot])
                states.append(dst)
            got = fn(*(t[idx] for t in inputs), states)
            if out is None:
                out = got.new_empty((len(self.rows),) + tuple(got.shape[1:]))
            out[idx] = got
        return out

    def run_native(self, fn, slot: int) -> None:
        """``fn(rows, (tails in, tails out), (states in, states out))`` wave by wave (the native
        GDN middle, which reads a state from one tensor and writes it to another): a decode row
        advances its sections in place, a verify row t reads the state its row t - 1 left (its
        sequence's, at t = 0) and writes ``work[b][name][t]``, so no copy is made before it."""
        for wave, _ in self.waves:
            pairs = {"gdn.conv": ([], []), "gdn.S": ([], [])}
            for r in wave:
                b, j = self.rows[r]
                work = self.work[b]
                for name, (src, dst) in pairs.items():
                    here = self.sections[b][name][slot]
                    if work is None:
                        src.append(here)
                        dst.append(here)
                    else:
                        src.append(here if j == 0 else work[name][j - 1, slot])
                        dst.append(work[name][j, slot])
            fn(wave, pairs["gdn.conv"], pairs["gdn.S"])

    def steps(self) -> list[dict[str, torch.Tensor] | None]:
        return list(self.work)


_SCALARS: dict[float, torch.Tensor] = {}


def _scalar(value: float) -> torch.Tensor:
    """``value`` as a 0-dim fp32 tensor: an op on a Python float wraps it into a tensor each
    call (about 1 us, as much as the op on a decode row); the 0-dim tensor gives the same bits
    on fp32 operands."""
    t = _SCALARS.get(value)
    if t is None:
        t = _SCALARS[value] = torch.tensor(value, dtype=torch.float32)
    return t


def _fp8_on(device: torch.device) -> bool:
    from tandem import devices

    return devices.has_fp8_matmul(device)


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1, keepdim=True)`` for fp32 x, as torch computes it on a CPU (a sum, then a
    division by the count: the same bits) at half its cost; by a power of two the division is
    a product by the exact reciprocal."""
    count = x.shape[-1]
    op, by = _DIVIDE.get(count) or _divide_by(count)
    return op(x.sum(-1, keepdim=True), by)


_DIVIDE: dict[int, tuple] = {}


def _divide_by(count: int) -> tuple:
    if count & (count - 1) == 0:
        out = (torch.Tensor.mul_, _scalar(1.0 / count))
    else:
        out = (torch.Tensor.div_, _scalar(float(count)))
    _DIVIDE[count] = out
    return out


def _rms_rows(x: torch.Tensor, gain: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """rms_norm with its 1 + w computed once (``gain``, fp32), over the last axis of each row;
    ``eps`` a 0-dim fp32 tensor."""
    xf = x if x.dtype == torch.float32 else x.float()
    op, by = _DIVIDE.get(xf.shape[-1]) or _divide_by(xf.shape[-1])
    # xf * xf: pow(2)'s bits
    out = xf * torch.rsqrt(op((xf * xf).sum(-1, keepdim=True), by).add_(eps)) * gain
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _adjacent_rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[sum of rows, K]`` tensor over the parts' own bytes when they lie end to end in
    memory, else None (decode then runs a matmul a part). A safetensors file stores a layer's
    tensors in name order, so in_proj_a, _b, _qkv, _z and gate_proj, up_proj are adjacent in a
    checkpoint mapped as it is; k/q/v are not (o_proj and q_norm lie between). Nothing is
    copied, so the model holds no byte more: the result aliases the parts, which stay in
    ``self.w`` (prefill reads them there) for the model's life and keep that memory alive."""
    first = parts[0]
    cols = first.shape[-1]
    if not all(type(t) is torch.Tensor and t.dim() == 2 and t.shape[1] == cols
               and t.dtype == first.dtype and t.device.type == "cpu" and t.is_contiguous()
               for t in parts):  # an FP8 weight (models/fp8.py) multiplies alone
        return None
    if any(b.data_ptr() != a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])):
        return None
    rows = sum(t.shape[0] for t in parts)
    nbytes = rows * cols * first.element_size()
    if nbytes <= first.untyped_storage().nbytes() - first.storage_offset() * first.element_size():
        return first.as_strided((rows, cols), (cols, 1))  # one storage holds them all
    buf = (ctypes.c_byte * nbytes).from_address(first.data_ptr())
    return torch.frombuffer(buf, dtype=first.dtype).view(rows, cols)
