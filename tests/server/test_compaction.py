"""A compaction request's parts and the guard (tandem/server/compaction.py), without a server: the
shape that marks a request as a compaction (and the shapes that do not), where its history and
instructions are, the guard over a record's text, and the turn after an answer as the template
writes it."""

import gzip
import json
from pathlib import Path

import pytest

from tandem.models.chat import encode_chat
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer
from tandem.server.compaction import (build_continuation, compaction_request, guard, join_turn,
                                      turn_after_answer)

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a helpful AI assistant tasked with summarizing conversations. Write what was "
          "done and what is left.")
HISTORY = ("[User]: Fix the ledger export.\n\n[Assistant]: I read src/export.py.\n\n"
           "[Tool result]: def export(rows): ...\n\n[User]: Now add   a test\nfor it.\n\n"
           "[Assistant]: Added tests/test_export.py.")
INSTRUCTIONS = "Provide a detailed summary for continuing the conversation above."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_qwen_tokenizer(tmp_path_factory.mktemp("qwen")))


def _opencode(history: str = HISTORY, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Here is the conversation so far:\n<conversation>\n"
             f"{history}\n</conversation>\n\n{INSTRUCTIONS}"}]


def test_opencodes_compaction_is_its_system_text_its_history_block_and_the_instructions():
    ask = compaction_request(_opencode(), None)
    assert ask is not None and ask.system == SYSTEM
    assert ask.history.strip() == HISTORY
    assert ask.instructions == INSTRUCTIONS
    # The first line of each user message, whitespace normalised.
    assert ask.user_lines == ("Fix the ledger export.", "Now add a test")
    assert ask.turn_text() == f"{SYSTEM}\n\n{INSTRUCTIONS}"
    assert not ask.images


def test_role_lines_without_a_block_take_a_last_paragraph_that_is_no_role_as_instructions():
    history = "user: Fix the export.\n\nassistant: Fixed.\n\nUSER: And the tests?"
    text = f"Summarise this conversation:\n\n{history}\n\nKeep it under 200 words."
    ask = compaction_request([{"role": "system", "content": "Summarise the session."},
                              {"role": "user", "content": text}], [])
    assert ask.instructions == "Keep it under 200 words."
    assert ask.user_lines == ("Fix the export.", "And the tests?")
    # The last paragraph a role's: the text before the history is the instructions.
    ask = compaction_request([{"role": "system", "content": "Summarise the session."},
                              {"role": "user", "content": "Summarise this conversation:\n\n"
                               + history}], None)
    assert ask.instructions == "Summarise this conversation:"
    assert ask.user_lines[-1] == "And the tests?"


def test_a_user_marker_on_a_line_of_its_own_takes_the_next_line():
    ask = compaction_request(_opencode("[User]:\nFix the export.\n\n[Assistant]: Done."), None)
    assert ask.user_lines == ("Fix the export.",)


def test_the_session_librarys_opencode_compaction_is_recognised():
    rows = [json.loads(line) for line in
            gzip.open(ROOT / "sessions" / "opencode_long.jsonl.gz", "rt")]
    found = [compaction_request(r["body"]["messages"], r["body"].get("tools"))
             for r in rows if "body" in r]
    asks = [a for a in found if a is not None]
    assert len(asks) == 1, "one compaction request in the library's long session"
    assert asks[0].user_lines[0].startswith("The ledger export drops the last row")


@pytest.mark.parametrize("messages,tools", [
    (_opencode(), [{"type": "function", "function": {"name": "read"}}]),  # a turn with tools
    # opencode's title request: a system text and one user message, no history
    ([{"role": "system", "content": "You are a title generator."},
      {"role": "user", "content": "Generate a title for this conversation:\nFix the export"}],
     None),
    # Open WebUI's side requests: no system text
    ([{"role": "user", "content": "### Task:\nSummarize the chat.\n<chat_history>\nUSER: Hi\n"
       "ASSISTANT: Hello\n</chat_history>"}], None),
    (_opencode(system="You are a careful coding agent."), None),  # asks for no summary
    (_opencode()[:1] + [{"role": "assistant", "content": "ok"}] + _opencode()[1:], None),
    (_opencode() + [{"role": "user", "content": "And?"}], None),
    (_opencode("[Assistant]: only answers\n\n[Tool result]: x"), None),  # no user line
    ([{"role": "system", "content": SYSTEM},
      {"role": "user", "content": "Summarise what we did: the export fix."}], None),
], ids=["tools", "title", "open_webui_side", "no_summary_word", "an_answer", "two_users",
        "no_user_line", "no_history"])
