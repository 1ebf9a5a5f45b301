"""The end alignment (tandem/cache/endalign.py) on the real Qwen tokenizer and tandem's template:
a client's copy of a conversation that parts from the rows inside the answer still resumes at the
end anchor, and a copy that changed what the engine saw does not."""

from __future__ import annotations

import codecs
import json
import time
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from tandem.cache.endalign import (
    THINK_CLOSE_ID, EndRecord, Region, align, common_prefix, token_splitter)
from tandem.models.chat import render_chat
from tandem.models.reasoning_budget import ReasoningBudget
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER = {"role": "user", "content": "What is the capital of France, and why?"}
REASONING = ("The user asks about the capital of France. That is Paris, the seat of the "
             "government since the Middle Ages.")
ANSWER = "The capital of France is Paris: it has been the seat of government for centuries."
FOLLOW = {"role": "user", "content": "And of Italy?"}

TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string"},
                                                    "limit": {"type": "integer"}},
                   "required": ["filePath"]}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer")))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text)


def gen_tokens(tok, reasoning: str, answer: str, split_word: str | None = None) -> list[int]:
    """What a model generates after ``<think>\\n``: reasoning, ``\\n</think>\\n\\n``, the answer.
    ``split_word``: a word of the answer written one character a token (boundaries the
    re-tokenised copy does not have)."""
    out = tok.encode(reasoning, allow_special=False) + enc(tok, "\n</think>\n\n")
    if split_word is None:
        return out + tok.encode(answer, allow_special=False)
    head, tail = answer.split(split_word, 1)
    out += tok.encode(head, allow_special=False)
    out += [t for ch in split_word for t in tok.encode(ch, allow_special=False)]
    return out + tok.encode(tail, allow_special=False)


def first_turn(tok, gen: list[int], messages=None, tools=None) -> tuple[list[int], EndRecord]:
    prompt = enc(tok, render_chat(messages or [SYSTEM, USER], tools=tools))
    return prompt, EndRecord.after_turn(None, prompt, gen)


def copy_of(tok, messages, tools=None) -> list[int]:
    return enc(tok, render_chat(messages, tools=tools))


def check_served(tok, al, record, prompt):
    assert al.served[:len(record.rows)] == record.rows
    assert al.served[len(record.rows):] == prompt[al.cut:]


# ---------------------------------------------------------------------------------------------


def test_a_copy_that_starts_with_every_row_aligns_exactly(tok):
    # the rows are the copy's own tokenisation of the answer
    assistant = {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    text = render_chat([SYSTEM, USER, assistant], add_generation_prompt=False)
    rows = enc(tok, text[:-len("<|im_end|>\n")])
    assert rows[:len(prompt1)] == prompt1
    record = EndRecord.after_turn(None, prompt1, rows[len(prompt1):])
    assert record.regions[0].think_close is not None
    copy = copy_of(tok, [SYSTEM, USER, assistant, FOLLOW])
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "exact"
    assert al.cut == len(rows) and al.served == copy and al.replayed_hidden == 0


def test_an_answer_whose_generated_tokens_differ_from_the_copy_aligns_by_glue(tok):
    gen = gen_tokens(tok, REASONING, ANSWER, split_word="government")
    prompt1, record = first_turn(tok, gen)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER,
                                        "reasoning_content": REASONING}, FOLLOW])
    n = len(record.rows)
    assert copy[:n] != record.rows  # a token prefix match fails
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    check_served(tok, al, record, copy)
    # what follows the answer in the copy is served after the rows
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>\n<|im_start|>user\nAnd of Italy?")
    # same text, the rows' tokens
    assert tok.decode(al.served) == tok.decode(copy)
    assert al.replayed_hidden == 0 and al.replayed_reasoning == 0


