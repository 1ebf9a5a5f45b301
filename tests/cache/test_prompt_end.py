"""The prompt-end anchor: the state a prompt's prefill left, copied before the first decode, with
the last position's logits. The same prompt again (a regenerate, a retry) forwards nothing; a
prompt that goes on from it but not from its answer (a stopped or edited answer) resumes there.

Gate: bit-exact. The copy is the cold prefill's state at the prompt's end and the rows under it
are the prefill's rows, left in place (decoding only appends past them), so the logits the first
token is sampled from and the state after the prompt are torch.equal to a cold prefill's; the
greedy tokens are then the cold run's too.
"""

import pytest
import torch

from resident_rig import Rig, assert_bit_exact, assert_uninterrupted, cold, tokens, uninterrupted
from store_rig import StoreRig
from tandem.cache.resident import ResidentPrefix
from tandem.engine import Engine, SamplingParams
from tandem.models.base import prompt_logits
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def no_prefill(engine: Engine) -> None:
    """Make any forward of the prompt fail: the repeat must forward 0 tokens."""
    def prefill(*args, **kwargs):
        raise AssertionError("the prompt was forwarded again")
    engine.prefill = prefill


def repeat(rig: Rig, prompt: list[int], max_tokens: int = 16, session: str | None = "s",
           namespace: str = ""):
    """The same prompt again: begin, check the restored state against a cold prefill's
    before anything decodes, then generate from the kept logits without a forward."""
    resume = rig.resident.begin(prompt, max_tokens, session, namespace)
    assert (resume.source, resume.start) == ("prompt_end", len(prompt)), resume
    engine, want = cold(rig.model, prompt)
    assert rig.engine.length == len(prompt)
    assert torch.equal(prompt_logits(resume.logits), want)
    assert_bit_exact(rig.engine, engine, len(prompt))
    no_prefill(rig.engine)
    try:
        result = rig.engine.generate(prompt, SamplingParams(max_tokens=max_tokens),
                                     on_chunk=rig.resident.on_chunk,
                                     on_prefill=rig.resident.on_prefill, logits=resume.logits)
    finally:
        del rig.engine.prefill
    rig.resident.finish()
    rig.resident.check_invariants()
    assert result.reused_tokens == len(prompt)
    return result.token_ids


def test_the_same_prompt_again_forwards_nothing_and_is_the_cold_prefill_bit_for_bit(model):
    rig = Rig(model)
    prompt = tokens(model.vocab_size, 200, 1)  # 200: no grid line, the last chunk partial
    resume, first = rig.turn(prompt, session="s")
    assert resume.source == "cold" and rig.resident.prompt_end.length == 200
    again = repeat(rig, prompt)
    assert again == first == uninterrupted(model, [prompt])[0]
    # And a third time: the copy is still the prefill's, not the second answer's state.
    assert repeat(rig, prompt) == first
    assert rig.resident.stats.prompt_end_hits == 2


def test_a_repeat_after_a_one_token_answer_takes_it_too(model):
    rig = Rig(model)
    prompt = tokens(model.vocab_size, 130, 2)
    _, first = rig.turn(prompt, session="s", max_tokens=1)
    assert rig.engine.length == 130  # the one token was sampled, never forwarded
    assert repeat(rig, prompt, max_tokens=1) == first


def test_a_prompt_that_differs_in_its_last_token_does_not_take_it(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, 3)
    rig.turn(prompt, session="s")
    other = prompt[:-1] + [(prompt[-1] + 1) % v]
    resume, out = rig.turn(other, session="s")
    assert resume.source == "resident" and resume.start == 192
    assert_uninterrupted(rig.engine, model, [other], [out])  # a grid resume: cold tokens, bits


def test_a_prefix_of_the_prompt_does_not_take_it(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, 4)
    rig.turn(prompt, session="s")
    assert rig.resident.offer(prompt[:-1]).source != "prompt_end"
    assert rig.resident.offer(prompt).source == "prompt_end"


def _parting(model, seed: int, cut: int):
    """A turn, then the prompt with the answer cut after ``cut`` of its tokens (a client that
    stopped the stream: the rows hold the tokens decoded after what it saw) and a new
    message: it parts from the rows inside the answer."""
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, seed)  # no grid line at its end: the last line is 192
    _, first = rig.turn(prompt, session="s")
    nxt = prompt + first[:cut] + tokens(v, 20, seed + 100)
    assert nxt[:200 + cut + 1] != rig.engine.token_ids[:200 + cut + 1]
    return rig, prompt, nxt