def test_requests_of_other_shapes_are_no_compaction(messages, tools):
    assert compaction_request(messages, tools) is None


def test_a_user_message_with_an_image_is_marked():
    messages = _opencode()
    messages[1] = {"role": "user", "content": [
        {"type": "text", "text": messages[1]["content"]},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    assert compaction_request(messages, None).images


def test_the_guard_wants_the_first_and_the_last_user_lines_in_the_record():
    ask = compaction_request(_opencode(), None)
    record = ("<|im_start|>user\nFix the   ledger\nexport.<|im_end|>\n...<|im_start|>user\n"
              "Now add a test for it.<|im_end|>")
    assert guard(ask, record)
    assert not guard(ask, record.replace("Fix the", "Mend the"))
    assert not guard(ask, record.replace("Now add", "Then add"))


def test_the_turn_after_an_answer_is_the_templates_own(tok):
    turn, closing = turn_after_answer("Summarise.", tok, None)
    assert tok.decode(turn) == ("<|im_end|>\n<|im_start|>user\nSummarise.<|im_end|>\n"
                                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closing == 2  # <|im_end|> and its newline close the answer
    # Another template's markers: nothing of Qwen's is written by the server.
    template = ("{%- for m in messages %}[{{ m.role }}]{{ m.content }}[/{{ m.role }}]\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% if enable_thinking is "
                "defined and enable_thinking is false %}(no thinking){% endif %}{% endif %}")
    turn, closing = turn_after_answer("Summarise.", tok, template)
    assert tok.decode(turn) == "[/assistant]\n[user]Summarise.[/user]\n[assistant](no thinking)"
    assert tok.decode(turn[:closing]) == "[/assistant]\n"


def test_the_continuation_is_the_record_then_the_turn_as_a_cold_render_would_tokenise_it(tok):
    conversation = [{"role": "user", "content": "Fix the ledger export."},
                    {"role": "assistant", "content": "Done.", "reasoning_content": "Read it."}]
    full = encode_chat(tok, conversation, add_generation_prompt=False)
    record = full[:-2]  # the rows end before the answer's <|im_end|>\n (never forwarded)
    ask = compaction_request(_opencode("[User]: Fix the ledger export.\n\n[Assistant]: Done."),
                             None)
    cont = build_continuation(ask, record, "slot", tok, None)
    # The same ids as the template renders the conversation and the new turn, thinking off.
    assert cont.prompt_ids == encode_chat(
        tok, conversation + [{"role": "user", "content": ask.turn_text()}],
        enable_thinking=False)
    assert cont.record_tokens == len(record)
    assert cont.marks.last_user_start is not None and cont.marks.last_user_start > len(record)
    assert not cont.marks.first_of_session


def test_a_record_that_already_ends_with_the_answers_close_is_not_closed_twice():
    turn = [7, 8, 20, 21, 22]  # 7, 8 close the answer
    assert join_turn([1, 2, 3], turn, 2) == [1, 2, 3, 7, 8, 20, 21, 22]
    assert join_turn([1, 2, 7], turn, 2) == [1, 2, 7, 8, 20, 21, 22]
    assert join_turn([1, 7, 8], turn, 2) == [1, 7, 8, 20, 21, 22]
    # Only the close overlaps: a record ending like the turn's later tokens is left alone.
    assert join_turn([1, 20], turn, 2) == [1, 20, 7, 8, 20, 21, 22]
