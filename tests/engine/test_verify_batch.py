"""Verify blocks in the batched step (issue 14, part 3): a step in which some sequences decode one
token and others verify a block of drafts is one forward over the weights (decode_batch with
VerifySteps: HybridModel.forward_ragged), and every sequence gets the bits it gets alone
(torch.equal: logits, the pending block's sections, the rows), the accepted state after
settle or trim_pending included. On the small hybrid (recurrent decay near 1: a neighbour's
state mixed in would change the tokens) and the third architecture (no forward_ragged: its
decodes batched, its blocks alone)."""

import random

import torch

from tandem.engine import CHUNK, DecodeStep, Engine, SamplingParams, VerifyStep, decode_batch
from test_engine_steps import _alone, _prompt
from test_speculation import lookup_drafter, repetitive

WINDOW, CHUNK_ROWS = 256, 16


def _engines(model, prompts):
    out = []
    for p in prompts:
        e = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
        e.prefill(p)
        out.append(e)
    return out


def _same_state(got: Engine, want: Engine):
    assert got.token_ids == want.token_ids and got.taint == want.taint
    g, w = got.cache_state(), want.cache_state()  # pending commits landed
    for name, section in w.sections.items():
        assert torch.equal(g.sections[name], section), name
    for name, view in w.views.items():
        assert torch.equal(g.views[name].rows(0, got.length), view.rows(0, want.length)), name


def _mixed_steps(rng, engines, step):
    """A step for each engine: a decode or a block of 2 to 9 tokens, chosen at random."""
    out = []
    for i, e in enumerate(engines):
        n = rng.choice([1, 1, 2, 3, 5, 9])
        tokens = [(7 * step + 13 * i + j) % 80 + 3 for j in range(n)]
        out.append(DecodeStep(e, tokens[0]) if n == 1 else VerifyStep(e, tuple(tokens)))
    return out


def _alone_step(step):
    return (step.engine.verify(step.token_ids) if isinstance(step, VerifyStep)
            else step.engine.decode(step.token_id))


def test_a_batch_of_decode_rows_and_verify_blocks_gives_each_sequence_the_bits_it_gets_alone(
        model):
    prompts = [_prompt(20 + i, n) for i, n in enumerate((5, 40, 17, 23, 9))]
    batched, alone = _engines(model, prompts), _engines(model, prompts)
    rng = random.Random(4)
    kinds = set()
    for step in range(6):
        steps = _mixed_steps(rng, batched, step)
        kinds.add(tuple(isinstance(s, VerifyStep) for s in steps))
        got = decode_batch(steps)
        for s, rows, a in zip(steps, got, alone):
            want = _alone_step(type(s)(a, *([s.token_ids] if isinstance(s, VerifyStep)
                                            else [s.token_id])))
            assert got is not None and rows.shape == want.shape
            assert torch.equal(rows, want), (step, type(s).__name__)
            if isinstance(s, VerifyStep):
                # a block's pending sections are the unbatched path's, whatever is accepted
                for name, kept in a.pending.steps.items():
                    assert torch.equal(s.engine.pending.steps[name], kept), name
                count = rng.randrange(len(s.token_ids))
                s.engine.accept(count)
                a.accept(count)
        for b, a in zip(batched, alone):
            _same_state(b, a)
    assert any(any(k) and not all(k) for k in kinds), "no step mixed decodes and blocks"


def test_accept_and_rollback_after_a_batched_verify_leave_the_unbatched_paths_state(model):
    prompts = [_prompt(31, 12), _prompt(32, 30), _prompt(33, 7)]
    batched, alone = _engines(model, prompts), _engines(model, prompts)
    blocks = [(4, 5, 6, 7, 8), None, (9, 10, 11)]
    steps = [VerifyStep(e, b) if b else DecodeStep(e, 12) for e, b in zip(batched, blocks)]
    decode_batch(steps)
    for a, b in zip(alone, blocks):
        a.verify(b) if b else a.decode(12)
    # slot 0 keeps two drafts, then cuts back inside them (a stop string); slot 2 rejects all
    for engines in (batched, alone):
        engines[0].accept(2)
        assert engines[0].trim_pending(engines[0].length - 1)
        engines[2].accept(0)
        assert engines[2].trim_pending(len(prompts[2]))  # back to before the block
    for b, a in zip(batched, alone):
        _same_state(b, a)
    # and they go on decoding alike, the next step batched again
    got = decode_batch([DecodeStep(e, 20 + i) for i, e in enumerate(batched)])
    for i, (row, a) in enumerate(zip(got, alone)):
        assert torch.equal(row, a.decode(20 + i))
        _same_state(batched[i], a)