def test_an_opencode_copy_with_reasoning_content_and_compact_tool_arguments_aligns(tok):
    # the model wrote its call's arguments pretty-printed; opencode sends them back compactly
    # and the reasoning as reasoning_content
    call = '<tool_call>\n{"name": "read", "arguments": {\n  "filePath": "src/main.py",\n  "limit": 20\n}}\n</tool_call>'
    gen = (tok.encode(REASONING + "\n", allow_special=False) + enc(tok, "</think>\n\n")
           + enc(tok, call))
    system = {"role": "system", "content": "You are opencode, an agent. Working folder: /repo."}
    user = {"role": "user", "content": "Read src/main.py"}
    prompt1, record = first_turn(tok, gen, [system, user], TOOLS)
    assistant = {"role": "assistant", "content": "", "reasoning_content": REASONING,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "read", "arguments": '{"filePath":"src/main.py","limit":20}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "print('hello')"}
    copy = copy_of(tok, [system, user, assistant, tool], TOOLS)
    assert common_prefix(record.rows, copy) < len(record.rows)
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    check_served(tok, al, record, copy)
    assert tok.decode(copy[al.cut:]).startswith(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nprint('hello')")


def test_an_open_webui_copy_without_reasoning_aligns_by_the_reasoning_pass(tok):
    gen = gen_tokens(tok, REASONING, ANSWER)
    prompt1, record = first_turn(tok, gen)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER}, FOLLOW])
    assert "<think>\n\n</think>\n\n" + ANSWER in tok.decode(copy)
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "reasoning"
    check_served(tok, al, record, copy)
    reasoning_rows = record.regions[0].think_close - record.regions[0].start
    assert al.replayed_reasoning == reasoning_rows
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>\n<|im_start|>user\nAnd of Italy?")
    # the reasoning pass switched off: nothing aligns
    assert align(record, copy, tok.token_bytes, allow_reasoning=False) is None
    assert align(record, copy, tok.token_bytes, allow_glue=False) is None


def test_an_open_webui_chat_aligns_turn_after_turn_with_every_region_kept(tok):
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    gen1 = gen_tokens(tok, REASONING, ANSWER, split_word="centuries")
    record = EndRecord.after_turn(None, prompt1, gen1)
    msgs = [SYSTEM, USER, {"role": "assistant", "content": ANSWER}, FOLLOW]
    al = align(record, copy_of(tok, msgs), tok.token_bytes)
    assert al is not None and al.mode == "reasoning"
    # turn 2 resumed at the end anchor: its record extends the first
    r2, a2 = "Italy's capital is Rome.", "Rome is the capital of Italy."
    gen2 = gen_tokens(tok, r2, a2)
    record2 = EndRecord.after_turn(record, al.served, gen2)
    assert record2.rows == al.served + gen2
    assert record2.regions[0] == record.regions[0] and len(record2.regions) == 2
    msgs3 = msgs + [{"role": "assistant", "content": a2}, {"role": "user", "content": "Spain?"}]
    copy3 = copy_of(tok, msgs3)
    al3 = align(record2, copy3, tok.token_bytes)
    assert al3 is not None and al3.mode == "reasoning"
    check_served(tok, al3, record2, copy3)
    assert al3.replayed_reasoning == sum(r.think_close - r.start for r in record2.regions)
    assert tok.decode(copy3[al3.cut:]).startswith("<|im_end|>\n<|im_start|>user\nSpain?")


