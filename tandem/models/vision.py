"""Qwen3.5's vision tower and the 3-D rotary positions (mRoPE) of a prompt with images.

The tower (transformers' Qwen3_5VisionModel, checkpoint names ``model.visual.*``):

- the patch embedding, a Conv3d whose kernel equals its stride (temporal patch x patch x
  patch), which on the processor's flattened patches is one linear map a patch;
- a learned square grid of position embeddings, bilinearly resampled (align_corners) to the
  image's grid of patches and added;
- ``depth`` pre-norm ViT blocks (LayerNorm, attention over one frame's patches with 2-D rotary:
  the first half of each head's frequencies turn with the patch's row, the second with its
  column; LayerNorm, a GELU-tanh MLP);
- the merger: LayerNorm a patch, then each ``merge x merge`` block of patches (adjacent rows,
  the processor's block order) concatenated and mapped by a GELU MLP into the language
  model's width. One output row is one placeholder token of the prompt.

The positions (transformers' Qwen3_5Model.get_rope_index): a text token at rope position p has
(p, p, p); an image that starts at rope position s with a merged grid of gh x gw has, for the
row at (r, c) of that grid, (s, s + r, s + c), and the text after it goes on at
s + max(gh, gw). A prompt's positions end ``delta`` = (its last position + 1 - its length) away
from its row index, and every later token (decode, or the next turn's text) is at its row index
plus ``delta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from tandem.models.base import ModelError

if TYPE_CHECKING:
    from tandem.models.image_processor import ImageProcessorConfig

VISUAL_PREFIXES = ("model.visual.", "visual.")  # transformers v5's layout, and the older one


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: dict) -> "VisionConfig":
        try:
            rope = raw.get("rope_parameters") or {}
            if rope.get("rope_type", "axial") != "axial":
                raise ModelError(f"vision_config rope_type {rope['rope_type']!r} is not "
                                 f"implemented; the tower turns axial 2-D rotary")
            out = cls(depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]),
                      intermediate_size=int(raw["intermediate_size"]),
                      num_heads=int(raw["num_heads"]), in_channels=int(raw.get("in_channels", 3)),
                      patch_size=int(raw["patch_size"]),
                      temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                      spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                      out_hidden_size=int(raw["out_hidden_size"]),
                      num_position_embeddings=int(raw["num_position_embeddings"]),
                      hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
                      rope_theta=float(rope.get("rope_theta", 10000.0)))
        except KeyError as exc:
            raise ModelError(f"vision_config lacks {exc.args[0]!r}") from exc
        if out.hidden_act not in _ACT:
            raise ModelError(f"vision_config hidden_act {out.hidden_act!r} is not implemented; "
                             f"the tower computes {', '.join(_ACT)}")
        if out.hidden_size % out.num_heads or (out.hidden_size // out.num_heads) % 4:
            raise ModelError("vision_config hidden_size / num_heads must be a multiple of 4")
        side = int(out.num_position_embeddings ** 0.5)
        if side * side != out.num_position_embeddings:
            raise ModelError("vision_config num_position_embeddings must be a square")
        return out

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, m = self.hidden_size, self.intermediate_size, self.merged_dim
        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, self.in_channels, self.temporal_patch_size,
                                        self.patch_size, self.patch_size),
            "patch_embed.proj.bias": (h,),
            "pos_embed.weight": (self.num_position_embeddings, h),
            "merger.norm.weight": (h,), "merger.norm.bias": (h,),
            "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
            "merger.linear_fc2.weight": (self.out_hidden_size, m),
            "merger.linear_fc2.bias": (self.out_hidden_size,),
        }
        for b in range(self.depth):
            p = f"blocks.{b}."
            shapes.update({
                p + "norm1.weight": (h,), p + "norm1.bias": (h,),
                p + "norm2.weight": (h,), p + "norm2.bias": (h,),
                p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
                p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                p + "mlp.linear_fc1.weight": (i, h), p + "mlp.linear_fc1.bias": (i,),
                p + "mlp.linear_fc2.weight": (h, i), p + "mlp.linear_fc2.bias": (h,),
            })
        return shapes


_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def visual_name(name: str) -> str | None:
    """A checkpoint tensor's name in the tower, or None for one that is not the tower's."""
    for prefix in VISUAL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionTower:
    """The encoder of one image (or clip) at a time: patches in, prompt rows out."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        out = {}
        for name, shape in config.expected_shapes().items():
            t = weights.get(name)
            if t is None:
                raise ModelError(f"checkpoint lacks vision tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ModelError(f"vision tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {shape}")
            out[name] = t.to(dtype).contiguous()
        # The Conv3d's kernel is its stride: over a flattened patch it is this one matrix.
        out["patch_embed.proj.weight"] = out["patch_embed.proj.weight"].reshape(
            config.hidden_size, config.patch_dim)
        self.w = out
        self._act = _ACT[config.hidden_act]
        spatial = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.side = int(config.num_position_embeddings ** 0.5)

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size ** 2

    def encode(self, pixel_values, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[t * h * w, patch_dim]`` patches (image_processor.preprocess's) of one image to its
        ``[num_tokens, out_hidden_size]`` prompt rows, in the model's dtype."""
        c = self.config
        t, h, w = (int(v) for v in grid)
        m = c.spatial_merge_size
        x = torch.as_tensor(pixel_values)
        if x.shape != (t * h * w, c.patch_dim) or h % m or w % m:
            raise ModelError(f"pixel_values {tuple(x.shape)} do not fit the grid {grid} "
                             f"({c.patch_dim} values a patch, sides a multiple of {m})")
        x = F.linear(x.to(self.dtype), self.w["patch_embed.proj.weight"],
                     self.w["patch_embed.proj.bias"])
        rows, cols = _block_order(h, w, m)
        x = x + self._position_embeddings(rows, cols, h, w).repeat(t, 1).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        cos, sin = cos.repeat(t, 1), sin.repeat(t, 1)
        for b in range(c.depth):
            x = self._block(b, x, cos, sin, t)
        w_ = self.w
        x = F.layer_norm(x, (c.hidden_size,), w_["merger.norm.weight"], w_["merger.norm.bias"],
                         1e-6).reshape(-1, c.merged_dim)
        x = F.gelu(F.linear(x, w_["merger.linear_fc1.weight"], w_["merger.linear_fc1.bias"]))
        return F.linear(x, w_["merger.linear_fc2.weight"], w_["merger.linear_fc2.bias"])

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, h: int,
                             w: int) -> torch.Tensor:
        """The learned grid resampled to h x w as F.interpolate(bilinear, align_corners=True)
        would, one patch at a time: four taps and their weights (transformers'
        get_vision_interpolation_indices_and_weights)."""
        side = self.side

        def taps(index: torch.Tensor, size: int):
            src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(0, 2)
            at = (floor.long()[:, None] + offsets).clamp(0, side - 1)
            weight = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
            return at, weight

        h_at, h_weight = taps(rows, h)
        w_at, w_weight = taps(cols, w)
        index = (h_at[:, :, None] * side + w_at[:, None, :]).reshape(-1, 4)
        weight = (h_weight[:, :, None] * w_weight[:, None, :]).reshape(-1, 4)
        table = self.w["pos_embed.weight"]
        return (F.embedding(index, table) * weight[:, :, None].to(table.dtype)).sum(1)

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor):
        freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * self.inv_freq  # [N, 2, f]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1)
        return emb.cos(), emb.sin()

    def _block(self, b: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               frames: int) -> torch.Tensor:
        c, w, p = self.config, self.w, f"blocks.{b}."
        n, nh, hd = x.shape[0], c.num_heads, c.head_dim
        h = F.layer_norm(x, (c.hidden_size,), w[p + "norm1.weight"], w[p + "norm1.bias"], 1e-6)
        q, k, v = F.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]) \
            .reshape(n, 3, nh, hd).permute(1, 0, 2, 3).unbind(0)
        # rotary in fp32 whatever the dtype, as transformers' apply_rotary_pos_emb_vision
        cs, sn = cos[:, None, :], sin[:, None, :]
        qf, kf = q.float(), k.float()
        q = (qf * cs + _rotate_half(qf) * sn).to(q.dtype)
        k = (kf * cs + _rotate_half(kf) * sn).to(k.dtype)
        # each frame attends over its own patches, unmasked
        per = n // frames
        out = torch.cat([
            F.scaled_dot_product_attention(q[a:a + per].transpose(0, 1)[None],
                                           k[a:a + per].transpose(0, 1)[None],
                                           v[a:a + per].transpose(0, 1)[None],
                                           scale=hd ** -0.5)[0].transpose(0, 1)
            for a in range(0, n, per)]).reshape(n, nh * hd)
        x = x + F.linear(out, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = F.layer_norm(x, (c.hidden_size,), w[p + "norm2.weight"], w[p + "norm2.bias"], 1e-6)
        h = self._act(F.linear(h, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]))
        return x + F.linear(h, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])


