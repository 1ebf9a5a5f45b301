"""Speculative verify blocks, pending commits, settle and trim_pending.

Gates: speculative greedy output equals plain greedy output token for token (greedy gate); the
state after settle() equals the plain run's bit for bit where the same forwards ran (no drafts,
or the same drafts twice) and gives the same greedy tokens otherwise; a sampled run keeps the
target's distribution (a statistical check with fixed seeds, never a timing).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tandem.engine import Engine, SamplingParams
from tandem.models.third import ThirdModel

WINDOW, CHUNK = 512, 64


def repetitive(n: int) -> list[int]:
    return [(i % 7) * 11 + 3 for i in range(n)]


def fresh(n: int, seed: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain(model, prompt, max_tokens=40):
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
    return engine, result


def echo_drafter(prompt, reference, corrupt_every=0):
    """Proposes the reference continuation; with ``corrupt_every`` it gets some tokens wrong."""
    calls = [0]

    def draft(context, k):
        calls[0] += 1
        done = len(context) - len(prompt)
        proposal = list(reference[done:done + k])
        if corrupt_every and proposal and calls[0] % corrupt_every == 0:
            proposal[-1] = (proposal[-1] + 1) % 90
        return proposal
    return draft


def lookup_drafter(context, k):
    """The prompt-lookup rule in a few lines: what followed the last earlier 2-gram match."""
    tail = context[-2:]
    for i in range(len(context) - 3, -1, -1):
        if context[i:i + 2] == tail:
            return context[i + 2:i + 2 + k]
    return []


def sections(engine):
    return {k: v.clone() for k, v in engine.cache_state().sections.items()}


@pytest.mark.parametrize("prompt", [repetitive(60), fresh(50, 1), fresh(33, 2) + repetitive(30)])
@pytest.mark.parametrize("drafter", ["lookup", "echo", "echo_wrong", "nonsense"])
def test_speculative_greedy_writes_the_plain_greedy_tokens(model, prompt, drafter):
    ref_engine, ref = plain(model, prompt)
    draft = {"lookup": lookup_drafter,
             "echo": echo_drafter(prompt, ref.token_ids),
             "echo_wrong": echo_drafter(prompt, ref.token_ids, corrupt_every=2),
             "nonsense": lambda context, k: [1] * k}[drafter]
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=40), draft=draft, draft_max=4)
    assert result.token_ids == ref.token_ids
    assert engine.token_ids == ref_engine.token_ids  # rows end one short of prompt + output
    assert 0 <= result.accepted <= result.drafted
    if drafter == "echo":
        assert result.accepted == result.drafted > 0
    if drafter == "nonsense":
        assert result.drafted > 0
    # The state the verify blocks wrote continues exactly as the plain run's does.
    follow = prompt + ref.token_ids + [7, 8, 9]
    a = ref_engine.generate(follow, SamplingParams(max_tokens=16)).token_ids
    b = engine.generate(follow, SamplingParams(max_tokens=16)).token_ids
    assert a == b


def test_without_drafts_the_state_is_the_plain_runs_bit_for_bit(model):
    prompt = fresh(40, 3)
    ref_engine, ref = plain(model, prompt)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=40), draft=lambda c, k: [],
                             draft_max=4)
    assert result.token_ids == ref.token_ids and result.drafted == 0
    want, got = sections(ref_engine), sections(engine)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_drafting_rests_after_rejected_blocks_and_comes_back_after_an_accepted_one(model):
    """Gate: the same greedy tokens. A block whose every draft is rejected costs more than the
    step it replaces, so drafting rests 1, 2, 4, ... tokens after such blocks in a row (engine
    DRAFT_REST_MAX), and an accepted draft ends the rest."""
    prompt = fresh(40, 5)
    _, ref = plain(model, prompt, max_tokens=40)
    asked = []

    def bad(k):  # never the model's token: every block rejected
        return [(ref.token_ids[0] + 1 + i) % 200 for i in range(k)]

    def wrong(context, k):
        asked.append(len(context))
        return bad(k)

    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=40), draft=wrong, draft_max=4)
    assert result.token_ids == ref.token_ids and result.accepted == 0
    # asked at output lengths 0, 2, 5, 10, 19, 36 (rests of 1, 2, 4, 8, 16 between)
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps == [2, 3, 5, 9, 17][:len(gaps)] and len(asked) == 6
    right = echo_drafter(prompt, ref.token_ids)
    asked.clear()

    def once_wrong(context, k):  # wrong at the first block, right after
        asked.append(len(context))
        return bad(k) if len(asked) == 1 else right(context, k)

    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=40), draft=once_wrong,
                             draft_max=4)
    assert result.token_ids == ref.token_ids and result.accepted > 20
    assert asked[1] - asked[0] == 2  # one token's rest, then drafting again


def test_the_same_verify_blocks_write_the_same_bits(model):
    prompt = repetitive(50)
    runs = []
    for _ in range(2):
        engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
        engine.generate(prompt, SamplingParams(max_tokens=30), draft=lookup_drafter, draft_max=3)
        engine.settle()
        state = engine.cache_state()
        rows = {k: v.rows(0, engine.length).clone() for k, v in state.views.items()}
        runs.append((sections(engine), rows, list(engine.token_ids)))
    (s1, r1, t1), (s2, r2, t2) = runs
    assert t1 == t2
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert all(torch.equal(r1[k], r2[k]) for k in r1)


def test_a_stop_inside_an_accepted_block_leaves_rows_ahead_and_trim_pending_cuts_them(model):
    prompt = repetitive(60)
    ref_engine, ref = plain(model, prompt, max_tokens=40)
    stop = ref.token_ids[6]
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    result = engine.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=(stop,)),
                             draft=echo_drafter(prompt, ref.token_ids), draft_max=8)
    assert result.finish_reason == "stop"
    committed = prompt + result.token_ids
    assert engine.length > len(committed)  # the block ran past the stop token
    assert engine.pending is not None
    assert engine.trim_pending(len(committed))
    assert engine.token_ids == committed and engine.pending is not None
    # Then a copy, then a resume: the same greedy tokens as never stopping.
    state = engine.cache_state()  # lands the trimmed commit
    saved = sections(engine)
    rows = {k: v.rows(0, engine.length).clone() for k, v in state.views.items()}
    engine.generate(fresh(20, 9), SamplingParams(max_tokens=5))  # something else runs
    live = engine.cache_state()
    for k, t in saved.items():
        live.sections[k].copy_(t)
    for k, r in rows.items():
        live.views[k].rows(0, r.shape[live.views[k].token_axis]).copy_(r)
    engine.resume_at(len(committed), committed)
    follow = committed + [stop]
    cold_tokens = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(
        follow, SamplingParams(max_tokens=20)).token_ids
    assert engine.generate(follow, SamplingParams(max_tokens=20)).token_ids == cold_tokens


def test_trim_pending_refuses_once_the_commit_landed(model):
    prompt = repetitive(60)
    _, ref = plain(model, prompt, max_tokens=20)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    # The stop falls inside the second block (the first asks for 4 drafts, the second for 8).
    params = SamplingParams(max_tokens=20, stop_token_ids=(ref.token_ids[6],))
    result = engine.generate(prompt, params, draft=echo_drafter(prompt, ref.token_ids),
                             draft_max=8)
    committed = len(prompt) + len(result.token_ids)
    assert engine.length > committed
    engine.settle()
    assert not engine.trim_pending(committed)
    assert engine.trim_pending(engine.length)  # nothing to cut is always fine


def test_trim_to_the_blocks_start_restores_the_state_before_it(model):
    prompt = fresh(30, 4)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    engine.prefill(prompt)
    before = sections(engine)
    engine.verify([5, 6, 7])
    assert engine.trim_pending(len(prompt))
    assert engine.pending is None and engine.taint is None and engine.token_ids == prompt
    after = sections(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- sampled: the target's distribution -----------------------------------------------------

@pytest.mark.parametrize("prompt", [repetitive(60), fresh(50, 5)])
def test_a_seeded_sampled_run_writes_the_same_tokens_with_speculation_as_without(model, prompt):
    """One draw a position from the request's generator, in order: the drafts never change what
    a seed writes (the accepted ones are exactly the tokens drawn)."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11)
    want = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(prompt, params)
    engine = Engine(model, window=WINDOW, prefix_chunk=CHUNK)
    got = engine.generate(prompt, params, draft=lookup_drafter, draft_max=4)
    assert got.token_ids == want.token_ids
    echo = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(
        prompt, params, draft=echo_drafter(prompt, want.token_ids), draft_max=4)
    assert echo.token_ids == want.token_ids and echo.accepted == echo.drafted > 0


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}])
@pytest.mark.parametrize("drafter", ["lookup", "echo", "echo_wrong"])
def test_penalties_and_logit_bias_give_the_same_tokens_with_speculation_as_without(
        model, sampling, drafter):
    """In a verify block the processors at position i see the output and the drafts before
    it, as the position would without speculation."""
    prompt = repetitive(60)
    params = SamplingParams(max_tokens=40, presence_penalty=0.7, frequency_penalty=0.4,
                            logit_bias=((3, 2.0), (14, -1.5)), **sampling)
    want = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(prompt, params)
    draft = {"lookup": lookup_drafter, "echo": echo_drafter(prompt, want.token_ids),
             "echo_wrong": echo_drafter(prompt, want.token_ids, corrupt_every=2)}[drafter]
    got = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(prompt, params, draft=draft,
                                                                    draft_max=4)
    assert got.token_ids == want.token_ids
    if drafter == "echo":
        assert got.accepted == got.drafted > 0