def test_a_copy_that_sends_one_answers_reasoning_and_strips_another_aligns(tok):
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    gen1 = gen_tokens(tok, REASONING, ANSWER)
    record = EndRecord.after_turn(None, prompt1, gen1)
    a1 = {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    al = align(record, copy_of(tok, [SYSTEM, USER, a1, FOLLOW]), tok.token_bytes)
    assert al is not None and al.mode == "exact"
    r2, a2 = "Italy's capital is Rome.", "Rome is the capital of Italy."
    record2 = EndRecord.after_turn(record, al.served, gen_tokens(tok, r2, a2))
    # the first answer's reasoning kept, the second's left out
    copy3 = copy_of(tok, [SYSTEM, USER, a1, FOLLOW, {"role": "assistant", "content": a2},
                          {"role": "user", "content": "Spain?"}])
    al3 = align(record2, copy3, tok.token_bytes)
    assert al3 is not None and al3.mode == "reasoning"
    r = record2.regions[1]
    assert al3.replayed_reasoning == r.think_close - r.start


def _cut_in_reasoning(tok):
    # max_tokens (or the client's stop) came inside the reasoning: the rows end in it, with no
    # </think>, and the answer is empty
    gen = tok.encode(REASONING, allow_special=False)
    prompt1, record = first_turn(tok, gen)
    assert record.regions[0].think_close is None
    return gen, record


def test_an_answer_cut_inside_its_reasoning_aligns_when_the_copy_leaves_the_reasoning_out(tok):
    gen, record = _cut_in_reasoning(tok)
    # Open WebUI's copy: the empty answer, no reasoning: <think>\n\n</think>\n\n<|im_end|>
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ""}, FOLLOW])
    assert common_prefix(record.rows, copy) < len(record.rows)
    assert align(record, copy, tok.token_bytes, allow_reasoning=False) is None
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    al = align(record, copy, tok.token_bytes, split=split)
    assert al is not None and al.mode == "reasoning"
    assert al.served[:len(record.rows)] == record.rows
    assert al.replayed_reasoning == len(gen)
    # the prompt the template renders for a client that sends the cut reasoning back
    sent_back = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": "",
                                             "reasoning_content": REASONING}, FOLLOW])
    assert tok.decode(al.served) == tok.decode(sent_back)
    assert tok.decode(al.served[len(record.rows):]).startswith(
        "\n</think>\n\n<|im_end|>\n<|im_start|>user\nAnd of Italy?")
    # without a splitter the copy's own whitespace before </think> is served: still the end
    plain = align(record, copy, tok.token_bytes)
    assert plain is not None and plain.mode == "reasoning"
    check_served(tok, plain, record, copy)
    assert tok.decode(copy[plain.cut:]).startswith("\n\n</think>")
    # the copy sent with the reasoning aligns as it did, the rows being its start
    glued = align(record, sent_back, tok.token_bytes, split=split)
    assert glued is not None and glued.mode in ("exact", "glue") and glued.replayed_reasoning == 0


def test_a_chat_resumed_after_a_cut_reasoning_aligns_on_the_next_turn_too(tok):
    gen, record = _cut_in_reasoning(tok)
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    msgs = [SYSTEM, USER, {"role": "assistant", "content": ""}, FOLLOW]
    al = align(record, copy_of(tok, msgs), tok.token_bytes, split=split)
    r2, a2 = "Italy's capital is Rome.", "Rome is the capital of Italy."
    record2 = EndRecord.after_turn(record, al.served, gen_tokens(tok, r2, a2))
    assert len(record2.regions) == 2 and record2.regions[0] == record.regions[0]
    copy3 = copy_of(tok, msgs + [{"role": "assistant", "content": a2},
                                 {"role": "user", "content": "Spain?"}])
    al3 = align(record2, copy3, tok.token_bytes, split=split)
    assert al3 is not None and al3.mode == "reasoning"
    check_served(tok, al3, record2, copy3)
    second = record2.regions[1]
    assert al3.replayed_reasoning == len(gen) + second.think_close - second.start
    assert tok.decode(copy3[al3.cut:]).startswith("<|im_end|>\n<|im_start|>user\nSpain?")


def test_an_answer_cut_without_thinking_is_not_taken_for_reasoning(tok):
    # the prompt closed the think block (thinking off): the cut answer is an answer, and a copy
    # that leaves it out changed what the engine saw
    prompt1 = enc(tok, render_chat([SYSTEM, USER], enable_thinking=False))
    assert tok.decode(prompt1).endswith("<think>\n\n</think>\n\n")
    gen = tok.encode(ANSWER, allow_special=False)
    record = EndRecord.after_turn(None, prompt1, gen)
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    empty = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ""}, FOLLOW])
    assert align(record, empty, tok.token_bytes, split=split) is None
    kept = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER}, FOLLOW])
    al = align(record, kept, tok.token_bytes, split=split)
    assert al is not None and al.mode in ("exact", "glue")


def test_a_copy_whose_cut_reasoning_differs_from_the_rows_does_not_align(tok):
    gen, record = _cut_in_reasoning(tok)
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    # another reasoning sent back: leaving the rows' out would serve both, one after the other
    other = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": "",
                                         "reasoning_content": "Something else entirely."},
                          FOLLOW])
    assert align(record, other, tok.token_bytes, split=split) is None
    # a reasoning that stops short of the rows' is not theirs either
    short = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": "",
                                         "reasoning_content": REASONING[:40]}, FOLLOW])
    assert align(record, short, tok.token_bytes, split=split) is None


