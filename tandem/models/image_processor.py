"""An image's bytes to the vision tower's patches, by the rules of Qwen3.5's image processor.

transformers' Qwen2VLImageProcessor (the class Qwen3.5 and Qwen3-VL checkpoints name, PIL
backend) does, per image:

1. convert to RGB, compositing any transparency onto white;
2. resize with PIL (bicubic unless the config names another filter) to ``smart_resize``'s size:
   both sides multiples of ``patch_size * merge_size``, the area between ``min_pixels`` and
   ``max_pixels``, the aspect ratio kept as closely as that allows;
3. rescale to [0, 1] (uint8 as float64 times 1/255, then float32) and normalise per channel
   ((x - mean) / std in float32);
4. cut into ``patch_size`` squares ordered block-major over the ``merge_size`` x ``merge_size``
   blocks the merger joins (block row, block column, row in block, column in block), each
   flattened channel, time, row, column, with the one frame repeated ``temporal_patch_size``
   times (an image is a clip of two equal frames).

The result is ``pixel_values`` ``[grid_h * grid_w, C * T * p * p]`` float32 and the grid
``(1, grid_h, grid_w)``; the image fills ``grid_h * grid_w / merge_size**2`` prompt rows. This
module computes all of it with numpy and uses PIL only to decode and to resample, as the PIL
backend does, so the values equal transformers' bit for bit (tests/models/test_vision.py).
transformers' torchvision backend resamples with torch's bicubic instead and differs in the
last bits of some pixels.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Qwen3-VL's and Qwen3.5's preprocessor_config.json, for a checkpoint that ships none.
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 times the shorter
# What a client's image_url may hold (the OpenAI API's list); PIL would open many more (TIFF,
# BMP, ICO, ...), each a decoder more for a request to reach.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# A decoded RGB image holds 3 bytes a pixel: 64 Mi pixels is 192 MiB before the resize.
MAX_DECODED_PIXELS = 1 << 26
_RESAMPLE = {2: "BILINEAR", 3: "BICUBIC"}


class ImageError(ValueError):
    """An image that cannot be decoded or preprocessed; the message names why (never pixels)."""


class ImageTooLarge(ImageError):
    """An image whose header claims more pixels than allowed (read before any pixel is)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...] = DEFAULT_MEAN
    image_std: tuple[float, ...] = DEFAULT_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, model_dir: Path, vision: dict) -> "ImageProcessorConfig":
        """``preprocessor_config.json`` beside the weights, its absent fields from the tower's
        own config (patch, temporal patch and merge sizes) and Qwen3.5's defaults."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw: dict = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ImageError(f"preprocessor_config.json is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, vision)

    @classmethod
    def from_dict(cls, raw: dict, vision: dict) -> "ImageProcessorConfig":
        size = raw.get("size") or {}
        # The older form names the bounds min_pixels / max_pixels; size wins, as transformers'
        # constructor lets the explicit keys override it.
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
        out = cls(
            patch_size=int(raw.get("patch_size") or vision.get("patch_size", 16)),
            temporal_patch_size=int(raw.get("temporal_patch_size")
                                    or vision.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size") or vision.get("spatial_merge_size", 2)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(v) for v in raw.get("image_mean", DEFAULT_MEAN)),
            image_std=tuple(float(v) for v in raw.get("image_std", DEFAULT_STD)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            resample=int(raw.get("resample", 3)),
        )
        if out.resample not in _RESAMPLE:
            raise ImageError(f"preprocessor_config.json resample {out.resample} is not "
                             f"implemented; tandem resamples bilinear (2) or bicubic (3)")
        if vision.get("patch_size") not in (None, out.patch_size):
            raise ImageError(f"preprocessor_config.json patch_size {out.patch_size} is not the "
                             f"vision tower's {vision['patch_size']}")
        if not 0 < out.min_pixels <= out.max_pixels:
            raise ImageError(f"min_pixels {out.min_pixels} and max_pixels {out.max_pixels} "
                             f"do not bound a size")
        return out


@dataclass(frozen=True)
class PreprocessedImage:
    """One image as the tower reads it."""

    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, C * T * p * p] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """The prompt rows the image fills."""
        t, h, w = self.grid
        return t * h * w // (self.merge_size * self.merge_size)

    def digest(self) -> str:
        """A sha256 over the grid and the patches' bytes: what the caches key an image on, so
        the same pixels under another URL are the same image and new pixels are another."""
        h = hashlib.sha256()
        h.update(repr(self.grid).encode())
        h.update(np.ascontiguousarray(self.pixel_values).tobytes())
        return h.hexdigest()


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: the size nearest (height, width) whose sides are multiples of
    ``factor`` and whose area lies within [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ImageError(f"an image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"an image of {width}x{height} pixels is more than {MAX_ASPECT} times "
                         f"longer than it is wide")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode(data: bytes, max_pixels: int = MAX_DECODED_PIXELS,
           formats: tuple[str, ...] = FORMATS):
    """An encoded image (PNG, JPEG, WebP, GIF: its first frame) as an RGB PIL image, any
    transparency composited onto white as transformers' convert_to_rgb does. ``max_pixels``
    bounds the decoded size before any pixel is decoded (a small file can claim a huge one)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=formats)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageTooLarge(f"an image of {width}x{height} pixels is over the limit of "
                             f"{max_pixels} pixels")
        image.seek(0)  # an animation's first frame
        image.load()
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(f"the image cannot be decoded as {', '.join(formats)}") from exc
    except Image.DecompressionBombError as exc:
        raise ImageError("the image claims more pixels than the decoder allows") from exc
    except Exception as exc:  # PIL raises many types for a corrupt or unknown file
        raise ImageError(f"the image cannot be decoded ({type(exc).__name__})") from exc
    return to_rgb(image)


def to_rgb(image):
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def preprocess(image, config: ImageProcessorConfig) -> PreprocessedImage:
    """An RGB PIL image (``decode``'s) as the tower's patches and grid."""
    from PIL import Image

    image = to_rgb(image)
    width, height = image.size
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels,
                                config.max_pixels)
    resample = getattr(Image.Resampling, _RESAMPLE[config.resample])
    resized = np.asarray(image.resize((new_w, new_h), resample=resample))  # [H, W, C] uint8
    # transformers' rescale: float64 product, then float32
    x = (resized.astype(np.float64) * config.rescale_factor).astype(np.float32)
    x = np.moveaxis(x, -1, 0)  # [C, H, W]
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    return PreprocessedImage(pixel_values=patchify(x, config), grid=(1, new_h // config.patch_size,
                                                                    new_w // config.patch_size),
                             merge_size=config.merge_size)


def patchify(x: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """``[C, H, W]`` float32 to ``[gh * gw, C * T * p * p]`` in the merger's block order."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = x.shape
    gh, gw = height // p, width // p
    patches = x.reshape(channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t,
                                                             *patches.shape[5:]))
    return np.ascontiguousarray(patches.reshape(gh * gw, channels * t * p * p))


def preprocess_bytes(data: bytes, config: ImageProcessorConfig,
                     max_decoded_pixels: int = MAX_DECODED_PIXELS) -> PreprocessedImage:
    return preprocess(decode(data, max_decoded_pixels), config)
