"""The end anchor: the next turn resumes where the generation stopped (greedy gate); taint marks
the first row decoding wrote, and a resume at a grid anchor at or below it is a cold grid
prefill's again, bit for bit."""

import pytest
import torch

from resident_rig import (Rig, assert_bit_exact, assert_uninterrupted, cold, tokens,
                          uninterrupted)
from tandem.cache.resident import ResidentPrefix
from tandem.engine import Engine, SamplingParams
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(params=["qwen3_5", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue("qwen3_5_dir"))


def test_the_next_turn_resumes_at_the_end_and_forwards_only_what_is_new(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1)
    turn2 = turn1 + out1 + tokens(v, 50, 2)
    resume, out2 = rig.turn(turn2)
    assert (resume.source, resume.start) == ("end", len(turn1) + len(out1) - 1)
    assert rig.resident.stats.end_hits == 1
    # The end is the state in place here (no copy restored): the uninterrupted run's bits.
    assert_uninterrupted(rig.engine, model, [turn1, turn2], [out1, out2])


def test_taint_is_the_first_row_decoding_wrote(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 300, 1)
    rig.turn(turn1)
    assert rig.engine.taint == 300
    assert rig.resident.statistics()["taint"] == 300


def test_a_prompt_parting_inside_the_answer_resumes_at_the_prompts_end(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1)
    # The client's copy of the answer differs from the rows after 3 tokens.
    turn2 = turn1 + out1[:3] + tokens(v, 60, 3)
    resume, out2 = rig.turn(turn2)
    assert (resume.source, resume.start) == ("prompt_end", 300)
    assert rig.engine.taint == 300  # forwarded off the grid from the prompt's end
    assert out2 == uninterrupted(model, [turn2])[0]  # greedy gate


def test_without_the_prompt_end_anchor_it_resumes_at_its_last_grid_anchor_bit_for_bit(model):
    v = model.vocab_size
    rig = Rig(model)
    rig.resident = ResidentPrefix(rig.engine, rig.memory, prompt_end_anchor=False)
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1)
    turn2 = turn1 + out1[:3] + tokens(v, 60, 3)
    resume, logits = rig.prefill(turn2)
    assert (resume.source, resume.start) == ("resident", 256)
    assert rig.engine.taint is None  # resumed at or below taint: a cold grid prefill's again
    engine, want = cold(model, turn2)
    assert torch.equal(logits, want)
    assert_bit_exact(rig.engine, engine, len(turn2))


def test_a_turn_after_the_end_keeps_anchors_above_taint_under_the_greedy_gate(model):
    v = model.vocab_size
    rig = Rig(model)
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1)
    turn2 = turn1 + out1 + tokens(v, 200, 4)
    rig.turn(turn2)
    lines = sorted(rig.resident.anchors)
    assert lines[-1] > rig.engine.taint  # anchors above taint exist...
    turn3 = turn2[:lines[-1] + 5] + tokens(v, 20, 5)
    resume, out3 = rig.turn(turn3)
    assert resume.start == lines[-1]
    assert rig.engine.taint == 300  # ...and a resume there keeps the taint below it
    # Greedy gate: the same tokens as a plain engine that forwarded the same rows on the same
    # chunks (turn 1 and its answer, turn 2 up to the anchor) and then turn 3.
    plain = Engine(model, window=2048, prefix_chunk=64)
    plain.generate(turn1, SamplingParams(max_tokens=16))
    plain.prefill(turn2[:lines[-1]])
    assert plain.generate(turn3, SamplingParams(max_tokens=16)).token_ids == out3
    # ...and its bits: the anchor's sections were the plain engine's at that line.
    assert rig.engine.token_ids == plain.token_ids
    assert_bit_exact(rig.engine, plain, plain.length)


def test_end_anchor_off_keeps_no_end(model):
    v = model.vocab_size
    rig = Rig(model)
    rig.resident.end_anchor = False
    turn1 = tokens(v, 300, 1)
    _, out1 = rig.turn(turn1)
    assert rig.resident.end is None
    # The live state still extends: the engine holds it until another request moves it.
    resume, _ = rig.turn(turn1 + out1 + [1, 2, 3])
    assert resume.source == "resident"