def _exact_joint(model, prompt, vocab):
    """P(t1, t2 | prompt) from the target's own logits, every pair."""
    engine = Engine(model, window=64, prefix_chunk=16)
    first = torch.softmax(engine.prefill(prompt), -1)
    joint = {}
    for t1 in range(vocab):
        engine.resume_at(0)
        second = torch.softmax(engine.prefill(prompt + [t1]), -1)
        for t2 in range(vocab):
            joint[(t1, t2)] = (first[t1] * second[t2]).item()
    return joint


def test_a_sampled_speculative_run_has_the_targets_distribution():
    vocab = 4
    model = ThirdModel(vocab_size=vocab, hidden=12, heads=2, seed=5)
    prompt = [0, 1, 2, 3, 1]
    joint = _exact_joint(model, prompt, vocab)
    engine = Engine(model, window=64, prefix_chunk=16)
    n = 2000
    counts = Counter()
    drafts = Counter()
    for seed in range(n):
        result = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=seed),
                                 draft=lambda c, k: [1, 2][:k], draft_max=2)
        counts[tuple(result.token_ids[:2])] += 1
        drafts[result.accepted] += 1
    assert len(drafts) > 1  # both the accepted and the rejected path ran
    chi2 = 0.0
    for pair, prob in joint.items():
        expected = n * prob
        chi2 += (counts[pair] - expected) ** 2 / expected
    assert sum(counts.values()) == n
    assert chi2 < 37.7, (chi2, counts)  # df 15, p = 0.001
    assert not math.isnan(chi2)


def test_forced_tokens_are_the_targets_in_a_verify_block_too(model):
    """A reasoning budget's hidden close (force) at positions 6-8: drafts that match it are
    accepted, drafts that do not are replaced by it, as without speculation."""
    prompt = repetitive(60)

    def force(out):
        return [1, 2, 3][len(out) - 6] if 6 <= len(out) < 9 else None

    want = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(
        prompt, SamplingParams(max_tokens=30), force=force)
    assert want.token_ids[6:9] == [1, 2, 3]
    for draft in (lookup_drafter, echo_drafter(prompt, want.token_ids), lambda c, k: [1] * k):
        got = Engine(model, window=WINDOW, prefix_chunk=CHUNK).generate(
            prompt, SamplingParams(max_tokens=30), force=force, draft=draft, draft_max=4)
        assert got.token_ids == want.token_ids
