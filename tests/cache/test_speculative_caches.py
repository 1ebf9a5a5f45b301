"""The caches after a speculative turn (spec: "The end anchor", "Session cache"): a generation
that stopped inside an accepted verify block has rows past its committed tokens. The end anchor
cuts the pending commit back to them (trim_pending) and is kept there; a session put declines
them unless session_trim cuts first; a state that already absorbed them keeps no end.

Gate: greedy. Verify blocks wrote these states, so every resume here is held to the same greedy
tokens as a cold run of the same prompt (and, where an engine with no cache can make the same
verify blocks, to its bits).
"""

import pytest

from resident_rig import assert_bit_exact
from store_rig import StoreRig
from tandem.engine import Engine, SamplingParams
from tandem.models.hybrid import HybridModel

CHUNK = 64


@pytest.fixture(scope="module")
def model(qwen3_5_dir):
    return HybridModel.load(qwen3_5_dir)


def repetitive(n: int) -> list[int]:
    return [(i % 9) * 13 + 5 for i in range(n)]


def echo(prompt, reference):
    """A drafter that knows the answer: every draft is accepted."""
    def draft(context, k):
        done = len(context) - len(prompt)
        return list(reference[done:done + k])
    return draft


def cold_tokens(model, prompt, n=12):
    return Engine(model, window=2048, prefix_chunk=CHUNK).generate(
        prompt, SamplingParams(max_tokens=n)).token_ids


def stopped_turn(rig, model, prompt, session="s"):
    """A speculative turn that ends on a stop token inside an accepted block."""
    reference = cold_tokens(model, prompt, 30)
    stop = reference[8]
    first = reference.index(stop)
    rig.planner.begin(prompt, 30, session)
    out = rig.engine.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,)),
                              on_chunk=rig.planner.on_chunk, draft=echo(prompt, reference),
                              draft_max=8).token_ids
    assert out == reference[:first]
    assert rig.engine.length > len(prompt) + len(out)  # the block ran past the stop
    rig.planner.finish(prompt + out, session)
    rig.planner.check_invariants()
    return out, stop


def test_the_end_anchor_trims_the_pending_commit_and_the_next_turn_resumes_there(model):
    rig = StoreRig(model)
    prompt = repetitive(150)
    out, stop = stopped_turn(rig, model, prompt)
    committed = prompt + out
    assert rig.resident.end.length == len(committed) == rig.engine.length
    assert rig.core.stats.declined_short == 1  # session_trim off: the put declined first
    follow = committed + [stop, 7, 8, 9]
    resume, again = rig.turn(follow, "s", max_tokens=12)
    assert (resume.source, resume.start) == ("end", len(committed))
    assert again == cold_tokens(model, follow)


def test_session_trim_cuts_the_commit_before_the_session_snapshot(model):
    rig = StoreRig(model, session_trim=True)
    prompt = repetitive(150)
    out, stop = stopped_turn(rig, model, prompt)
    committed = prompt + out
    assert rig.core.stats.declined_short == 0
    assert rig.store.statistics()["session_entries"] == 1
    rig.turn(list(range(3, 200)), "other", max_tokens=4)  # replaces the rows in place
    follow = committed + [stop, 7, 8, 9]
    resume, again = rig.turn(follow, "s", max_tokens=12)
    assert (resume.source, resume.start) == ("store", len(committed))
    assert again == cold_tokens(model, follow)
    # The bits too: an engine with no cache that ran the same speculative turn, cut its
    # pending commit back to the committed tokens and went on forwarded the same inputs.
    reference = cold_tokens(model, prompt, 30)
    plain = Engine(model, window=2048, prefix_chunk=CHUNK)
    plain.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,)),
                   draft=echo(prompt, reference), draft_max=8)
    assert plain.trim_pending(len(committed))
    assert plain.generate(follow, SamplingParams(max_tokens=12)).token_ids == again
    assert rig.engine.token_ids == plain.token_ids
    assert_bit_exact(rig.engine, plain, plain.length)


def test_a_state_that_absorbed_uncommitted_tokens_keeps_no_end(model):
    rig = StoreRig(model)
    prompt = repetitive(150)
    reference = cold_tokens(model, prompt, 30)
    stop = reference[8]
    rig.planner.begin(prompt, 30, "s")
    rig.engine.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,)),
                        on_chunk=rig.planner.on_chunk, draft=echo(prompt, reference),
                        draft_max=8)
    rig.engine.settle()  # something landed the commit before the end was kept
    committed = prompt + reference[:reference.index(stop)]
    assert rig.engine.length > len(committed)
    rig.planner.finish(committed, "s")
    assert rig.resident.end is None
    assert rig.resident.statistics()["end_absorbed"] == 1
