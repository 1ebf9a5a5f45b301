"""Generations as steps (issue 14, part 3): several engines over one model, their prefill chunks
interleaved and their decode steps forwarded as one batch (tandem.engine.decode_batch), give each
sequence the tokens, logits and rows it gets generating alone, bit for bit (torch.equal; the
small hybrid's recurrent decay is near 1, so a step that mixed a neighbour's state into a
sequence would change its tokens)."""

import random

import pytest
import torch

from tandem.engine import (CHUNK, DecodeStep, Engine, SamplingParams, decode_batch, run_steps)

WINDOW, CHUNK_ROWS = 256, 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def _alone(model, prompt: list[int], params: SamplingParams):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    result = engine.generate(prompt, params)
    return result.token_ids, engine


def _together(model, prompts: list[list[int]], params: list[SamplingParams]):
    """Every generation advanced one step a round: a prefill's chunk, then every decode step
    waiting forwarded as one batch."""
    engines = [Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS) for _ in prompts]
    gens = [e.generate_steps(p, q) for e, p, q in zip(engines, prompts, params)]
    needs = {i: next(g) for i, g in enumerate(gens)}
    results: dict[int, object] = {}
    batches = []
    while needs:
        decoding = [i for i, step in needs.items() if isinstance(step, DecodeStep)]
        chunking = [i for i, step in needs.items() if step is CHUNK]
        sent = {i: None for i in chunking}
        if decoding:
            batches.append(len(decoding))
            logits = decode_batch([needs[i] for i in decoding])
            sent.update(zip(decoding, logits))
        for i, value in sent.items():
            try:
                needs[i] = gens[i].send(value)
            except StopIteration as done:
                results[i] = done.value
                del needs[i]
    return [results[i].token_ids for i in range(len(prompts))], engines, batches


def test_interleaved_generations_give_each_sequence_the_tokens_and_rows_it_gets_alone(model):
    prompts = [_prompt(1, 70), _prompt(2, 9), _prompt(3, 33), _prompt(4, 17)]
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 7, 15)]
    tokens, engines, batches = _together(model, prompts, params)
    assert max(batches) == 4, "the decode steps were never batched"
    for prompt, p, out, engine in zip(prompts, params, tokens, engines):
        alone, ref = _alone(model, prompt, p)
        assert out == alone
        assert engine.token_ids == ref.token_ids and engine.taint == ref.taint
        for name, section in ref.state.sections.items():
            assert torch.equal(engine.state.sections[name], section), name
        for name, view in ref.state.views.items():
            rows = engine.length
            assert torch.equal(view.tensor.narrow(view.token_axis, 0, rows),
                               engine.state.views[name].tensor.narrow(view.token_axis, 0, rows))


def test_a_batched_step_gives_each_sequence_the_logits_it_gets_alone(model):
    prompts = [_prompt(5, 20), _prompt(6, 40), _prompt(7, 3)]
    engines = [Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS) for _ in prompts]
    alone = [Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS) for _ in prompts]
    for e, a, p in zip(engines, alone, prompts):
        e.prefill(p)
        a.prefill(p)
    for step in range(5):
        tokens = [10 + step + i for i in range(len(prompts))]  # in every vocab here
        batched = decode_batch([DecodeStep(e, t) for e, t in zip(engines, tokens)])
        for a, t, row in zip(alone, tokens, batched):
            assert torch.equal(a.decode(t), row)


def test_prefill_steps_yield_a_chunk_marker_between_chunks_only(model):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    steps = engine.prefill_steps(_prompt(8, 3 * CHUNK_ROWS + 5))
    seen = []
    with pytest.raises(StopIteration) as done:
        while True:
            seen.append(next(steps))
            seen.append(engine.length)
            # Suspended between chunks, the prefill leaves the thread out of inference mode:
            # what runs meanwhile (another sequence's copies) makes ordinary tensors.
            assert not torch.is_inference_mode_enabled()
    assert seen == [CHUNK, 16, CHUNK, 32, CHUNK, 48]
    assert done.value.value is not None and engine.length == 3 * CHUNK_ROWS + 5
    assert run_steps(Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS).prefill_steps(
        _prompt(8, 5))) is not None


def test_one_sequence_twice_in_a_batch_is_refused(model):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
    engine.prefill(_prompt(9, 4))
    with pytest.raises(ValueError, match="twice"):
        decode_batch([DecodeStep(engine, 5), DecodeStep(engine, 6)])
    assert engine.length == 4