@pytest.mark.parametrize("cut", [1, 5])
def test_a_prompt_that_goes_on_from_part_of_the_answer_resumes_at_the_prompts_end(model, cut):
    """Gate: the state restored at the prompt's end is the cold prefill's, bit for bit; the
    rest is forwarded from there, off the grid (taint at the prompt's end), and the greedy
    tokens are the cold run's."""
    rig, prompt, nxt = _parting(model, 40 + cut, cut)
    resume = rig.resident.begin(nxt, 16, "s")
    assert (resume.source, resume.start, resume.logits) == ("prompt_end", 200, None)
    engine, _ = cold(model, prompt)
    assert rig.engine.length == 200
    assert_bit_exact(rig.engine, engine, 200)
    result = rig.engine.generate(nxt, SamplingParams(max_tokens=16),
                                 on_chunk=rig.resident.on_chunk,
                                 on_prefill=rig.resident.on_prefill)
    rig.resident.finish()
    rig.resident.check_invariants()
    assert result.reused_tokens == 200
    assert rig.engine.taint == 200  # resumed off the grid: the greedy gate from here on
    assert result.token_ids == uninterrupted(model, [nxt])[0]
    assert rig.resident.stats.prompt_end_hits == 1
    assert rig.resident.prompt_end.token_ids == nxt  # the new prompt's, in the buffers


def test_a_prompt_that_parts_right_at_the_prompts_end_resumes_on_the_grid_bit_for_bit(model):
    """Gate: bit for bit. Nothing it shares was decoded (another answer, or a completion's
    prompt going on otherwise), so it resumes at the grid line under the prompt's end."""
    rig, prompt, nxt = _parting(model, 50, 0)
    resume, logits = rig.prefill(nxt, session="s")
    assert (resume.source, resume.start) == ("resident", 192)
    assert rig.engine.taint is None
    engine, want = cold(model, nxt)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(nxt))


def test_the_end_anchor_or_a_grid_line_past_the_prompts_end_is_taken_before_it(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, 60)
    _, first = rig.turn(prompt, session="s")
    # the copy sends the whole answer back: it goes on from the end anchor, later still
    assert rig.resident.offer(prompt + first[:15] + [3, 4]).source == "end"
    # a prompt whose prefill passes a grid line past the prompt's end keeps its anchor there
    longer = prompt + first[:2] + tokens(v, 100, 61)
    resume, out = rig.turn(longer, session="s")
    assert resume.source == "prompt_end" and resume.start == 200
    # the next one resumes at the new prompt's end, past the grid line 256 its prefill passed
    assert rig.resident.offer(longer + out[:1] + [9]).start == len(longer)


def test_another_namespace_does_not_take_it(model):
    rig = Rig(model)
    prompt = tokens(model.vocab_size, 200, 5)
    rig.turn(prompt, session="s")
    resume, _ = rig.turn(prompt, session="s", namespace="tenant-b")
    assert (resume.source, resume.start) == ("cold", 0)
    # Tenant b's prefill wrote every row: the shared namespace's copy went with them (its
    # rows are parked, and come back from the park, not from the prompt's end).
    assert rig.resident.offer(prompt).source != "prompt_end"


def test_a_guest_between_the_two_leaves_it_in_place(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 300, 6)
    _, first = rig.turn(prompt, session="s")
    resume, _ = rig.turn(tokens(v, 40, 7), session="s")  # a title request
    assert resume.guest
    assert repeat(rig, prompt) == first


def test_a_prefill_that_writes_below_the_prompts_end_drops_it(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 300, 8)
    rig.turn(prompt, session="s")
    other = prompt[:200] + tokens(v, 50, 9)
    resume, _ = rig.turn(other, session="s")
    assert resume.start == 192
    assert rig.resident.prompt_end.token_ids == other  # the newest prompt's, in its buffers
    resume, out = rig.turn(prompt, session="s")
    assert resume.source == "resident" and resume.start == 192
    assert_uninterrupted(rig.engine, model, [prompt], [out])  # a grid resume: cold tokens, bits


def test_shedding_it_gives_its_bytes_back():
    model = ThirdModel()
    rig = Rig(model)
    prompt = tokens(model.vocab_size, 100, 10)
    rig.turn(prompt, session="s")
    held = rig.memory.held["prompt_end"]
    assert held == rig.engine.cache_state().section_nbytes() + 4 * model.vocab_size
    assert rig.resident.shed("prompt_end", 1) == held
    assert rig.resident.prompt_end is None and rig.memory.held["prompt_end"] == 0
    assert rig.resident.offer(prompt).source != "prompt_end"
    rig.resident.check_invariants()