def budget_generation(tok, reasoning: str, answer: str, budget_tokens: int):
    """A generation the reasoning budget closes: the model's reasoning tokens, cut after
    ``budget_tokens``, the forced close, then the answer."""
    budget = ReasoningBudget.for_tokenizer(tok, budget_tokens)
    think = tok.encode(reasoning, allow_special=False)
    assert len(think) > budget_tokens
    ans = iter(tok.encode(answer, allow_special=False))
    thinking = iter(think)
    out: list[int] = []
    while True:
        forced = budget(out)
        if forced is not None:
            out.append(forced)
        elif not budget.closed_by_budget:
            out.append(next(thinking))
        else:
            nxt = next(ans, None)
            if nxt is None:
                return out, budget
            out.append(nxt)


def visible_copy(tok, budget, out) -> tuple[str, str]:
    """The reasoning and content the client was shown (what it sends back)."""
    text = tok.decode(budget.visible(out))
    reasoning, content = text.split("</think>", 1)
    return reasoning.strip(), content.strip()


def test_a_hidden_close_phrase_the_copy_lacks_is_replayed(tok):
    out, budget = budget_generation(tok, REASONING, ANSWER, 12)
    assert budget.closed_by_budget
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    record = EndRecord.after_turn(None, prompt1, out, hidden_in_generated=budget.hidden_positions)
    assert record.hidden == [(len(prompt1) + 12, len(prompt1) + 12 + len(budget.close_ids))]
    reasoning, content = visible_copy(tok, budget, out)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": content,
                                        "reasoning_content": reasoning}, FOLLOW])
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    assert al.replayed_hidden == len(budget.close_ids)
    check_served(tok, al, record, copy)
    assert "The reasoning budget is spent" in tok.decode(al.served)
    assert "The reasoning budget is spent" not in tok.decode(copy)
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>\n<|im_start|>user\nAnd of Italy?")


@pytest.mark.parametrize("reasoning, cut_after", [
    # the copy writes "\n</think>" where the rows hold the phrase (its own \n) and "</think>"
    ("First, France. Its capital city is Paris and always has been since", 6),
    # the reasoning ended in whitespace before the phrase: the template's trim drops it
    ("Its capital is Paris.\n\nMore to say about it, at length", 6),
])
def test_a_copy_with_one_newline_more_than_the_rows_next_to_a_hidden_span_aligns(
        tok, reasoning, cut_after):
    out, budget = budget_generation(tok, reasoning, ANSWER, cut_after)
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    record = EndRecord.after_turn(None, prompt1, out, hidden_in_generated=budget.hidden_positions)
    r, c = visible_copy(tok, budget, out)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": c,
                                        "reasoning_content": r}, FOLLOW])
    visible_rows = prompt1 + budget.visible(out)
    # the copy is not the visible rows token for token: a replay of the span alone fails
    assert copy[:len(visible_rows)] != visible_rows
    at = common_prefix(visible_rows, copy)
    assert tok.decode(copy[at:at + 2]).startswith("\n")
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    assert al.replayed_hidden == len(budget.close_ids)
    check_served(tok, al, record, copy)
    # Open WebUI's copy of the same answer aligns with the reasoning (and the phrase) put back
    copy_w = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": c}, FOLLOW])
    al_w = align(record, copy_w, tok.token_bytes)
    assert al_w is not None and al_w.mode == "reasoning"
    check_served(tok, al_w, record, copy_w)


def test_a_copy_that_changes_one_visible_character_of_the_answer_does_not_align(tok):
    gen = gen_tokens(tok, REASONING, ANSWER, split_word="government")
    prompt1, record = first_turn(tok, gen)
    for answer in (ANSWER.replace("Paris", "Parks"), ANSWER.replace("centuries.", "centuries!")):
        copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": answer,
                                            "reasoning_content": REASONING}, FOLLOW])
        assert align(record, copy, tok.token_bytes) is None
        stripped = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": answer},
                                 FOLLOW])
        assert align(record, stripped, tok.token_bytes) is None


