"""The image caps (issue 19, part 5): past max_images, or max_image_tokens of rows, the oldest
images are left out in steps of half the cap, each as one fixed text, so the prompt's head up to
the first image still sent stays the same between steps and a session resumes there."""

from __future__ import annotations

import base64
import copy

import aiohttp
import pytest

from tandem.config import ImagesConfig
from tandem.server.app import build_app
from tandem.server.image_caps import (
    LEFT_OUT_TEXT,
    leave_out,
    left_out_by_count,
    left_out_by_tokens,
)
from tandem.server.images import image_parts


def test_the_count_cap_leaves_out_the_oldest_in_steps_of_half_the_cap():
    assert [left_out_by_count(n, 4) for n in range(0, 11)] == [0, 0, 0, 0, 0, 2, 2, 4, 4, 6, 6]
    assert [left_out_by_count(n, 1) for n in range(0, 4)] == [0, 0, 1, 2]
    assert [left_out_by_count(n, 5) for n in (5, 6, 7, 8)] == [0, 2, 2, 4]  # step 5 // 2
    with pytest.raises(ValueError):
        left_out_by_count(3, 0)


def test_a_conversation_gaining_an_image_a_turn_moves_its_left_out_set_once_a_step():
    cap, turns = 8, 60
    ks = [left_out_by_count(n, cap) for n in range(1, turns + 1)]
    assert all(n - k <= cap for n, k in zip(range(1, turns + 1), ks))
    moves = sum(1 for a, b in zip(ks, ks[1:]) if a != b)
    assert moves == -(-(turns - cap) // (cap // 2))  # once a step, never once a turn
    assert all(b - a in (0, cap // 2) for a, b in zip(ks, ks[1:]))


def test_the_token_cap_leaves_out_the_fewest_oldest_images_that_reach_the_step():
    assert left_out_by_tokens([100, 100, 100], 400) == 0
    # excess 100 rounds up to the step (200): the two oldest go
    assert left_out_by_tokens([100, 100, 100, 100, 100], 400) == 2
    # excess 1 -> goal 200: one large image reaches it
    assert left_out_by_tokens([300, 50, 51], 400) == 1
    assert left_out_by_tokens([1000], 400) == 1  # one image over the whole cap: none kept
    # Steady between steps: one more small image the same left-out set
    assert left_out_by_tokens([100] * 6, 400) == left_out_by_tokens([100] * 5, 400) == 2
    assert left_out_by_tokens([100] * 7, 400) == 4


def _message(j: int) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": f"turn {j}"},
                                        {"type": "image_url",
                                         "image_url": {"url": f"data:image/png;base64,{j}"}}]}


def test_leave_out_replaces_the_oldest_parts_with_the_fixed_text_and_keeps_the_client_body():
    messages = [_message(j) for j in range(5)]
    before = copy.deepcopy(messages)
    parts = image_parts(messages)
    out = leave_out(messages, parts, 2)
    assert messages == before
    assert [m["content"][1] for m in out[:2]] == [{"type": "text", "text": LEFT_OUT_TEXT}] * 2
    assert out[2:] == messages[2:]
    assert leave_out(messages, parts, 0) == messages


def _png() -> str:
    from PIL import Image
    import io
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def test_the_chat_route_never_decodes_an_image_it_leaves_out(small_loaded, make_config,
                                                                   serve):
    import msgspec
    config = msgspec.structs.replace(make_config(), images=ImagesConfig(max_images=2))
    # Five images, cap 2: the three oldest are left out (step 1); they are not even images.
    messages = [_message(j) for j in range(5)]
    for m in messages[3:]:
        m["content"][1]["image_url"]["url"] = _png()
    async with serve(build_app(config, small_loaded)) as server, \
            aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        async with http.post("/v1/chat/completions",
                             json={"model": "small", "messages": messages}) as resp:
            error = (await resp.json())["error"]
        # Read and checked, then refused as images: the first kept image is named.
        assert resp.status == 400 and error["code"] == "images_unsupported"
        assert error["param"] == "messages[3].content[1]"
        messages[3]["content"][1]["image_url"]["url"] = "data:image/png;base64,@@"
        async with http.post("/v1/chat/completions",
                             json={"model": "small", "messages": messages}) as resp:
            error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "invalid_image"
        assert error["param"] == "messages[3].content[1]"
