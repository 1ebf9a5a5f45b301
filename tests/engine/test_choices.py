"""Several choices of one prompt (tandem/choices.py): the prompt forwarded once, the choices
forked from its end and decoded as one batch, each choice the tokens, logits and rows of an
n = 1 generation with its derived seed (seed + i), bit for bit (torch.equal)."""

import random

import pytest
import torch

from tandem.choices import Choices, DecodeBatch, choice_params, choice_seed, drive, fork
from tandem.engine import CHUNK, Engine, SamplingParams

WINDOW, CHUNK_ROWS = 256, 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def _choices(model, prompt, params, n):
    """n choices as the engine actor runs them: choice 0 prefills, the rest fork at its end.
    Returns the results, choice 0's engine, the forks, and the steps seen."""
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    forks_seen, kinds = [], []

    def make(i, twin, logits):
        forks_seen.append(twin)
        return twin.generate_steps(prompt, choice_params(params, i), logits=logits)

    choices = Choices(n, make)
    steps = choices.run(engine.generate_steps(
        prompt, params, on_prefill=lambda logits: choices.fork(engine, logits,
                                                               params.max_tokens)))

    def watched():
        value = None
        try:
            while True:
                step = steps.send(value)
                kinds.append("chunk" if step is CHUNK else
                             len(step.steps) if isinstance(step, DecodeBatch) else 1)
                value = yield step
        except StopIteration as done:
            return done.value

    results = drive(watched())
    return results, engine, forks_seen, kinds, choices


def _alone(model, prompt, params):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    return engine.generate(prompt, params, on_prefill=lambda _: None), engine


def test_choice_seeds_are_the_seed_plus_the_index():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    params = SamplingParams(seed=5, prompt_logprobs=2)
    assert choice_params(params, 0) is params
    assert choice_params(params, 2).seed == 7 and choice_params(params, 2).prompt_logprobs is None


def test_each_choice_is_the_generation_its_derived_seed_gives_alone(model):
    prompt = _prompt(1, 40)
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=11)
    results, engine, forks, kinds, _ = _choices(model, prompt, params, 3)
    assert kinds.count("chunk") == 2  # the prompt is forwarded once (3 chunks of 16)
    assert max(k for k in kinds if k != "chunk") == 3, "the choices were never batched"
    outs = [r.token_ids for r in results]
    for i, out in enumerate(outs):
        alone, ref = _alone(model, prompt, choice_params(params, i))
        assert out == alone.token_ids, i
        seq = engine if i == 0 else forks[i - 1]
        assert seq.token_ids == ref.token_ids
        for name, t in ref.cache_state().sections.items():
            assert torch.equal(seq.cache_state().sections[name], t), (i, name)
    assert len({tuple(o) for o in outs}) > 1  # sampled with different seeds: they differ


def test_greedy_choices_are_identical(model):
    prompt = _prompt(2, 25)
    results, *_ = _choices(model, prompt, SamplingParams(max_tokens=10), 3)
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    assert len(results[0].token_ids) == 10


def test_a_fork_holds_the_prompts_rows_and_state_in_rows_of_its_own(hybrid):
    engine = Engine(hybrid, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    engine.prefill(_prompt(3, 37))
    twin = fork(engine, 37 + 5)
    assert twin.window == 42 and twin.token_ids == engine.token_ids
    assert twin.taint == engine.taint
    a, b = engine.cache_state(), twin.cache_state()
    for name, t in a.sections.items():
        assert torch.equal(b.sections[name], t) and b.sections[name].data_ptr() != t.data_ptr()
    for name, v in a.views.items():
        assert torch.equal(b.views[name].rows(0, 37), v.rows(0, 37))


def test_choices_that_end_early_leave_the_others_decoding_and_the_forks_are_released(model):
    prompt = _prompt(4, 20)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    stop_at = {1: 2}  # choice 1 stops after its second token, as a stop string would

    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    forks = []

    def make(i, twin, logits):
        forks.append(twin)
        count = [0]

        def on_token(_):
            count[0] += 1
            return count[0] >= stop_at.get(i, 99)

        return twin.generate_steps(prompt, choice_params(params, i), logits=logits,
                                   on_token=on_token)

    choices = Choices(3, make)
    results = drive(choices.run(engine.generate_steps(
        prompt, params, on_prefill=lambda logits: choices.fork(engine, logits, 12))))
    assert [len(r.token_ids) for r in results] == [12, 2, 12]
    assert results[1].finish_reason == "stop"
    choices.release()
    assert choices.forks == []
    assert forks[0].window == 20 + 12


@pytest.mark.parametrize("n", [2, 4])
def test_a_prefill_stopped_before_its_end_ends_every_choice_cancelled(hybrid, n):
    engine = Engine(hybrid, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    choices = Choices(n, lambda i, twin, logits: twin.generate_steps([1], SamplingParams()))
    results = drive(choices.run(engine.generate_steps(
        _prompt(5, 50), SamplingParams(max_tokens=4), stop_prefill=lambda: True,
        on_prefill=lambda logits: choices.fork(engine, logits, 4))))
    assert [r.finish_reason for r in results] == ["cancelled"] * n
    assert choices.forks == []