def test_a_copy_that_changes_the_user_text_before_the_answer_does_not_align(tok):
    gen = gen_tokens(tok, REASONING, ANSWER, split_word="government")
    prompt1, record = first_turn(tok, gen)
    user = {"role": "user", "content": "What is the capital of France, and how?"}
    for assistant in ({"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                      {"role": "assistant", "content": ANSWER}):
        copy = copy_of(tok, [SYSTEM, user, assistant, FOLLOW])
        assert align(record, copy, tok.token_bytes) is None


def test_another_conversations_copy_is_refused_without_reading_its_whole_stream(tok, monkeypatch):
    """Placement asks every slot's end whether a prompt aligns with it: a long prompt of another
    conversation is refused from its first bytes, its other tokens' bytes never read, and a
    prompt that does align still reads what it needs."""
    from tandem.cache import endalign

    gen = gen_tokens(tok, REASONING, ANSWER)
    prompt1, record = first_turn(tok, gen)
    other = enc(tok, render_chat([{"role": "system", "content": "A different assistant."},
                                  {"role": "user", "content": "word " * 3000}]))
    read = []
    real = endalign._nonws_list
    monkeypatch.setattr(endalign, "_nonws_list",
                        lambda ids, *a: read.append(len(ids)) or real(ids, *a))
    assert align(record, other, tok.token_bytes) is None
    assert len(other) > 3000 and sum(read) - len(record.rows) < 64, read
    read.clear()
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER}, FOLLOW])
    assert align(record, copy, tok.token_bytes).mode == "reasoning"


def _inside_a_token(tok):
    # the rows end " ... is Par" (an answer cut by max_tokens inside a word), the copy's
    # " Paris" is one token: no cut between the copy's tokens falls where the rows end
    prompt1 = enc(tok, render_chat([SYSTEM, USER]))
    gen = gen_tokens(tok, REASONING, "The capital of France is") + tok.encode(" Par")
    record = EndRecord.after_turn(None, prompt1, gen)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "reasoning_content": REASONING,
                                        "content": "The capital of France is Paris"}, FOLLOW])
    assert tok.encode(" Paris") == [11751]
    return record, copy


def test_a_match_that_ends_inside_a_prompt_token_does_not_align_without_a_splitter(tok):
    record, copy = _inside_a_token(tok)
    assert align(record, copy, tok.token_bytes) is None


def test_a_match_that_ends_inside_a_prompt_token_serves_the_tokens_rest_after_the_rows(tok):
    record, copy = _inside_a_token(tok)
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    al = align(record, copy, tok.token_bytes, split=split)
    assert al is not None and al.mode == "glue"
    k = len(copy) - 1 - copy[::-1].index(11751)  # the answer's " Paris" (the reasoning has one)
    rest = tok.encode_text("is")
    assert al.served == record.rows + rest + copy[k + 1:] and al.cut == k + 1
    # the text the engine reads is the copy's text
    assert tok.decode(al.served) == tok.decode(copy)


def test_a_special_token_or_a_broken_character_is_never_split(tok):
    split = token_splitter(tok.encode_text, tok.special_ids.values())
    think = tok.special_ids["</think>"]
    assert split(think, b"think>") is None
    assert split(11751, "\u00e9".encode()[1:]) is None  # the rows end inside "é"
    assert split(11751, b"is") == tok.encode_text("is")


def test_a_copy_shorter_than_the_rows_does_not_align(tok):
    gen = gen_tokens(tok, REASONING, ANSWER, split_word="government")
    prompt1, record = first_turn(tok, gen)
    assert align(record, prompt1, tok.token_bytes) is None
    assert align(record, record.rows[:-3], tok.token_bytes) is None


def test_token_bytes_that_know_no_bytes_count_as_none(tok):
    gen = gen_tokens(tok, REASONING, ANSWER, split_word="government")
    prompt1, record = first_turn(tok, gen)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER,
                                        "reasoning_content": REASONING}, FOLLOW])
    # a backend that cannot say a token's bytes: those tokens are whitespace to the alignment
    def token_bytes(t):
        return None if t == 11751 else tok.token_bytes(t)
    al = align(record, copy, token_bytes)
    assert al is not None and al.served[:len(record.rows)] == record.rows


