"""A chat request's image_url parts, read to RGB pixels (issue 19, part 2): data: URLs of PNG,
JPEG, WebP and GIF (its first frame), http(s) URLs only behind image_fetch with a size and a time
limit, and every bad image a 400 naming its part, through the HTTP server too."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from tandem.server import images as images_module
from tandem.server.app import build_app
from tandem.server.errors import ApiError
from tandem.server.images import (
    ImageLimits,
    ImagePart,
    decode_image,
    image_parts,
    load_images,
)


def _pixels(width: int = 7, height: int = 5) -> np.ndarray:
    rng = np.random.default_rng(3)
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _encode(rgb: np.ndarray, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format=fmt, **kw)
    return out.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _chat(url, **part) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url, **part}}]}]


async def _load(url: str, limits: ImageLimits = ImageLimits()):
    return await load_images(image_parts(_chat(url)), limits)


async def _refused(url: str, code: str, limits: ImageLimits = ImageLimits()) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await _load(url, limits)
    assert caught.value.status == 400
    assert caught.value.param == "messages[0].content[1]"
    assert caught.value.code == code
    return caught.value


async def test_lossless_formats_decode_to_the_pixels_they_were_written_from():
    rgb = _pixels()
    for fmt, media, kw in (("PNG", "image/png", {}), ("WEBP", "image/webp", {"lossless": True})):
        (image,) = await _load(_data_url(_encode(rgb, fmt, **kw), media))
        assert (image.format, image.width, image.height) == (fmt, 7, 5)
        assert image.where == "messages[0].content[1]"
        assert np.array_equal(image.rgb, rgb), fmt


async def test_a_jpeg_decodes_to_what_pillow_reads_of_it():
    data = _encode(_pixels(16, 16), "JPEG", quality=90)
    (image,) = await _load(_data_url(data, "image/jpeg"))
    assert image.format == "JPEG" and image.rgb.shape == (16, 16, 3)
    assert np.array_equal(image.rgb, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


async def test_a_gif_gives_its_first_frame():
    first, second = np.zeros((4, 4, 3), np.uint8), np.full((4, 4, 3), 255, np.uint8)
    out = io.BytesIO()
    frames = [Image.fromarray(first), Image.fromarray(second)]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    (image,) = await _load(_data_url(out.getvalue(), "image/gif"))
    assert image.format == "GIF"
    assert np.array_equal(image.rgb, first)


async def test_transparency_is_composited_on_white_as_the_reference_processor_does():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)      # opaque red stays red
    rgba[0, 1] = (0, 0, 255, 0)        # fully transparent: white
    out = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(out, format="PNG")
    (image,) = await _load(_data_url(out.getvalue()))
    assert image.rgb[0, 0].tolist() == [255, 0, 0]
    assert image.rgb[0, 1].tolist() == [255, 255, 255]
    transformers = pytest.importorskip("transformers.image_transforms")
    reference = transformers.convert_to_rgb(Image.open(io.BytesIO(out.getvalue())))
    assert np.array_equal(image.rgb, np.asarray(reference))


async def test_every_bad_image_is_a_400_naming_its_part():
    png = _encode(_pixels(), "PNG")
    await _refused("data:image/png;base64,@@not base64@@", "invalid_image")
    await _refused("data:image/png," + "abc", "invalid_image")           # not base64-encoded
    await _refused("data:text/plain;base64," + base64.b64encode(b"hi").decode(), "invalid_image")
    await _refused(_data_url(png[: len(png) // 2]), "invalid_image")    # truncated
    await _refused(_data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 64), "invalid_image")
    await _refused(_data_url(b"hello, not an image at all"), "unsupported_image")
    await _refused(_data_url(_encode(_pixels(), "BMP"), "image/bmp"), "unsupported_image")
    await _refused(_data_url(_encode(_pixels(), "TIFF"), "image/tiff"), "unsupported_image")
    await _refused("file:///etc/passwd", "invalid_image")
    await _refused("ftp://example.invalid/a.png", "invalid_image")
    with pytest.raises(ApiError) as caught:
        image_parts([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert caught.value.status == 400 and caught.value.param == "messages[0].content[0]"


async def test_an_image_over_the_byte_or_pixel_limits_is_refused_before_it_is_decoded(monkeypatch):
    png = _encode(_pixels(), "PNG")
    await _refused(_data_url(png), "image_too_large", ImageLimits(max_bytes=len(png) - 1))
    # A small file that claims a huge canvas: the header's size is read, no pixel is decoded.
    bomb = _encode(np.zeros((2000, 2000, 3), np.uint8), "PNG")
    assert len(bomb) < 100_000
    decoded = []
    from PIL import ImageFile
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(1))
    await _refused(_data_url(bomb), "image_too_large", ImageLimits(max_pixels=1_000_000))
    assert decoded == []


async def test_images_are_decoded_off_the_event_loop(monkeypatch):
    threads = []
    real = images_module.decode_image

    def recording(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(images_module, "decode_image", recording)
    await _load(_data_url(_encode(_pixels(), "PNG")))
    assert threads and threads[0] != threading.get_ident()


async def _image_server(handler):
    app = web.Application()
    app.router.add_get("/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def test_http_urls_are_read_only_behind_image_fetch_within_its_limits():
    png = _encode(_pixels(), "PNG")

    async def handler(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "slow.png":
            await asyncio.sleep(5)
        if name == "missing.png":
            return web.Response(status=404)
        if name == "big.png":  # no content-length: the limit holds on the streamed body
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b"\0" * 4096)
            return resp
        return web.Response(body=png, content_type="image/png")

    runner, base = await _image_server(handler)
    try:
        await _refused(f"{base}/a.png", "image_fetch_off")
        on = ImageLimits(fetch=True, fetch_timeout_s=0.5, max_bytes=100_000)
        (image,) = await _load(f"{base}/a.png", on)
        assert np.array_equal(image.rgb, _pixels())
        await _refused(f"{base}/missing.png", "image_fetch_failed", on)
        await _refused(f"{base}/slow.png", "image_fetch_failed", on)
        await _refused(f"{base}/big.png", "image_too_large",
                       ImageLimits(fetch=True, fetch_timeout_s=5, max_bytes=50_000))
        await _refused("http://127.0.0.1:9/none.png", "image_fetch_failed", on)  # refused port
    finally:
        await runner.cleanup()


def test_decode_image_called_directly_gives_the_pixels_and_counts_the_encoded_bytes():
    data = _encode(_pixels(), "PNG")
    a, b = decode_image(data, "x", ImageLimits()), decode_image(data, "x", ImageLimits())
    assert np.array_equal(a.rgb, _pixels()) and np.array_equal(b.rgb, _pixels())
    assert a.nbytes == len(data) and (a.width, a.height, a.where) == (7, 5, "x")


async def test_the_chat_route_names_a_bad_image_and_refuses_images_it_cannot_read(
        small_loaded, make_config, serve):
    base = f"http://127.0.0.1:{{}}"
    async with serve(build_app(make_config(), small_loaded)) as server, \
            aiohttp.ClientSession(base.format(server.port)) as http:
        async def post(url):
            async with http.post("/v1/chat/completions",
                                 json={"model": "small", "messages": _chat(url)}) as resp:
                return resp.status, (await resp.json())["error"]
        status, error = await post("data:image/png;base64,@@@@")
        assert status == 400
        assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_image"
        status, error = await post(_data_url(_encode(_pixels(), "PNG")))
        assert status == 400 and error["code"] == "images_unsupported"
        async with http.get("/health") as resp:
            assert resp.status == 200