@dataclass
class ImageSupport:
    """What a checkpoint with a tower brings: the tower, its processor's rules and the
    placeholder ids its chat template writes."""

    tower: VisionTower
    processor: "ImageProcessorConfig"
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def load(cls, model_dir, raw: dict, weights: dict[str, torch.Tensor],
             dtype: torch.dtype) -> "ImageSupport":
        from tandem.models.image_processor import ImageError, ImageProcessorConfig

        cfg = VisionConfig.from_dict(raw["vision_config"])
        try:
            processor = ImageProcessorConfig.from_dir(model_dir, raw["vision_config"])
        except ImageError as exc:
            raise ModelError(str(exc)) from exc
        if (processor.merge_size != cfg.spatial_merge_size
                or processor.temporal_patch_size != cfg.temporal_patch_size):
            raise ModelError("preprocessor_config.json's merge or temporal patch size is not "
                             "the vision tower's")
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        if cfg.out_hidden_size != int(text["hidden_size"]):
            raise ModelError(f"vision_config out_hidden_size {cfg.out_hidden_size} is not the "
                             f"language model's hidden_size {text['hidden_size']}")
        # Qwen3.5's ids where a config leaves them out (transformers' Qwen3_5Config defaults)
        return cls(tower=VisionTower(cfg, weights, dtype), processor=processor,
                   image_token_id=int(raw.get("image_token_id", 248056)),
                   vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
                   vision_end_token_id=int(raw.get("vision_end_token_id", 248054)))

    def describe(self) -> str:
        c = self.tower.config
        return (f"depth={c.depth} width={c.hidden_size} patch={c.patch_size} "
                f"merge={c.spatial_merge_size}")


