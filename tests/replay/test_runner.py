"""The replayer's bodies (tandem.replay.runner)."""

from __future__ import annotations

from tandem.replay.runner import Replayer


def test_a_recorded_scoring_with_max_tokens_0_is_replayed_as_one():
    rows = [{"body": {"model": "m", "prompt": "x", "max_tokens": 0, "echo": True,
                      "logprobs": 1}},
            {"body": {"model": "m", "prompt": "x", "max_tokens": 500}},
            {"body": {"model": "m", "prompt": "x"}}]
    replayer = Replayer(rows, max_tokens=64)
    assert [replayer.body_for(i, "small")["max_tokens"] for i in range(3)] == [0, 64, 64]