def test_a_verify_block_leaves_the_sections_decoding_its_tokens_one_by_one_leaves(hybrid):
    """forward_ragged runs a block's rows on decode's arithmetic: each position's kept
    sections and the rows are the bits of decoding the block token by token, so an accepted
    block's state is plain decoding's, not within rounding of it."""
    prompt = _prompt(41, 29)
    block = (5, 17, 29, 41, 53, 65)
    spec, plain = _engines(hybrid, [prompt, prompt])
    other = _engines(hybrid, [_prompt(42, 11)])[0]
    logits = decode_batch([DecodeStep(other, 3), VerifyStep(spec, block)])[1]
    for j, token in enumerate(block):
        want = plain.decode(token)
        # the verify rows' head is one mm over the block: within rounding of decode's
        assert torch.allclose(logits[j], want, atol=1e-4, rtol=0)
        for name, section in plain.state.sections.items():
            assert torch.equal(spec.pending.steps[name][j], section), (name, j)
    spec.settle()
    _same_state(spec, plain)


def _together(model, prompts, params, draft):
    """Every generation one step a round: a chunk, then every decode step and verify block
    waiting forwarded as one batch. The tokens, engines and the batches' kinds."""
    engines = [Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS) for _ in prompts]
    gens = [e.generate_steps(p, q, draft=draft, draft_max=8)
            for e, p, q in zip(engines, prompts, params)]
    needs = {i: next(g) for i, g in enumerate(gens)}
    results, batches = {}, []
    while needs:
        stepping = [i for i, s in needs.items() if isinstance(s, (DecodeStep, VerifyStep))]
        sent = {i: None for i, s in needs.items() if s is CHUNK}
        if stepping:
            batches.append([type(needs[i]).__name__ for i in stepping])
            sent.update(zip(stepping, decode_batch([needs[i] for i in stepping])))
        for i, value in sent.items():
            try:
                needs[i] = gens[i].send(value)
            except StopIteration as done:
                results[i] = done.value
                del needs[i]
    return [results[i] for i in range(len(prompts))], engines, batches


def _drafter(context, k):
    """The lookup rule, else on every third length the last token again: a function of the
    context alone (so a sequence drafts the same alone and batched) that drafts often, right
    and wrong, and leaves some steps plain decodes."""
    return lookup_drafter(context, k) or ([context[-1]] * k if len(context) % 3 == 0 else [])


def test_generations_with_speculation_batched_give_the_tokens_and_rows_of_each_alone(model):
    prompts = [repetitive(40), _prompt(2, 9) * 3, repetitive(25) + _prompt(3, 8),
               _prompt(4, 17)]
    params = [SamplingParams(max_tokens=n) for n in (24, 20, 16, 18)]
    results, engines, batches = _together(model, prompts, params, _drafter)
    assert any("VerifyStep" in b and "DecodeStep" in b for b in batches), batches
    assert any(b.count("VerifyStep") > 1 for b in batches), batches
    for prompt, p, result, engine in zip(prompts, params, results, engines):
        alone = Engine(model, window=WINDOW, prefix_chunk=CHUNK_ROWS)
        spec = alone.generate(prompt, p, draft=_drafter, draft_max=8)
        assert result.token_ids == spec.token_ids
        assert (result.drafted, result.accepted) == (spec.drafted, spec.accepted)
        _same_state(engine, alone)
        # speculation on writes the tokens of speculation off
        assert result.token_ids == _alone(model, prompt, p)[0]


def test_long_blocks_and_a_one_token_block_are_their_own_bits_in_a_batch(model):
    """The verify rows' head takes groups of whole blocks up to VERIFY_HEAD_ROWS rows: a block
    longer than a group splits (its last call reaching back), a one-token block is a verify
    still (its sections kept, not advanced), and each is the bits it gets alone."""
    prompts = [_prompt(50 + i, 10 + i) for i in range(5)]
    batched, alone = _engines(model, prompts), _engines(model, prompts)
    lengths = (40, 1, 20, 20, 1)
    steps = [VerifyStep(e, tuple((5 * i + j) % 80 + 3 for j in range(n))) if i != 4
             else DecodeStep(e, 9) for i, (e, n) in enumerate(zip(batched, lengths))]
    got = decode_batch(steps)
    for s, rows, a in zip(steps, got, alone):
        want = a.verify(s.token_ids) if isinstance(s, VerifyStep) else a.decode(s.token_id)
        assert torch.equal(rows, want)
    assert batched[1].pending is not None and batched[1].pending.index == 0
    for b, a in zip(batched, alone):
        _same_state(b, a)  # pending commits landed