def test_with_the_knob_off_none_is_kept():
    model = ThirdModel()
    rig = Rig(model)
    rig.resident = ResidentPrefix(rig.engine, rig.memory, prompt_end_anchor=False)
    prompt = tokens(model.vocab_size, 100, 11)
    rig.turn(prompt, session="s")
    assert rig.resident.prompt_end is None and rig.memory.held["prompt_end"] == 0
    assert rig.resident.offer(prompt).source == "resident"


def test_initial_logits_need_the_whole_prompt_in_place():
    model = ThirdModel()
    engine = Engine(model, window=512, prefix_chunk=64)
    prompt = tokens(model.vocab_size, 100, 12)
    logits = engine.prefill(prompt[:99])
    with pytest.raises(ValueError, match="whole prompt"):
        engine.generate(prompt, SamplingParams(max_tokens=4), logits=logits)
    assert engine.length == 99  # nothing moved


def echo(prompt, reference):
    """A drafter that knows the answer: every draft is accepted."""
    def draft(context, k):
        done = len(context) - len(prompt)
        return list(reference[done:done + k])
    return draft


def test_after_a_speculative_turn_it_holds_the_state_before_any_verify_block():
    """Verify blocks leave commits pending and the store takes a session snapshot: the copy
    was taken before either, and the planner prefers it to any store entry."""
    model = ThirdModel()
    rig = StoreRig(model)
    prompt = [(i % 7) * 13 + 5 for i in range(150)]
    reference = uninterrupted(model, [prompt], max_tokens=20)[0]
    resume, first = rig.turn(prompt, session="s", max_tokens=20,
                             draft=echo(prompt, reference), draft_max=8)
    assert first == reference
    resume = rig.planner.begin(prompt, 20, "s")
    assert (resume.source, resume.start) == ("prompt_end", 150)
    engine, want = cold(model, prompt)
    assert torch.equal(prompt_logits(resume.logits), want)
    assert_bit_exact(rig.engine, engine, 150)
    no_prefill(rig.engine)
    result = rig.engine.generate(prompt, SamplingParams(max_tokens=20),
                                 on_chunk=rig.planner.on_chunk, on_prefill=rig.planner.on_prefill,
                                 logits=resume.logits, draft=echo(prompt, reference), draft_max=8)
    del rig.engine.prefill
    rig.planner.finish(prompt + result.token_ids, "s")
    rig.planner.check_invariants()
    assert result.token_ids == reference


def test_a_store_restore_under_the_prompts_end_drops_it():
    """A restore writes every row under its line: the prompt's rows come back as the stored
    copy's (the same tokens, forwarded in a full chunk there, not in a partial last one: equal
    bits on these CPU models, not promised by every kernel), so the prompt-end anchor over them
    is dropped even where its tokens still match."""
    model = ThirdModel()
    v = model.vocab_size
    rig = StoreRig(model)
    longer = tokens(v, 300, 13)  # its prefill leaves a prefix snapshot at line 256
    rig.turn(longer, session="s")
    prompt = longer[:200]  # resumed at 192: rows [192, 200) are a partial chunk
    rig.turn(prompt, session="s")
    assert rig.resident.offer(prompt).source == "prompt_end"
    other = longer[:256] + tokens(v, 40, 14)
    resume = rig.planner.begin(other, 16, "s")
    assert (resume.source, resume.start) == ("store", 256)
    assert rig.resident.prompt_end is None
    assert rig.resident.offer(prompt).source != "prompt_end"
    # What the store restored is a cold prefill's state at its line.
    assert_bit_exact(rig.engine, cold(model, longer[:256])[0], 256)
    rig.planner.abort()
    rig.planner.check_invariants()


def test_a_stopped_streams_copy_without_a_session_key_parks_nothing(model):
    """Without session keys a prompt that parts from the rows counts as another conversation,
    and the rows above its resume are parked for the one that left. A copy that goes on from
    part of the answer is the same conversation: the rest of the answer nobody was shown is
    not parked (nor spilled)."""
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, 70)
    _, first = rig.turn(prompt)
    resume, _ = rig.turn(prompt + first[:3] + tokens(v, 20, 71))
    assert resume.source == "prompt_end"
    assert rig.resident.parked is None and rig.resident.statistics()["parks"] == 0
    # one that parts right at the prompt's end is another conversation, as before
    _, second = rig.turn(prompt + tokens(v, 30, 72))
    assert rig.resident.parked is not None and rig.resident.statistics()["parks"] == 1