def test_an_extended_record_carries_its_byte_streams_forward(tok):
    gen = gen_tokens(tok, REASONING, ANSWER)
    prompt1, record = first_turn(tok, gen)
    s1 = record.streams(tok.token_bytes)
    tail = enc(tok, "<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n") + gen
    start = len(record.rows) + len(tail) - len(gen)
    rec2 = record.extend(tail, Region.of_generation(start, gen), [(start + 2, start + 4)])
    s2 = rec2.streams(tok.token_bytes)
    fresh = EndRecord(rec2.rows, rec2.hidden, rec2.regions).streams(tok.token_bytes)
    assert s2.data == fresh.data and s2.offsets == fresh.offsets and s2.nonws == fresh.nonws
    assert len(s2.offsets) == len(rec2.rows) + 1
    assert s1.data == fresh.data[:len(s1.data)]
    assert rec2.regions[0] == record.regions[0]
    assert rec2.regions[1].think_close == start + gen.index(THINK_CLOSE_ID)
    assert rec2.hidden == [(start + 2, start + 4)]
    with pytest.raises(ValueError):
        EndRecord(record.rows, [(0, len(record.rows) + 1)])


def test_after_turn_keeps_the_regions_a_cold_resume_still_shares(tok):
    gen = gen_tokens(tok, REASONING, ANSWER)
    prompt1, record = first_turn(tok, gen)
    # a served prompt that parts from the rows after the first region (e.g. a grid resume)
    served = record.rows + enc(tok, "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    served2 = served[:len(record.rows) - 1] + enc(tok, "X")
    rec = EndRecord.after_turn(record, served2, gen)
    assert rec.regions == [Region.of_generation(len(served2), gen)]
    rec_ok = EndRecord.after_turn(record, served, gen)
    assert rec_ok.regions[0] == record.regions[0] and len(rec_ok.regions) == 2


def test_an_open_webui_copy_of_a_100k_token_record_aligns_well_under_a_second(tok):
    # a long chat: every answer thought; the copy leaves all reasoning out
    msgs = [SYSTEM]
    stripped = [SYSTEM]
    i = 0
    reasoning = " ".join([REASONING] * 8)
    while True:
        user = {"role": "user", "content": f"Question {i}: " + USER["content"] * 6}
        answer = f"Answer {i}. " + ANSWER * 6
        msgs += [user, {"role": "assistant", "content": answer, "reasoning_content": reasoning}]
        stripped += [user, {"role": "assistant", "content": answer}]
        i += 1
        if i % 20 == 0 and len(enc(tok, render_chat(msgs, add_generation_prompt=False))) > 100_000:
            break
    text = render_chat(msgs, add_generation_prompt=False)[:-len("<|im_end|>\n")]
    rows = enc(tok, text)
    assert len(rows) > 100_000
    # the regions: every assistant's <think>\n ... </think> ... up to its <|im_end|>
    think, close, end = tok.special_ids["<think>"], THINK_CLOSE_ID, tok.special_ids["<|im_end|>"]
    regions, j = [], 0
    while True:
        try:
            j = rows.index(think, j)
        except ValueError:
            break
        c = rows.index(close, j)
        try:
            e = rows.index(end, c)
        except ValueError:
            e = len(rows)
        regions.append(Region(j + 2, c, e))
        j = e
    record = EndRecord(rows, [], regions)
    copy = copy_of(tok, stripped + [{"role": "user", "content": "One more?"}])
    t0 = time.perf_counter()
    al = align(record, copy, tok.token_bytes)
    first = time.perf_counter() - t0
    assert al is not None and al.mode == "reasoning"
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>\n<|im_start|>user\nOne more?")
    assert al.served[:len(rows)] == rows
    t0 = time.perf_counter()
    assert align(record, copy, tok.token_bytes) == al
    again = time.perf_counter() - t0
    # exact: a copy that holds every row
    t0 = time.perf_counter()
    ex = align(record, rows + copy[al.cut:], tok.token_bytes)
    exact = time.perf_counter() - t0
    assert ex is not None and ex.mode == "exact"
    assert first < 1.0 and again < 1.0 and exact < 0.2, (first, again, exact)


def test_whitespace_the_rows_end_with_is_not_served_twice(tok):
    # a generation that ended right after its reasoning: the rows end "</think>\n\n", and the
    # copy (empty content) renders the same "\n\n" before <|im_end|>
    gen = gen_tokens(tok, REASONING, "", split_word=None)
    gen = [t for ch in "The user" for t in tok.encode(ch, allow_special=False)] + gen[2:]
    assert tok.decode(gen).startswith(REASONING) and tok.decode(gen).endswith("</think>\n\n")
    prompt1, record = first_turn(tok, gen)
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": "",
                                        "reasoning_content": REASONING}, FOLLOW])
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    check_served(tok, al, record, copy)
    assert tok.decode(al.served) == tok.decode(copy)
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>")


