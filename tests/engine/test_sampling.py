"""Sampled decoding: the same seed gives the same tokens; stop tokens and stop callbacks; every
value the request schema accepts samples safely; penalties and logit_bias."""

import math

import pytest
import torch

from tandem.engine import TEMPERATURE_FLOOR, Engine, LogitsProcessors, Sampler, SamplingParams
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


# -- every value the schema accepts samples safely (issue 11, finding 1) ----------------------

@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-40, 5e-324])
def test_a_temperature_under_the_floor_samples_greedily(temperature):
    greedy = _run(SamplingParams(max_tokens=20)).token_ids
    assert temperature < TEMPERATURE_FLOOR
    sampled = _run(SamplingParams(max_tokens=20, temperature=temperature, seed=4))
    assert sampled.token_ids == greedy


@pytest.mark.parametrize("top_p", [1e-45, 1e-46, 5e-324])
def test_top_p_keeps_the_most_probable_token_however_small_it_is(top_p):
    greedy = _run(SamplingParams(max_tokens=20)).token_ids
    for temperature in (TEMPERATURE_FLOOR, 1.0, 2.0):
        params = SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p, seed=4)
        assert _run(params).token_ids == greedy


@pytest.mark.parametrize("logits", [[0.0, math.inf, 1.0], [math.nan, 2.0, 1.0],
                                    [-math.inf, 3.0, -math.inf], [1e38, 3e38, -3e38]])
def test_logits_that_give_no_distribution_fall_back_to_the_argmax_with_one_draw(logits):
    """No NaN or inf ever reaches multinomial; the fallback takes the draw a sampled position
    takes, so the seeded tokens after it are what they would be."""
    params = SamplingParams(temperature=TEMPERATURE_FLOOR, seed=9)
    odd, plain = Sampler(params), Sampler(params)
    probs = odd.probs(torch.tensor(logits))
    assert bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0
    assert odd(torch.tensor(logits)) == 1
    plain(torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(odd.generator.get_state(), plain.generator.get_state())


# -- penalties and logit_bias (issue 11, finding 9) -------------------------------------------

def test_the_penalties_count_the_output_and_the_drafts_before_the_position():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    proc = LogitsProcessors.for_params(params)
    logits = torch.zeros(8)
    # Output [3, 3], then a verify block's draft 5 before this position.
    got = proc(logits, [3, 3, 5], committed=2)
    assert got[3] == -(0.5 + 2 * 0.25) and got[5] == -(0.5 + 0.25)
    assert torch.count_nonzero(got) == 2
    # The draft was rejected: the next position sees the output only.
    got = proc(logits, [3, 3], committed=2)
    assert got[5] == 0 and got[3] == -1.0
    assert torch.equal(logits, torch.zeros(8))  # the model's logits are never written


def test_zero_penalties_and_zero_biases_are_off_and_give_the_same_tokens():
    off = SamplingParams(max_tokens=30, temperature=0.9, seed=3, presence_penalty=0.0,
                         frequency_penalty=0.0, logit_bias=((7, 0.0),))
    assert LogitsProcessors.for_params(off) is None
    absent = SamplingParams(max_tokens=30, temperature=0.9, seed=3)
    assert _run(off).token_ids == _run(absent).token_ids


def test_a_logit_bias_of_100_makes_greedy_write_that_token_and_minus_100_bans_one():
    assert _run(SamplingParams(max_tokens=10, logit_bias=((42, 100.0),))).token_ids == [42] * 10
    greedy = _run(SamplingParams(max_tokens=20)).token_ids
    banned = _run(SamplingParams(max_tokens=20, logit_bias=((greedy[0], -100.0),))).token_ids
    assert greedy[0] not in banned
    sampled = _run(SamplingParams(max_tokens=10, temperature=1.0, seed=1,
                                  logit_bias=((42, 100.0),))).token_ids
    assert sampled == [42] * 10


def test_a_presence_penalty_makes_the_output_repeat_less():
    def repeats(tokens):
        return len(tokens) - len(set(tokens))
    greedy = _run(SamplingParams(max_tokens=30)).token_ids
    penalised = _run(SamplingParams(max_tokens=30, presence_penalty=2.0)).token_ids
    assert repeats(penalised) < repeats(greedy)
    frequent = _run(SamplingParams(max_tokens=30, frequency_penalty=2.0)).token_ids
    assert repeats(frequent) < repeats(greedy)


def test_the_greedy_argmax_is_torch_s_index_ties_nans_and_infinities_included():
    import torch

    from tandem.engine import argmax

    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(248_320, generator=g), torch.zeros(10),
             torch.tensor([1.0, 5.0, 5.0, 2.0]), torch.tensor([1.0, float("nan"), 9.0]),
             torch.tensor([float("-inf"), float("-inf")]), torch.tensor([2.0, float("inf"), 1.0]),
             torch.randn(64, generator=g).double(), torch.randn(20, generator=g)[::2]]
    for logits in cases:
        assert argmax(logits) == int(torch.argmax(logits)), logits[:8]
