"""The reasoning budget (tandem/models/reasoning_budget.py): the hidden close it forces, and when
it does not force."""

from __future__ import annotations

import pytest

from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer
from tandem.models.reasoning_budget import (
    CLOSE_PHRASE, NEWLINES_IDS, THINK_CLOSE_ID, ReasoningBudget, default_close_ids)

THINK = 9764  # "Let": any reasoning token
ANSWER = 760  # "The"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer")))


def run(budget, sampled, limit=200):
    """Engine.generate's loop: force(out) first, else the next sampled token."""
    sampled = iter(sampled)
    out: list[int] = []
    while len(out) < limit:
        forced = budget(out)
        token = forced if forced is not None else next(sampled, None)
        if token is None:
            break
        out.append(token)
    return out


def test_the_constants_are_the_tokenizers_own(tok):
    assert tok.special_ids["</think>"] == THINK_CLOSE_ID
    assert tok.encode("\n\n") == list(NEWLINES_IDS)
    ids = default_close_ids(tok)
    assert tok.decode(ids) == CLOSE_PHRASE
    b = ReasoningBudget.for_tokenizer(tok, 10)
    assert b.close_ids == ids and b.think_close_id == THINK_CLOSE_ID
    assert b.after_close_ids == list(NEWLINES_IDS)


def test_a_generation_that_thinks_past_the_budget_is_closed_right_after_it(tok):
    budget = ReasoningBudget.for_tokenizer(tok, 5)
    phrase = budget.close_ids
    out = run(budget, [THINK] * 50)
    assert out[:5] == [THINK] * 5
    assert out[5:5 + len(phrase)] == phrase
    k = 5 + len(phrase)
    assert out[k] == THINK_CLOSE_ID and out[k + 1:k + 2] == list(NEWLINES_IDS)
    # then sampling resumes for good
    assert out[k + 2:] == [THINK] * (len(out) - k - 2) and len(out) > k + 2
    assert budget.closed_by_budget
    assert budget.hidden_positions == list(range(5, 5 + len(phrase)))
    assert budget.forced_positions == list(range(5, k + 2))
    assert out.count(THINK_CLOSE_ID) == 1
    assert budget(out) is None


def test_the_hidden_positions_are_the_phrase_alone_and_visible_drops_them(tok):
    budget = ReasoningBudget.for_tokenizer(tok, 4)
    out = run(budget, tok.encode("Let me think about this at length") + [ANSWER] * 3)
    vis = budget.visible(out)
    assert len(vis) == len(out) - len(budget.close_ids)
    text = tok.decode(vis)
    assert "budget" not in text
    assert text == "Let me think about</think>\n\n" + tok.decode(out[-(len(out) - len(budget.close_ids) - 4 - 2):])
    assert tok.decode(out).startswith("Let me think about" + CLOSE_PHRASE + "</think>\n\n")


def test_a_generation_that_closes_its_reasoning_itself_is_never_forced(tok):
    budget = ReasoningBudget.for_tokenizer(tok, 5)
    sampled = [THINK, THINK, THINK, THINK_CLOSE_ID] + list(NEWLINES_IDS) + [ANSWER] * 40
    assert run(budget, sampled) == sampled
    assert not budget.closed_by_budget and budget.hidden_positions == []
    assert budget.visible(sampled) == sampled
    # closing exactly as the budget's last token: still the model's own close
    budget = ReasoningBudget.for_tokenizer(tok, 5)
    sampled = [THINK] * 4 + [THINK_CLOSE_ID] + [ANSWER] * 40
    assert run(budget, sampled) == sampled and not budget.closed_by_budget


def test_a_budget_of_zero_is_off(tok):
    budget = ReasoningBudget.for_tokenizer(tok, 0)
    assert not budget.enabled
    sampled = [THINK] * 100
    assert run(budget, sampled) == sampled
    assert not budget.closed_by_budget and budget.hidden_positions == []
    with pytest.raises(ValueError):
        ReasoningBudget(-1, [1], THINK_CLOSE_ID)


def test_a_budget_built_from_raw_ids_forces_them(tok):
    budget = ReasoningBudget(3, [11, 12], think_close_id=99, after_close_ids=[7])
    out = run(budget, [1] * 10)
    assert out == [1, 1, 1, 11, 12, 99, 7] + [1] * 7
    assert budget.hidden_positions == [3, 4]
    assert budget.visible(out) == [1, 1, 1, 99, 7] + [1] * 7


def test_a_tool_call_written_inside_the_reasoning_ends_it_and_the_budget_never_forces(tok):
    """Qwen3.5 calls from inside an unclosed think block: a phrase forced past the budget would
    land inside the call's arguments."""
    call_open = tok.special_ids["<tool_call>"]
    budget = ReasoningBudget.for_tokenizer(tok, 5)
    sampled = [THINK] * 3 + [call_open] + [ANSWER] * 20
    assert run(budget, sampled) == sampled
    assert not budget.closed_by_budget and budget.hidden_positions == []
