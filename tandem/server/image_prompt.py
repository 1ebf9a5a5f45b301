"""A chat prompt's images, from the body's parts to the engine's inputs (issue 19, parts 1, 3, 5).

In order, on worker threads (never the loop):

1. the count cap (``max_images``): the oldest past it are left out, never read;
2. the others' bytes are read and their headers only: each image's row count follows from its
   size by smart_resize, so the token cap (``max_image_tokens``) leaves out the oldest of them,
   in steps, before a pixel is decoded;
3. the images kept are decoded, preprocessed (the image processor's rules), digested and keyed
   (tandem.models.image_keys), one worker thread an image;
4. after the prompt is rendered (each image part the vision placeholder) and tokenised, each
   placeholder grows to its image's rows and those rows become the image's key: the key ids
   the engine and every cache read.

The counts (images kept, left out) go to the journal; never a URL or a pixel.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.models import image_keys
from tandem.models.image_processor import FORMATS, ImageError, preprocess, smart_resize
from tandem.models.vision import expand_placeholders
from tandem.server.errors import bad_request
from tandem.server.image_caps import leave_out, left_out_by_count, left_out_by_tokens
from tandem.server.images import ImageLimits, ImagePart, _bytes_of, decode_image


@dataclass
class PromptImageSet:
    """The request's images as the route hands them on."""

    messages: list[Any]  # the client's messages with the left-out images' parts replaced
    inputs: list[image_keys.ImageInput] = field(default_factory=list)
    left_out: int = 0

    @property
    def tokens(self) -> int:
        return sum(i.num_tokens for i in self.inputs)

    def key_ids(self, rendered_ids: Sequence[int], image_token_id: int) -> list[int]:
        """The rendered prompt's ids (one placeholder an image) as the engine's key ids."""
        if not self.inputs:
            return list(rendered_ids)
        try:
            expanded = expand_placeholders(list(rendered_ids),
                                           [i.num_tokens for i in self.inputs], image_token_id)
            return image_keys.key_ids(expanded, [i.key for i in self.inputs], image_token_id)
        except Exception as e:  # a template that wrote the placeholder other than once an image
            raise bad_request(f"the chat template did not place the images ({e})", "messages",
                              "invalid_messages") from None


async def read_images(messages: list[Any], parts: Sequence[ImagePart], support: Any,
                      limits: ImageLimits, max_images: int, max_image_tokens: int
                      ) -> PromptImageSet:
    """The caps applied, the kept images read and preprocessed; a 400 naming a bad part."""
    processor = support.processor
    left = left_out_by_count(len(parts), max_images)
    kept = list(parts[left:])
    data = [await _bytes_of(part, limits, None) for part in kept]
    sizes = await asyncio.gather(*(asyncio.to_thread(_header_rows, d, p.where, limits,
                                                     processor)
                                   for d, p in zip(data, kept)))
    more = left_out_by_tokens(sizes, max_image_tokens)
    left += more
    kept, data = kept[more:], data[more:]
    inputs = await asyncio.gather(*(asyncio.to_thread(_input, d, p.where, limits, processor)
                                    for d, p in zip(data, kept)))
    return PromptImageSet(messages=leave_out(messages, parts, left), inputs=list(inputs),
                          left_out=left)


def _header_rows(data: bytes, where: str, limits: ImageLimits, processor: Any) -> int:
    """The prompt rows an image will fill, from its header's size alone (smart_resize)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
    except Exception:
        decode_image(data, where, limits)  # names why: corrupt, unsupported, too large
        raise bad_request(f"{where}: the image cannot be read", where, "invalid_image") from None
    try:
        h, w = smart_resize(height, width, processor.factor, processor.min_pixels,
                            processor.max_pixels)
    except ImageError as e:
        raise bad_request(f"{where}: {e}", where, "invalid_image") from None
    return (h // processor.factor) * (w // processor.factor)


def _input(data: bytes, where: str, limits: ImageLimits, processor: Any
           ) -> image_keys.ImageInput:
    decoded = decode_image(data, where, limits)
    try:
        pre = preprocess(decoded.image, processor)
        digest = pre.digest()
        key = image_keys.image_key(digest, pre.grid, processor.merge_size)
    except (ImageError, ValueError) as e:
        raise bad_request(f"{where}: {e}", where, "invalid_image") from None
    return image_keys.ImageInput(key=key, digest=digest, grid=tuple(pre.grid),
                                 pixel_values=pre.pixel_values)
