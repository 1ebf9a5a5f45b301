"""Images through the engine (issue 19, parts 1, 3 and 4): the prompt is its key ids, the tower
runs through its cache for the images whose rows are forwarded, and decode turns at the images'
delta. Gate: the greedy tokens of tests/models/test_vision.py's reference loop (itself held to
transformers' there), identical; a resume at an anchor past an image: identical greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from oracle import IMAGE_TOKEN, VISION_END, VISION_START, make_qwen3_5_vl
from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.cache.tower import ImagePlacer, TowerCache
from tandem.engine import Engine, SamplingParams, run_steps
from tandem.models import image_keys, vision
from tandem.models import image_processor as ip
from tandem.models.base import ModelError
from tandem.models.hybrid import HybridModel

STEPS = 12


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def model(vl_dir):
    return HybridModel.load(vl_dir)


def _image(seed: int, shape=(45, 70, 3)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


def _inputs(model, images):
    out = []
    for im in images:
        pre = ip.preprocess(im, model.images.processor)
        digest = pre.digest()
        out.append(image_keys.ImageInput(key=image_keys.image_key(digest, pre.grid, 2),
                                         digest=digest, grid=pre.grid,
                                         pixel_values=pre.pixel_values))
    return out


def _prompt(model, images, seed=3):
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, VISION_START, (n,), generator=gen).tolist()

    inputs = _inputs(model, images)
    ids = text(20)
    for _ in images:
        ids += [VISION_START, IMAGE_TOKEN, VISION_END] + text(7)
    real = vision.expand_placeholders(ids, [i.num_tokens for i in inputs], IMAGE_TOKEN)
    return real, image_keys.key_ids(real, [i.key for i in inputs], IMAGE_TOKEN), inputs


def _reference(model, real, inputs, steps=STEPS):
    rows = [model.images.tower.encode(i.pixel_values, i.grid) for i in inputs]
    placed = vision.PromptImages.build(real, [i.grid for i in inputs], rows, IMAGE_TOKEN, 2)
    state = model.new_state(256)
    logits = vision.prefill(model, state, real, placed, 16)
    out, at = [], len(real)
    for _ in range(steps):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = model.forward(state, torch.tensor([tok]), at, decode=True,
                               rope_offset=placed.delta)
        at += 1
    return out


def test_the_key_rule_holds_the_grid_and_the_delta_follows_from_the_ids(model):
    real, keys, inputs = _prompt(model, [_image(1), _image(2, (100, 64, 3))])
    assert all(image_keys.is_key(i.key) and i.key < 1 << 63 for i in inputs)
    assert image_keys.real_ids(keys, IMAGE_TOKEN) == real
    spans = vision.image_spans(real, [i.grid for i in inputs], IMAGE_TOKEN, 2)
    _, delta = vision.rope_positions(len(real), spans, 2)
    assert image_keys.rope_delta(keys) == delta != 0
    # every prefix: the delta of the whole images before it
    for n in (spans[0].stop, spans[1].start, spans[1].stop + 1):
        _, want = vision.rope_positions(n, [s for s in spans if s.stop <= n], 2)
        assert image_keys.rope_delta(keys[:n]) == want
    assert image_keys.text_runs([1, 2, keys[spans[0].start], 3]) == [[1, 2], [3]]


def test_greedy_tokens_with_images_through_the_engine_are_the_reference_loops_and_transformers(
        model, vl_dir):
    real, keys, inputs = _prompt(model, [_image(1), _image(2, (100, 64, 3))])
    want = _reference(model, real, inputs)
    engine = Engine(model, window=256, prefix_chunk=16)
    cache = TowerCache(1 << 20)
    placer = ImagePlacer(inputs, model.images, cache)
    got = engine.generate(keys, SamplingParams(max_tokens=STEPS), images=placer)
    assert got.token_ids == want
    assert placer.runs == 2 and placer.hits == 0
    assert engine.token_ids[:len(keys)] == keys
    assert engine.rope_delta == image_keys.rope_delta(keys)
    # and transformers' own greedy tokens, from its processor's patches
    from transformers import Qwen3_5ForConditionalGeneration

    oracle = Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    inp = torch.tensor([real])
    with torch.no_grad():
        ref = oracle.generate(
            inp, attention_mask=torch.ones_like(inp), max_new_tokens=STEPS, do_sample=False,
            pixel_values=torch.cat([torch.from_numpy(i.pixel_values) for i in inputs]),
            image_grid_thw=torch.tensor([i.grid for i in inputs]),
            mm_token_type_ids=(inp == IMAGE_TOKEN).int())
    assert got.token_ids == ref[0, len(real):].tolist()
    # the same pixels again: the tower's cache answers, the tokens are the same
    again = ImagePlacer(inputs, model.images, cache)
    engine.reset()
    assert engine.generate(keys, SamplingParams(max_tokens=STEPS), images=again
                           ).token_ids == want
    assert again.runs == 0 and again.hits == 2


def test_a_resume_at_an_anchor_past_an_image_runs_no_tower_and_gives_the_same_tokens(model):
    real, keys, inputs = _prompt(model, [_image(1), _image(4)])
    want = _reference(model, real, inputs)
    spans = vision.image_spans(real, [i.grid for i in inputs], IMAGE_TOKEN, 2)
    line = 48  # a grid line past the first image, inside the second
    assert spans[0].stop <= line < spans[1].stop
    # the anchor: a cold prefill to the line, its sections and rows copied
    first = Engine(model, window=256, prefix_chunk=16)
    whole = ImagePlacer(inputs, model.images, None).place(keys, 0)
    run_steps(first.prefill_steps(keys[:line], images=vision.PromptImages(**_cut(whole, line))))
    sections = SectionsCopy.take(first.cache_state())
    rows = RowsCopy.take(first.cache_state(), 0, line)
    # restored into another engine at the line: the first image is never encoded
    resumed = Engine(model, window=256, prefix_chunk=16)
    sections.restore(resumed.cache_state())
    rows.restore(resumed.cache_state())
    resumed.resume_at(line, keys)
    assert resumed.rope_delta == image_keys.rope_delta(keys[:line])
    placer = ImagePlacer(inputs, model.images, TowerCache(1 << 20))
    got = resumed.generate(keys, SamplingParams(max_tokens=STEPS), images=placer)
    assert got.reused_tokens == line and placer.runs == 1  # the second image only
    assert got.token_ids == want


def _cut(placed: vision.PromptImages, n: int) -> dict:
    """A PromptImages' fields for the prompt's first n rows."""
    return {"spans": placed.spans, "embeds": placed.embeds, "positions": placed.positions[:, :n],
            "delta": placed.delta}


def test_text_after_the_images_resumes_at_their_delta_without_them(model):
    """The compaction's continuation: rows in place hold images, the new rows are text, the
    request carries no image; they turn at the delta the key ids give."""
    real, keys, inputs = _prompt(model, [_image(1)])
    engine = Engine(model, window=256, prefix_chunk=16)
    engine.generate(keys, SamplingParams(max_tokens=0),
                    images=ImagePlacer(inputs, model.images, None))
    more = [5, 6, 7, 8]
    got = engine.generate(keys + more, SamplingParams(max_tokens=STEPS))
    assert got.reused_tokens == len(keys)
    ref_real = real + more
    want = _reference(model, ref_real, inputs)
    assert got.token_ids == want
    # image rows to forward without their images are refused
    engine.reset()
    with pytest.raises(ModelError, match="without their images"):
        engine.generate(keys, SamplingParams(max_tokens=1))


def test_the_engine_without_a_tower_refuses_image_rows(tmp_path):
    from small_hybrid import make_small_hybrid

    small = HybridModel.load(make_small_hybrid(tmp_path / "s", tokenizer=False))
    engine = Engine(small, window=64, prefix_chunk=16)
    key = image_keys.image_key("ab" * 32, (1, 4, 4), 2)
    with pytest.raises(ModelError, match="no vision tower"):
        engine.generate([1, 2] + [key] * 4 + [3], SamplingParams(max_tokens=1),
                        images=ImagePlacer([], None, None))
