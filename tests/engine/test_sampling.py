"""Sampled decoding: the same seed gives the same tokens; stop tokens and stop callbacks."""

from tandem.engine import Engine, SamplingParams
from tandem.models.third import ThirdModel

PROMPT = [5, 17, 3, 88, 41, 2, 9]


def _run(params, **kw):
    return Engine(ThirdModel(), window=256, prefix_chunk=32).generate(PROMPT, params, **kw)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_other_tokens():
    p = dict(max_tokens=40, temperature=1.0, top_p=0.95, top_k=50)
    a = _run(SamplingParams(seed=1, **p)).token_ids
    assert a == _run(SamplingParams(seed=1, **p)).token_ids
    assert a != _run(SamplingParams(seed=2, **p)).token_ids


def test_top_k_of_one_is_greedy():
    greedy = _run(SamplingParams(max_tokens=20)).token_ids
    assert _run(SamplingParams(max_tokens=20, temperature=0.7, top_k=1, seed=3)).token_ids == greedy


def test_a_stop_token_ends_the_generation_and_is_not_returned():
    greedy = _run(SamplingParams(max_tokens=20)).token_ids
    stop = greedy[5]
    first = greedy.index(stop)
    result = _run(SamplingParams(max_tokens=20, stop_token_ids=(stop,)))
    assert result.token_ids == greedy[:first]
    assert (result.finish_reason, result.stop_token) == ("stop", stop)


def test_on_token_returning_true_stops_after_that_token():
    seen = []
    result = _run(SamplingParams(max_tokens=20), on_token=lambda t: seen.append(t) or len(seen) == 4)
    assert len(result.token_ids) == 4 and result.finish_reason == "stop"


def test_should_cancel_stops_with_reason_cancelled():
    result = _run(SamplingParams(max_tokens=20), should_cancel=lambda: True)
    assert result.finish_reason == "cancelled" and len(result.token_ids) == 1


def test_a_forced_token_replaces_the_sampled_one_and_is_forwarded():
    greedy = _run(SamplingParams(max_tokens=6)).token_ids
    forced = [7, 8, 9]
    result = _run(SamplingParams(max_tokens=6),
                  force=lambda out: forced[len(out)] if len(out) < 3 else None)
    assert result.token_ids[:3] == forced
    assert result.token_ids != greedy
