"""An answer's reasoning the client does not send back (spec: test_reasoning_copy), on the
served template and tokenizer: Open WebUI's copy renders <think>\\n\\n</think>\\n\\n + the answer,
which parts from the rows right after <think>; the end alignment serves the rows' tokens up to
the end anchor (the reasoning the engine wrote included) and the copy's new tail after them."""

import pytest

from tandem.models.chat import render_chat
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer
from tandem.cache.endalign import EndRecord, align


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_qwen_tokenizer(path)
    return load_tokenizer(path)


def test_a_copy_without_the_reasoning_parts_after_think_and_aligns_to_the_end(tok):
    history = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(render_chat(history))
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    generated = tok.encode("The user asks a geography question.\n</think>\n\nParis.")
    record = EndRecord.after_turn(None, prompt, generated)
    copy = tok.encode(render_chat(history + [
        {"role": "assistant", "content": "Paris."},  # reasoning stripped
        {"role": "user", "content": "And of Spain?"}]))
    # The copy holds <think>\n\n</think> where the rows hold <think>\n + reasoning: they part
    # right after <think>.
    parted = next(i for i, (a, b) in enumerate(zip(record.rows, copy)) if a != b)
    assert tok.decode(copy[:parted]).endswith("<think>")
    assert align(record, copy, tok.token_bytes, allow_reasoning=False) is None
    alignment = align(record, copy, tok.token_bytes)
    assert alignment.mode == "reasoning"
    assert alignment.served[:len(record.rows)] == record.rows
    assert tok.decode(alignment.served[len(record.rows):]).startswith("<|im_end|>\n<|im_start|>user\n"
                                                                      "And of Spain?")
    # What is served is what the template renders for a client that sends the reasoning back.
    with_reasoning = tok.decode(tok.encode(render_chat(history + [
        {"role": "assistant", "content": "Paris.",
         "reasoning_content": "The user asks a geography question."},
        {"role": "user", "content": "And of Spain?"}])))
    assert tok.decode(alignment.served) == with_reasoning