# -- the XML tool-call form (a Qwen3.5 checkpoint's own template) ------------------------------

QWEN35 = (Path(__file__).parents[1] / "models" / "templates" / "qwen3_5.jinja").read_text()
XML_TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string"}, "limit": {"type": "integer"},
        "force": {"type": "boolean"}}, "required": ["filePath"]}}}]
XML_USER = [{"role": "user", "content": "Read src/app.py and tell me what it does."}]


def xml_turn(tok, generated_text: str, *, arguments=None):
    """The rows of a Qwen3.5 turn that generated ``generated_text``, and the copy an opencode
    client sends back: the parsed call, its arguments a compact JSON string (``arguments``
    replaces them), then the tool's result, rendered again by the checkpoint's template."""
    from tandem.models.chat import encode_chat, parse_output

    prompt = encode_chat(tok, XML_USER, XML_TOOLS, template=QWEN35, enable_thinking=True)
    generated = tok.encode(generated_text) + [tok.special_ids["<|im_end|>"]]
    record = EndRecord.after_turn(None, prompt, generated)
    parsed = parse_output(generated_text, tools=XML_TOOLS)
    (call,) = parsed.tool_calls
    args = arguments if arguments is not None else json.loads(call["function"]["arguments"])
    message = {"role": "assistant", "content": parsed.content,
               "reasoning_content": parsed.reasoning,
               "tool_calls": [{"id": call["id"], "type": "function", "function": {
                   "name": "read", "arguments": json.dumps(args, separators=(",", ":"))}}]}
    copy = encode_chat(tok, XML_USER + [message, {"role": "tool", "content": "print(1)"}],
                       XML_TOOLS, template=QWEN35, enable_thinking=True)
    return record, copy


XML_CALL = ("<tool_call>\n<function=read>\n<parameter=filePath>\n/src/app.py\n</parameter>\n"
            "<parameter=limit>\n50\n</parameter>\n<parameter=force>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>")


def test_an_xml_call_sent_back_as_json_aligns_by_its_value(tok):
    """Qwen3.5's template writes the client's JSON true back as Python's True: the bytes part
    inside the call, the values do not."""
    record, copy = xml_turn(tok, "I should read the file first.\n</think>\n\n" + XML_CALL)
    assert "<parameter=force>\nTrue\n" in tok.decode(copy)
    assert align(record, copy, tok.token_bytes, allow_reasoning=False) is not None
    al = align(record, copy, tok.token_bytes)
    assert al.mode == "calls"
    check_served(tok, al, record, copy)
    assert tok.decode(al.served[len(record.rows):]).startswith("\n<|im_start|>user\n"
                                                               "<tool_response>\nprint(1)")


def test_an_xml_call_made_inside_the_unclosed_reasoning_aligns_past_the_think_close_it_lacks(tok):
    record, copy = xml_turn(tok, "I should read the file first.\n\n" + XML_CALL)
    (region,) = record.regions
    assert region.closed_by_call and tok.decode([record.rows[region.think_close]]) == \
        "<tool_call>"
    # the copy has a </think> before the call, which the rows never had
    assert "read the file first.\n</think>\n\n<tool_call>" in tok.decode(copy)
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "calls"
    check_served(tok, al, record, copy)
    assert THINK_CLOSE_ID not in al.served[len(record.rows) - 40:len(record.rows)]


def test_an_xml_call_whose_arguments_the_client_changed_does_not_align(tok):
    record, copy = xml_turn(tok, "Read it.\n</think>\n\n" + XML_CALL,
                            arguments={"filePath": "/src/other.py", "limit": 50, "force": True})
    assert align(record, copy, tok.token_bytes) is None
    record, copy = xml_turn(tok, "Read it.\n</think>\n\n" + XML_CALL,
                            arguments={"filePath": "/src/app.py", "limit": 50, "force": False})
    assert align(record, copy, tok.token_bytes) is None


def test_a_call_made_without_thinking_is_no_think_close(tok):
    prompt = enc(tok, render_chat([USER], tools=TOOLS, enable_thinking=False))
    gen = enc(tok, '<tool_call>\n{"name": "read", "arguments": {"filePath": "a"}}\n</tool_call>')
    (region,) = EndRecord.after_turn(None, prompt, gen).regions
    assert region.think_close is None and not region.closed_by_call


