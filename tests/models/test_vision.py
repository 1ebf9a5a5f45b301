"""Images in a prompt, part 1: the image processor, the vision tower and mRoPE against
transformers (the oracle) on a tiny random Qwen3.5 with a tower (oracle.make_qwen3_5_vl).

Gates: the processor's pixel_values and grids are torch.equal to transformers' PIL processor
(tandem resamples with the same PIL call and repeats its numpy arithmetic); the tower's rows
are within 1e-5 (fp32: transformers' patch embedding is a Conv3d, tandem's the same weights as
one matrix product, and the two sum in another order; seen 2e-6); the positions are equal;
a prompt with two images gives transformers' greedy tokens.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from oracle import IMAGE_TOKEN, VISION_END, VISION_START, make_qwen3_5_vl
from tandem.models import image_processor as ip
from tandem.models import vision
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridModel

STEPS = 24


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def model(vl_dir):
    return HybridModel.load(vl_dir)


@pytest.fixture(scope="module")
def oracle(vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def oracle_processor(vl_dir):
    # the PIL backend by name: AutoImageProcessor takes the torchvision one where it is installed
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    return Qwen2VLImageProcessorPil.from_pretrained(vl_dir)


def _noise(shape, mode=None, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def _gradient(height, width) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    (x + y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


def _palette_with_transparency() -> Image.Image:
    image = _noise((30, 41, 3), seed=5).convert("P")
    image.info["transparency"] = 3
    return image


IMAGES = {
    "noise 70x45": lambda: _noise((45, 70, 3)),
    "gradient 300x211 (over max_pixels)": lambda: _gradient(211, 300),
    "rgba 64x200": lambda: _noise((200, 64, 4), "RGBA", seed=1),
    "grey 12x10 (under min_pixels)": lambda: _noise((10, 12), "L", seed=2),
    "palette with transparency": _palette_with_transparency,
    "exact 64x64": lambda: _noise((64, 64, 3), seed=3),
}


def _transformers_before(version: tuple[int, int]) -> bool:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) < version


# 5.17 to 5.20 (5.17 is the lent GPU machines' image) composite a transparent image otherwise
# and their tower's rows differ; tandem matches 5.21 and later, which the test extra asks for
before_5_21 = pytest.mark.skipif(_transformers_before((5, 21)),
                                 reason="transformers before 5.21 treats images otherwise")


@pytest.mark.parametrize("name", [pytest.param(n, marks=before_5_21) if n.startswith("rgba")
                                  else n for n in IMAGES])
def test_the_processor_gives_transformers_pixel_values_and_grid_bit_for_bit(
        name, model, oracle_processor):
    image = IMAGES[name]()
    want = oracle_processor(images=[image], return_tensors="pt")
    got = ip.preprocess(image, model.images.processor)
    assert list(got.grid) == want["image_grid_thw"][0].tolist()
    assert got.pixel_values.dtype == np.float32
    assert torch.equal(torch.from_numpy(got.pixel_values), want["pixel_values"])
    assert got.num_tokens == int(want["image_grid_thw"][0].prod()) // 4


def test_smart_resize_is_transformers_over_many_sizes():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(7)
    for height, width in rng.integers(1, 3000, (400, 2)).tolist():
        if max(height, width) / min(height, width) > 200:
            continue
        for lo, hi in ((32 * 32, 128 * 128), (65536, 16777216), (56 * 56, 28 * 28 * 1280)):
            assert ip.smart_resize(height, width, 32, lo, hi) == smart_resize(
                height, width, 32, lo, hi), (height, width, lo, hi)


@before_5_21
def test_decoding_a_png_composites_transparency_onto_white_as_transformers_does(
        model, oracle_processor):
    image = _noise((50, 40, 4), "RGBA", seed=4)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    got = ip.preprocess_bytes(buf.getvalue(), model.images.processor)
    want = oracle_processor(images=[Image.open(io.BytesIO(buf.getvalue()))], return_tensors="pt")
    assert torch.equal(torch.from_numpy(got.pixel_values), want["pixel_values"])


def test_a_gif_is_read_at_its_first_frame(model):
    frames = [_noise((40, 40, 3), seed=s).convert("P") for s in (10, 11)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    first = io.BytesIO()
    frames[0].save(first, format="GIF")
    a = ip.preprocess_bytes(buf.getvalue(), model.images.processor)
    b = ip.preprocess_bytes(first.getvalue(), model.images.processor)
    assert a.digest() == b.digest()


def test_a_bad_image_is_an_image_error_that_names_no_pixels():
    with pytest.raises(ip.ImageError, match="cannot be decoded"):
        ip.decode(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ip.ImageError, match="cannot be decoded"):
        ip.decode(b"")
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, format="BMP")
    with pytest.raises(ip.ImageError, match="PNG, JPEG, WEBP, GIF"):
        ip.decode(bmp.getvalue())  # PIL reads BMP; a client's image_url may not send it
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    assert ip.decode(jpeg.getvalue()).size == (8, 8)
    big = io.BytesIO()
    Image.new("RGB", (300, 300)).save(big, format="PNG")
    with pytest.raises(ip.ImageError, match="over the limit"):
        ip.decode(big.getvalue(), max_pixels=300 * 299)
    with pytest.raises(ip.ImageError, match="200 times"):
        ip.smart_resize(1, 201, 32, 1024, 1 << 20)


def test_the_digest_follows_the_pixels_not_the_bytes(model):
    image = _noise((40, 52, 3), seed=6)
    png, webp = io.BytesIO(), io.BytesIO()
    image.save(png, format="PNG")
    image.save(webp, format="WEBP", lossless=True)
    a = ip.preprocess_bytes(png.getvalue(), model.images.processor)
    b = ip.preprocess_bytes(webp.getvalue(), model.images.processor)
    assert a.digest() == b.digest()
    other = _noise((40, 52, 3), seed=6)
    other.putpixel((0, 0), (1, 2, 3))
    c = ip.preprocess(other, model.images.processor)
    assert c.digest() != a.digest()


@before_5_21
def test_the_tower_gives_transformers_rows_within_1e_5(model, oracle, oracle_processor):
    images = [IMAGES[name]() for name in ("noise 70x45", "rgba 64x200", "exact 64x64")]
    want = oracle_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        # transformers encodes the three in one call; each attends over its own patches only
        ref = oracle.model.visual(want["pixel_values"],
                                  grid_thw=want["image_grid_thw"]).pooler_output
    at = 0
    for image in images:
        pre = ip.preprocess(image, model.images.processor)
        rows = model.images.tower.encode(pre.pixel_values, pre.grid)
        assert rows.shape == (pre.num_tokens, 64)
        assert (rows - ref[at:at + pre.num_tokens]).abs().max().item() < 1e-5
        at += pre.num_tokens
    assert at == ref.shape[0]


def _prompt(model) -> tuple[list[int], list[ip.PreprocessedImage], list[Image.Image]]:
    """Text, a non-square image, text, a taller image, text: expanded as the processor does."""
    images = [IMAGES["noise 70x45"](), _noise((100, 64, 3), seed=9)]
    pre = [ip.preprocess(im, model.images.processor) for im in images]
    gen = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(0, VISION_START, (n,), generator=gen).tolist()

    ids = (text(20) + [VISION_START, IMAGE_TOKEN, VISION_END] + text(7)
           + [VISION_START, IMAGE_TOKEN, VISION_END] + text(9))
    return vision.expand_placeholders(ids, [p.num_tokens for p in pre], IMAGE_TOKEN), pre, images


def test_the_positions_are_transformers_get_rope_index(model, oracle):
    ids, pre, _ = _prompt(model)
    spans = vision.image_spans(ids, [p.grid for p in pre], IMAGE_TOKEN, 2)
    assert [(s.start, s.stop) for s in spans] == [(21, 33), (42, 66)]
    inp = torch.tensor([ids])
    grids = torch.tensor([p.grid for p in pre])
    want, want_delta = oracle.model.get_rope_index(inp, (inp == IMAGE_TOKEN).int(),
                                                   image_grid_thw=grids)
    got, delta = vision.rope_positions(len(ids), spans, 2)
    assert torch.equal(got, want[:, 0])
    assert delta == int(want_delta) == -26  # 12 + 24 rows advance 4 + 6
    # an image that opens or closes the prompt
    for ids2 in ([IMAGE_TOKEN] * 12 + [1, 2, 3], [1, 2] + [IMAGE_TOKEN] * 12):
        inp = torch.tensor([ids2])
        want, want_delta = oracle.model.get_rope_index(inp, (inp == IMAGE_TOKEN).int(),
                                                       image_grid_thw=grids[:1])
        spans = vision.image_spans(ids2, [pre[0].grid], IMAGE_TOKEN, 2)
        got, delta = vision.rope_positions(len(ids2), spans, 2)
        assert torch.equal(got, want[:, 0]) and delta == int(want_delta)


def _greedy(model, ids, images: vision.PromptImages, chunk: int, steps: int,
            rope_offset: int | None = None):
    state = model.new_state(256)
    logits = vision.prefill(model, state, ids, images, chunk)
    first, out, at = logits, [], len(ids)
    offset = images.delta if rope_offset is None else rope_offset
    for _ in range(steps):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = model.forward(state, torch.tensor([tok]), at, decode=True, rope_offset=offset)
        at += 1
    return first, out


def test_a_prompt_with_two_images_gives_transformers_greedy_tokens(model, oracle,
                                                                   oracle_processor):
    ids, pre, images = _prompt(model)
    want_in = oracle_processor(images=images, return_tensors="pt")
    inp = torch.tensor([ids])
    kwargs = dict(pixel_values=want_in["pixel_values"], image_grid_thw=want_in["image_grid_thw"],
                  mm_token_type_ids=(inp == IMAGE_TOKEN).int())
    with torch.no_grad():
        ref_logits = oracle(inp, **kwargs).logits[0, -1]
        out = oracle.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=STEPS,
                              do_sample=False, **kwargs)
    want = out[0, len(ids):].tolist()
    rows = [model.images.tower.encode(p.pixel_values, p.grid) for p in pre]
    placed = vision.PromptImages.build(ids, [p.grid for p in pre], rows, IMAGE_TOKEN, 2)
    # chunks of 16 cut both images: a chunk carries part of an image's rows and positions
    for chunk in (16, 128):
        logits, got = _greedy(model, ids, placed, chunk, STEPS)
        assert (logits - ref_logits).abs().max().item() < 1e-5
        assert got == want
    # The gate can fail: the images' rows at 1-D positions, or decode without the images'
    # delta, are another model's.
    flat = vision.PromptImages(spans=placed.spans, embeds=placed.embeds,
                               positions=torch.arange(len(ids)).expand(3, -1), delta=0)
    logits, _ = _greedy(model, ids, flat, 128, 0)
    assert (logits - ref_logits).abs().max().item() > 1e-3
    _, undelta = _greedy(model, ids, placed, 128, STEPS, rope_offset=0)
    assert undelta != want


def test_text_rows_take_the_1d_path_bits_whatever_the_way_in(model):
    """A text row's three ids are equal, so its 3-D rotary is the 1-D one: the same bits by
    rope_positions, by rope_offset and by the plain call; so is the decode step."""
    ids = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(1))
    plain, by_3d, by_offset = model.new_state(64), model.new_state(64), model.new_state(64)
    a = model.forward(plain, ids, 0)
    b = model.forward(by_3d, ids, 0, rope_positions=torch.arange(40).expand(3, -1))
    assert torch.equal(a, b)
    assert torch.equal(plain.views["K"].tensor[:, :, :40], by_3d.views["K"].tensor[:, :, :40])
    # rows at 5.. turned as 12..: the offset call and the 3-D call agree bit for bit
    by_offset, by_3d = model.new_state(64), model.new_state(64)
    model.forward(by_offset, ids[:5], 0)
    model.forward(by_3d, ids[:5], 0)
    c = model.forward(by_offset, ids[5:], 5, rope_offset=7)
    d = model.forward(by_3d, ids[5:], 5, rope_positions=torch.arange(12, 47).expand(3, -1))
    assert torch.equal(c, d)
    e = model.forward(by_offset, torch.tensor([3]), 40, decode=True, rope_offset=7)
    f = model.forward_batch([by_3d], [3], [40], rope_offsets=[7])[0]
    assert torch.equal(e, f)


def test_the_placeholders_must_fill_the_images():
    with pytest.raises(ModelError, match="too few image rows"):
        vision.image_spans([1] + [IMAGE_TOKEN] * 3 + [2], [(1, 4, 4)], IMAGE_TOKEN, 2)
    with pytest.raises(ModelError, match="more image rows"):
        vision.image_spans([IMAGE_TOKEN] * 5, [(1, 4, 4)], IMAGE_TOKEN, 2)
    with pytest.raises(ModelError, match="placeholders"):
        vision.expand_placeholders([1, IMAGE_TOKEN, 2], [4, 4], IMAGE_TOKEN)
    assert vision.expand_placeholders([1, IMAGE_TOKEN, 2], [3], IMAGE_TOKEN) == \
        [1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2]


def test_a_checkpoint_without_a_tower_loads_as_before(qwen3_5_dir):
    assert HybridModel.load(qwen3_5_dir).images is None


def test_a_tower_whose_width_is_not_the_language_models_is_refused(vl_dir, tmp_path):
    import json
    import shutil

    for name in ("model.safetensors", "preprocessor_config.json"):
        shutil.copy(vl_dir / name, tmp_path / name)
    raw = json.loads((vl_dir / "config.json").read_text())
    raw["vision_config"]["out_hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="out_hidden_size"):
        HybridModel.load(tmp_path)


def test_the_moe_checkpoints_tower_with_merge_1_gives_transformers_rows(qwen3_5_moe_dir):
    """Qwen3.5-MoE's layout (oracle.make_qwen3_5_moe: temporal patch 1, merge 1, no
    preprocessor_config.json, so the processor's sizes come from the tower's config)."""
    from transformers import Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    model = HybridModel.load(qwen3_5_moe_dir)
    rules = model.images.processor
    assert (rules.patch_size, rules.temporal_patch_size, rules.merge_size) == (4, 1, 1)
    assert (rules.min_pixels, rules.max_pixels) == (ip.DEFAULT_MIN_PIXELS, ip.DEFAULT_MAX_PIXELS)
    oracle = Qwen3_5MoeForConditionalGeneration.from_pretrained(qwen3_5_moe_dir,
                                                                dtype=torch.float32).eval()
    processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=1, temporal_patch_size=1,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                         size={"shortest_edge": rules.min_pixels,
                                               "longest_edge": rules.max_pixels})
    image = IMAGES["noise 70x45"]()
    want = processor(images=[image], return_tensors="pt")
    pre = ip.preprocess(image, rules)
    assert torch.equal(torch.from_numpy(pre.pixel_values), want["pixel_values"])
    with torch.no_grad():
        ref = oracle.model.visual(want["pixel_values"],
                                  grid_thw=want["image_grid_thw"]).pooler_output
    rows = model.images.tower.encode(pre.pixel_values, pre.grid)
    assert rows.shape == ref.shape == (pre.num_tokens, 64)
    assert (rows - ref).abs().max().item() < 1e-5
