"""The prompt-end anchor: the state a prompt's prefill left, copied before the first decode, with
the last position's logits. The same prompt again (a regenerate, a retry) forwards nothing.

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


def test_neither_a_prefix_nor_an_extension_of_the_prompt_takes_it(model):
    rig = Rig(model)
    v = model.vocab_size
    prompt = tokens(v, 200, 4)
    rig.turn(prompt, session="s")
    assert rig.resident.offer(prompt[:-1]).source != "prompt_end"
    assert rig.resident.offer(prompt + [7]).source != "prompt_end"
    assert rig.resident.offer(prompt).source == "prompt_end"


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