def _a_token_that_ends_mid_character(tok) -> int:
    """A byte-level token whose bytes are not UTF-8 on their own: they open a character and
    stop before its end."""
    for token_id in range(tok.vocab_size):
        b = tok.token_bytes(token_id)
        if not b or b[0] < 0xC2:
            continue
        try:
            b.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data":
                return token_id
    raise AssertionError("no such token")


def test_a_copy_whose_answer_carries_u_fffd_for_a_broken_character_aligns(tok):
    """A random model (a real one more rarely) writes a token that opens a character the next
    token does not finish: the client receives U+FFFD there and sends it back. Its copy still
    meets the rows (the model's own bytes), so the next turn resumes at the end anchor."""
    broken = _a_token_that_ends_mid_character(tok)
    head = tok.encode("The user asks about", allow_special=False)
    tail = tok.encode(" Paris and the Seine.", allow_special=False)
    reasoning_ids = head + [broken] + tail
    gen = reasoning_ids + enc(tok, "\n</think>\n\n") + tok.encode(ANSWER, allow_special=False)
    prompt1, record = first_turn(tok, gen)
    reasoning = tok.decode(reasoning_ids)
    assert "\ufffd" in reasoning  # what the client got
    copy = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER,
                                        "reasoning_content": reasoning}, FOLLOW])
    al = align(record, copy, tok.token_bytes)
    assert al is not None and al.mode == "glue"
    check_served(tok, al, record, copy)
    assert tok.decode(copy[al.cut:]).startswith("<|im_end|>\n<|im_start|>user\nAnd of Italy?")
    # A copy that changed the text next to it still does not align.
    changed = copy_of(tok, [SYSTEM, USER, {"role": "assistant", "content": ANSWER,
                                           "reasoning_content": reasoning.replace("Paris",
                                                                                  "Lyon")},
                            FOLLOW])
    assert align(record, changed, tok.token_bytes) is None


def _whole_record_streams(ids, token_bytes):
    """The byte view of rows ``ids`` computed from scratch, the oracle of the incremental one:
    each row's non-whitespace bytes when the rows' bytes are UTF-8; otherwise each row's share
    of what an incremental decoder (U+FFFD for a character never finished) emits after it, the
    final flush on the last, as the stream sent it to the client."""
    raw = [token_bytes(t) or b"" for t in ids]
    try:
        b"".join(raw).decode("utf-8")
        shown = raw
    except UnicodeDecodeError:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        shown = [decoder.decode(b).encode("utf-8") for b in raw]
        if shown:
            shown[-1] += decoder.decode(b"", final=True).encode("utf-8")
    nonws = [b.translate(None, b" \t\n\r") for b in shown]
    return nonws, [0, *accumulate(map(len, nonws))], b"".join(nonws)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_records_byte_view_grown_turn_by_turn_is_the_whole_records(tok, data):
    """EndRecord.streams grows with the record (only the new rows' bytes and the decoders'
    states are worked on, where it once decoded the whole conversation again every turn): after
    any run of extensions, over tokens that open characters they never finish, whitespace and
    plain text, its view is the one computed from the whole record at once."""
    broken = _a_token_that_ends_mid_character(tok)
    pool = sorted({broken, *tok.encode("Paris  und\tdie Seine. ä€😀 \n", allow_special=False),
                   *range(0, 300)})
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=80))
    cuts = sorted(data.draw(st.lists(st.integers(1, len(ids)), max_size=5)))
    record = EndRecord(ids[:cuts[0]] if cuts else ids)
    record.streams(tok.token_bytes)  # computed once, then carried through every extension
    at = len(record.rows)
    for cut in cuts[1:] + [len(ids)]:
        if cut > at:
            record = record.extend(ids[at:cut])
            at = cut
            s = record.streams(tok.token_bytes)
            assert (s.nonws, s.offsets, s.data) == _whole_record_streams(record.rows,
                                                                          tok.token_bytes)
    s = record.streams(tok.token_bytes)
    assert (s.nonws, s.offsets, s.data) == _whole_record_streams(ids, tok.token_bytes)