def _block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in the processor's order: block row, block column, row in
    block, column in block."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(1, 2).flatten(),
            cols.reshape(shape).transpose(1, 2).flatten())


# -- a prompt with images ------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder rows ``[start, stop)`` in a prompt and its patch grid."""

    start: int
    stop: int
    grid: tuple[int, int, int]


def image_spans(token_ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                merge_size: int) -> list[ImageSpan]:
    """Where each image's rows lie: the placeholder rows in order, ``grids[i]``'s count of them
    for image i. Two images side by side (no separator between their rows) are told apart by
    the counts."""
    spans, i, n = [], 0, len(token_ids)
    for grid in grids:
        count = grid[0] * grid[1] * grid[2] // (merge_size * merge_size)
        while i < n and token_ids[i] != image_token_id:
            i += 1
        if i + count > n or any(token_ids[j] != image_token_id for j in range(i, i + count)):
            raise ModelError(f"the prompt holds too few image rows for image {len(spans)} "
                             f"({count} expected)")
        spans.append(ImageSpan(i, i + count, tuple(int(v) for v in grid)))
        i += count
    if image_token_id in token_ids[i:]:
        raise ModelError("the prompt holds more image rows than its images fill")
    return spans


def rope_positions(length: int, spans: list[ImageSpan],
                   merge_size: int) -> tuple[torch.Tensor, int]:
    """``(positions [3, length] int64, delta)`` as transformers' get_rope_index; a row at
    index i >= length is at rope position i + delta on all three axes."""
    out = torch.empty(3, length, dtype=torch.long)
    at = pos = 0  # row index, rope position
    for span in spans:
        text = span.start - at
        out[:, at:span.start] = torch.arange(pos, pos + text)
        pos += text
        t, h, w = span.grid
        gh, gw = h // merge_size, w // merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw),
                                    indexing="ij")
        out[0, span.start:span.stop] = tt.flatten() + pos
        out[1, span.start:span.stop] = hh.flatten() + pos
        out[2, span.start:span.stop] = ww.flatten() + pos
        pos += max(gh, gw)
        at = span.stop
    out[:, at:] = torch.arange(pos, pos + length - at)
    last = int(out.max()) if length else -1
    return out, last + 1 - length


