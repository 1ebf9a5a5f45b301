"""Logprobs in the engine (issue 12, part 8): the raw model's log_softmax at the position that
produced each token, a prompt's scored from token 0, and speculation reporting what plain
decoding does.

Gates: the tokens and the first token's logits are the same with logprobs asked or not (the
scorer never changes what is sampled: torch.equal on the entries of two runs); a prompt's
logprobs are each prefix's cold next-token logprobs up to the chunk shapes' rounding;
speculation gives plain decoding's entries up to the verify forward's rounding (greedy gate).
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine import Engine, SamplingParams

WINDOW, CHUNK = 512, 64


def fresh(n: int, seed: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, prompt, **params):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    return engine.generate(prompt, SamplingParams(**{"max_tokens": 12, **params}))


def test_each_tokens_entry_is_the_raw_log_softmax_at_its_position(model):
    prompt = fresh(70, 1)
    result = run(model, prompt, logprobs=3)
    assert [e.token_id for e in result.logprobs] == result.token_ids
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    logits = engine.prefill(prompt)
    for token, entry in zip(result.token_ids, result.logprobs):
        want = torch.log_softmax(logits.float(), dim=-1)
        assert entry.logprob == float(want[token])
        assert [t for t, _ in entry.top] == torch.topk(want, 3).indices.tolist()
        assert entry.top[0] == (token, entry.logprob)  # greedy
        logits = engine.decode(token)


def test_asking_for_logprobs_changes_no_token(model):
    prompt = fresh(150, 2)
    plain = run(model, prompt)
    scored = run(model, prompt, logprobs=5, prompt_logprobs=5)
    assert scored.token_ids == plain.token_ids and plain.logprobs is None
    assert run(model, prompt, logprobs=5).logprobs == scored.logprobs


def test_the_logprobs_are_the_models_before_penalties_bias_and_temperature(model):
    prompt = fresh(40, 3)
    raw = run(model, prompt, max_tokens=1, logprobs=5).logprobs[0]
    forced = 7 if raw.token_id != 7 else 8
    biased = run(model, prompt, max_tokens=1, logprobs=5, logit_bias=((forced, 100.0),),
                 presence_penalty=1.5).logprobs[0]
    assert biased.token_id == forced  # the bias picked it ...
    assert biased.top == raw.top  # ... and the distribution reported is the model's
    hot = run(model, prompt, max_tokens=1, logprobs=5, temperature=1.7, seed=1).logprobs[0]
    assert hot.top == raw.top


def test_a_prompts_logprobs_are_each_prefixs_next_token_logprobs(model):
    prompt = fresh(150, 4)  # three chunks: the slices, the chunks' last rows, the prompt's end
    entries = run(model, prompt, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    assert len(entries) == len(prompt) - 1
    assert [e.token_id for e in entries] == prompt[1:]
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    for t in (1, 2, 40, 63, 64, 65, 127, 128, 149):
        engine.reset()
        want = torch.log_softmax(engine.prefill(prompt[:t]).float(), dim=-1)
        entry = entries[t - 1]
        # The prefix's own forward ends a chunk elsewhere: the same value up to rounding.
        assert math.isclose(entry.logprob, float(want[prompt[t]]), abs_tol=1e-4)
        assert len(entry.top) == 2
        if t % CHUNK == 0:  # a chunk's last row: the very logits the prefix's prefill returns
            assert entry.logprob == float(want[prompt[t]])


def test_a_prompt_scored_after_a_resume_runs_cold(model):
    prompt = fresh(150, 5)
    cold = run(model, prompt, max_tokens=1, prompt_logprobs=1)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    engine.generate(prompt[:130], SamplingParams(max_tokens=3))  # rows in place to resume over
    warm = engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert warm.reused_tokens == 0
    assert warm.prompt_logprobs == cold.prompt_logprobs


def echo_drafter(prompt, reference):
    def draft(context, k):
        done = len(context) - len(prompt)
        return list(reference[done:done + k])
    return draft


@pytest.mark.parametrize("corrupt", [False, True])
def test_with_speculation_each_token_is_scored_at_the_row_that_produced_it(model, corrupt):
    prompt = [(i % 7) * 11 + 3 for i in range(60)]
    plain = run(model, prompt, max_tokens=30, logprobs=4)
    reference = list(plain.token_ids)
    if corrupt:
        reference[5] = (reference[5] + 1) % 90  # a rejected draft mid-way
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    spec = engine.generate(prompt, SamplingParams(max_tokens=30, logprobs=4),
                           draft=echo_drafter(prompt, reference), draft_max=4)
    assert spec.token_ids == plain.token_ids and spec.accepted > 0
    for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
        assert a.token_id == b.token_id
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


# -- max_tokens 0: the prompt scored, nothing generated (echo without generation) ----------------


def test_max_tokens_0_scores_the_prompt_as_max_tokens_1_does_and_samples_nothing(model):
    prompt = fresh(150, 6)  # three chunks, the last partial
    asked = []  # every position the sampler was asked for (force comes first)
    tokens = []
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    params = dict(prompt_logprobs=3, logprobs=3, temperature=1.0, seed=7)
    zero = engine.generate(prompt, SamplingParams(max_tokens=0, **params),
                           force=lambda out: asked.append(len(out)), on_token=tokens.append)
    one = run(model, prompt, max_tokens=1, **params)
    assert zero.prompt_logprobs == one.prompt_logprobs  # floats, ==
    assert len(zero.prompt_logprobs) == len(prompt) - 1
    assert zero.token_ids == [] and zero.logprobs == [] and zero.finish_reason == "length"
    assert asked == [] and tokens == []
    # The rows end at the prompt's end, as after max_tokens 1, nothing pending, none decoded.
    assert engine.token_ids == prompt and engine.pending is None and engine.taint is None


@pytest.mark.parametrize("length,exact", [(128, True), (150, False)])
def test_a_prompt_scored_with_max_tokens_0_is_resumed_over_soundly(model, length, exact):
    """The rows a scoring run leaves are a cold prefill's: the next prompt extends them. At a
    grid line that resume is bit-exact (gate 1: the logprobs equal a cold engine's); off the
    grid it is marked tainted there and holds the greedy gate (identical tokens)."""
    prompt, more = fresh(length, 8), fresh(30, 9)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    warm = engine.generate(prompt + more, SamplingParams(max_tokens=10, logprobs=2))
    cold = run(model, prompt + more, max_tokens=10, logprobs=2)
    assert warm.reused_tokens == length
    assert warm.token_ids == cold.token_ids
    if exact:
        assert warm.logprobs == cold.logprobs
        assert engine.taint == length + len(more)  # only the decoded rows
    else:
        assert engine.taint == length
