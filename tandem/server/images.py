"""A chat request's images, from its ``image_url`` parts to RGB pixels (issue 19, part 2).

The OpenAI SDK and Open WebUI send an image as a content part
``{"type": "image_url", "image_url": {"url": U, "detail": ...}}`` (the url may also be the part's
value itself, as some clients write it). ``U`` is a ``data:`` URL (base64 PNG, JPEG, WebP, or
GIF, whose first frame is taken) or, when ``image_fetch`` is on, an http(s) URL fetched with a
size and a time limit. Anything else, a payload that is not base64, bytes no decoder reads, a
format outside those four, an image over the byte or pixel limits, a fetch that fails: a 400
naming the part (``messages[i].content[j]``), never a 5xx.

Decoding runs on a worker thread (``asyncio.to_thread``), never on the event loop: a 20 MB
JPEG takes a core for a while. The pixel limit is checked on the header's size before any pixel
is decoded, so a small file that claims a huge canvas (a decompression bomb) costs nothing.

The decoder is the image processor's (tandem.models.image_processor.decode): a transparent
image is composited on white as transformers' ``convert_to_rgb`` does, so the tower sees the
pixels the reference would.

Nothing here logs a URL, a byte or a pixel: the journal counts images, never what they show.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np

from tandem.models.image_processor import ImageError, ImageTooLarge, decode
from tandem.server.errors import bad_request

_DATA_URL = re.compile(r"data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),", re.ASCII)
_WHITESPACE = re.compile(rb"\s+")
FETCH_CHUNK = 64 * 1024


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The images knobs a request is held to (tandem.config.ImagesConfig)."""

    max_bytes: int = 20 << 20           # an image's encoded bytes (after base64, or fetched)
    max_pixels: int = 40_000_000        # width x height, read from the header before decoding
    fetch: bool = False                 # http(s) URLs; off: only data: URLs
    fetch_timeout_s: float = 10.0


def image_limits(config: Any) -> ImageLimits:
    """The limits of a tandem.config.Config's [images] section."""
    images = config.images
    return ImageLimits(max_bytes=int(images.image_max_mb * (1 << 20)),
                       max_pixels=images.image_max_pixels,
                       fetch=images.image_fetch == "on",
                       fetch_timeout_s=images.image_fetch_timeout_s)


class ImagePart(msgspec.Struct, frozen=True):
    """Where an image part is in the body, and its URL (never logged)."""

    where: str      # messages[i].content[j]
    url: str


class DecodedImage(msgspec.Struct, frozen=True, kw_only=True):
    where: str
    format: str
    width: int
    height: int
    nbytes: int             # the encoded bytes
    image: Any              # an RGB PIL image, as image_processor.preprocess takes it

    @property
    def rgb(self) -> np.ndarray:
        """The pixels, uint8 (height, width, 3)."""
        return np.asarray(self.image, dtype=np.uint8)


def image_parts(messages: Any) -> list[ImagePart]:
    """Every ``image_url`` part of the messages, in order. Parts that are malformed (no url, a
    url that is not a string) are a 400 here; the rest of the message's shape is the chat
    renderer's to check."""
    return list(_walk(messages))


def _walk(messages: Any) -> Iterator[ImagePart]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, Sequence) or isinstance(content, (str, bytes)):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, Mapping) else value
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}: an image_url part needs a string 'url' "
                                  "(image_url.url)", where, "invalid_image")
            yield ImagePart(where, url)


async def load_images(parts: Sequence[ImagePart], limits: ImageLimits,
                      http: aiohttp.ClientSession | None = None) -> list[DecodedImage]:
    """The parts' images decoded, in order; a 400 naming the first part that fails."""
    images = []
    for part in parts:
        data = await _bytes_of(part, limits, http)
        images.append(await asyncio.to_thread(decode_image, data, part.where, limits))
    return images


async def _bytes_of(part: ImagePart, limits: ImageLimits,
                    http: aiohttp.ClientSession | None) -> bytes:
    url = part.url
    if url[:5].lower() == "data:":
        # base64 of up to image_max_mb: tens of ms of a core, never on the loop
        return await asyncio.to_thread(data_url_bytes, url, part.where, limits)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise bad_request(f"{part.where}: an image url must be a data: URL"
                          + (" or an http(s) URL" if limits.fetch else ""),
                          part.where, "invalid_image")
    if not limits.fetch:
        raise bad_request(f"{part.where}: this server reads only data: image URLs "
                          "(image_fetch is off)", part.where, "image_fetch_off")
    return await fetch_image(url, part.where, limits, http)