@dataclass
class PromptImages:
    """A prompt's images as the language model reads them: the rows that replace the
    placeholders' embeddings and the rows' 3-D positions."""

    spans: list[ImageSpan]
    embeds: list[torch.Tensor]  # one per span, [stop - start, hidden]
    positions: torch.Tensor  # [3, prompt length] int64
    delta: int  # rope position minus row index past the prompt

    @classmethod
    def build(cls, token_ids: list[int], grids: list[tuple[int, int, int]],
              embeds: list[torch.Tensor], image_token_id: int,
              merge_size: int) -> "PromptImages":
        spans = image_spans(token_ids, grids, image_token_id, merge_size)
        for span, rows in zip(spans, embeds):
            if rows.shape[0] != span.stop - span.start:
                raise ModelError(f"an image's tower output has {rows.shape[0]} rows for "
                                 f"{span.stop - span.start} placeholders")
        positions, delta = rope_positions(len(token_ids), spans, merge_size)
        return cls(spans=spans, embeds=list(embeds), positions=positions, delta=delta)

    def chunk(self, start: int, stop: int) -> dict:
        """The keyword arguments of ``HybridModel.forward`` for prompt rows [start, stop)."""
        index, rows = [], []
        for span, emb in zip(self.spans, self.embeds):
            a, b = max(span.start, start), min(span.stop, stop)
            if a < b:
                index.append(torch.arange(a - start, b - start))
                rows.append(emb[a - span.start:b - span.start])
        image_rows = (torch.cat(index), torch.cat(rows)) if index else None
        return {"rope_positions": self.positions[:, start:stop], "image_rows": image_rows}


def expand_placeholders(token_ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """A rendered prompt with one placeholder an image (the chat template's
    ``<|vision_start|><|image_pad|><|vision_end|>``) with each grown to its image's rows, as
    transformers' processor does."""
    out, k = [], 0
    for t in token_ids:
        if t == image_token_id:
            if k >= len(counts):
                raise ModelError("the prompt holds more image placeholders than images")
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise ModelError(f"the prompt holds {k} image placeholders for {len(counts)} images")
    return out


def prefill(model, state, token_ids: list[int], images: PromptImages | None, chunk: int,
            start: int = 0) -> torch.Tensor:
    """Prompt rows [start, len) forwarded in chunks of ``chunk`` with the images' rows and
    positions; the last position's logits. (The engine's prefill does this through its caches;
    here for the tests and the tools.)"""
    logits = None
    ids = torch.tensor(token_ids, dtype=torch.long)
    for a in range(start, len(token_ids), chunk):
        b = min(a + chunk, len(token_ids))
        extra = images.chunk(a, b) if images is not None else {}
        logits = model.forward(state, ids[a:b], a, logits=b == len(token_ids), **extra)
    return logits