def data_url_bytes(url: str, where: str, limits: ImageLimits) -> bytes:
    """The payload of a base64 ``data:`` URL, held to the byte limit before it is decoded."""
    match = _DATA_URL.match(url)
    if match is None:
        raise bad_request(f"{where}: not a data URL (data:image/...;base64,...)", where,
                          "invalid_image")
    media = (match.group("media") or "").lower()
    if media and not media.startswith("image/"):
        raise bad_request(f"{where}: a data URL of type {media!r} is not an image", where,
                          "invalid_image")
    if "base64" not in [p.strip().lower() for p in match.group("params").split(";")]:
        raise bad_request(f"{where}: an image data URL must be base64", where, "invalid_image")
    payload = url[match.end():]
    # 4 base64 characters a 3 bytes: a payload over the limit is refused before decoding it.
    if len(payload) > (limits.max_bytes // 3 + 1) * 4 + 1024:
        raise bad_request(f"{where}: the image is over {limits.max_bytes} bytes", where,
                          "image_too_large")
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", payload.encode("ascii")), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise bad_request(f"{where}: the data URL's payload is not base64", where,
                          "invalid_image") from None
    if len(data) > limits.max_bytes:
        raise bad_request(f"{where}: the image is over {limits.max_bytes} bytes", where,
                          "image_too_large")
    return data


async def fetch_image(url: str, where: str, limits: ImageLimits,
                      http: aiohttp.ClientSession | None) -> bytes:
    """GET an image, at most ``max_bytes`` of it and ``fetch_timeout_s`` in all."""
    owned = http is None
    session = http if http is not None else aiohttp.ClientSession()
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            async with session.get(url, allow_redirects=True, max_redirects=3) as resp:
                if resp.status != 200:
                    raise bad_request(f"{where}: fetching the image answered {resp.status}",
                                      where, "image_fetch_failed")
                if (resp.content_length or 0) > limits.max_bytes:
                    raise bad_request(f"{where}: the image is over {limits.max_bytes} bytes",
                                      where, "image_too_large")
                data = bytearray()
                async for chunk in resp.content.iter_chunked(FETCH_CHUNK):
                    data += chunk
                    if len(data) > limits.max_bytes:
                        raise bad_request(f"{where}: the image is over {limits.max_bytes} "
                                          "bytes", where, "image_too_large")
                return bytes(data)
    except TimeoutError:
        raise bad_request(f"{where}: fetching the image took over {limits.fetch_timeout_s} s",
                          where, "image_fetch_failed") from None
    except (aiohttp.ClientError, ValueError) as e:
        raise bad_request(f"{where}: the image could not be fetched ({type(e).__name__})",
                          where, "image_fetch_failed") from None
    finally:
        if owned:
            await session.close()


def decode_image(data: bytes, where: str, limits: ImageLimits) -> DecodedImage:
    """The RGB image of an encoded one (a worker thread's job), decoded by the image
    processor's own decoder (tandem.models.image_processor.decode: GIF's first frame, alpha on
    white); its refusals become a 400 that says which of corrupt, unsupported or too large."""
    try:
        image = decode(data, limits.max_pixels)
    except ImageTooLarge as e:
        raise bad_request(f"{where}: {e}", where, "image_too_large") from None
    except ImageError as e:
        fmt = sniff(data)
        if fmt is None:
            raise bad_request(f"{where}: not a PNG, JPEG, WebP or GIF image", where,
                              "unsupported_image") from None
        raise bad_request(f"{where}: the {fmt} image is corrupt ({e})", where,
                          "invalid_image") from None
    width, height = image.size
    return DecodedImage(where=where, format=sniff(data) or "", width=width, height=height,
                        nbytes=len(data), image=image)


def sniff(data: bytes) -> str | None:
    """The format a file's magic bytes claim, of the four read here; None for any other. It
    tells a corrupt image (a PNG header and then garbage) from one of a format not read."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None
