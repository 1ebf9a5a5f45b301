"""The compact BPE (tandem/models/bpe.py, csrc/bpe.c) against tiktoken over the same Qwen
vocabulary: the same ids for every text, to the id. Gate: list equality of ids and of bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import native
from tandem.models import bpe
from tandem.models import tokenizer as T
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

pytestmark = pytest.mark.skipif(not native.available(), reason="no native library to build")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    d = write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))
    config = json.loads((d / T.CONFIG_FILE).read_text())
    ranks, _ = T._read_ranks(d / T.TIKTOKEN_FILE)  # bpe.Ranks
    specials = T._added_tokens(d / T.CONFIG_FILE, config)
    return d, ranks, specials, config["pat_str"]


@pytest.fixture(scope="module")
def pair(vocab):
    _, ranks, specials, pat = vocab
    ours = bpe.CompactBpe.build(ranks, specials, pat)
    assert ours is not None, "Qwen's pat_str and the native library: the compact BPE is built"
    return ours, bpe.TiktokenBpe(ranks, specials, pat)


def test_the_qwen_tokenizer_loads_the_compact_one_in_a_tenth_of_tiktokens_memory(vocab, pair):
    d = vocab[0]
    assert isinstance(load_tokenizer(d)._backend._bpe, bpe.CompactBpe)
    ours, _ = pair
    assert ours.nbytes < 8 << 20  # tiktoken's Rust tables: about 60 MiB


def _assigned(ours) -> list[int]:
    stage1, stage2 = bpe.classes()
    return [cp for cp in range(0x110000) if not 0xD800 <= cp < 0xE000
            and not stage2[int(stage1[cp >> 8]) * 256 + (cp & 255)] & bpe.C_UNSURE]


# contexts that tell the classes apart: between letters (L, M join them), after a space and
# before a letter (the optional prefix), between digits, doubled, after an apostrophe, before
# a space, between newlines, before a combining mark
CONTEXTS = ["a{0}a", " {0}x", "1{0}1", "{0}{0}", "'{0}", "x {0} ", "\n{0}\n", "{0}\u0301"]


def test_every_codepoint_but_the_unassigned_in_every_context_gets_tiktokens_ids(pair):
    ours, ref = pair
    cps = _assigned(ours)
    assert len(cps) > 200_000
    for ctx in CONTEXTS:
        for i in range(0, len(cps), 2000):
            text = "|".join(ctx.format(chr(cp)) for cp in cps[i:i + 2000])
            got, want = ours.encode_ordinary(text), ref.encode_ordinary(text)
            if got != want:  # name the first codepoint that differs
                for cp in cps[i:i + 2000]:
                    one = ctx.format(chr(cp))
                    assert ours.encode_ordinary(one) == ref.encode_ordinary(one), hex(cp)
            assert got == want


ALPHABET = st.sampled_from(
    list("abcXYZ sStTrRvVeElLmMdD'’0123456789\t\n\r\x0b\x0c\x1c\x85\xa0.,;:!?()[]{}<>|-_*#@$%&/\\\"")
    + ["\u0301", "\u0308", "\u017f", "\u00e9", "\u00df", "\u0130", "\u1680", "\u2000", "\u2028",
       "\u3000", "\u202f", "\u65e5", "\u672c", "\u0663", "\u2167", "\u00bd", "\U0001f389",
       "\u200d", "\ufe0f", "\uff21", "\ud55c", "\u0915", "\u094d", "\U00020000", "\ue000",
       "\ufffd", "\ufdd0", "\uffff"])
TEXTS = st.lists(st.one_of(ALPHABET, st.characters(codec="utf-8")), max_size=80).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=TEXTS)
def test_any_text_gets_tiktokens_ids(pair, text):
    ours, ref = pair
    assert ours.encode_ordinary(text) == ref.encode_ordinary(text)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.one_of(TEXTS, st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>",
                                                          "</think>", "<|endoftext|>", "<|im_",
                                                          "<tool_call>"])), max_size=8))
def test_special_tokens_split_the_text_as_tiktokens_do(pair, vocab, parts):
    ours, ref = pair
    text = "".join(parts)
    for allowed in (frozenset(vocab[2]), frozenset({"<think>", "</think>", "<tool_call>"})):
        assert ours.encode(text, allowed) == ref.encode(text, allowed)


def test_source_files_and_long_runs_get_tiktokens_ids(pair):
    ours, ref = pair
    texts = [p.read_text() for p in [REPO / "README.md", REPO / "tandem" / "engine.py"]]
    texts += [" " * 5000 + "x", "\n" * 3000, "a" * 4000, "'" * 999 + "s", "1" * 700,
              "\U0001f389" * 300, "\u0301" * 500 + "a"]
    for text in texts:
        assert ours.encode_ordinary(text) == ref.encode_ordinary(text)


def test_a_lone_surrogate_is_read_as_tiktoken_reads_it(pair):
    ours, ref = pair
    for text in ["a\ud800b", "\udfff", "x \udc80\n"]:
        assert ours.encode_ordinary(text) == ref.encode_ordinary(text)


def test_a_codepoint_this_python_does_not_assign_goes_to_tiktoken_built_on_first_need(vocab):
    _, ranks, specials, pat = vocab
    ours = bpe.CompactBpe.build(ranks, specials, pat)
    stage1, stage2 = bpe.classes()
    unsure = next(cp for cp in range(0x1F000, 0x20000)
                  if stage2[int(stage1[cp >> 8]) * 256 + (cp & 255)] & bpe.C_UNSURE)
    ours.encode_ordinary("plain text, every codepoint known")
    assert ours._fallback is None
    text = f"a {chr(unsure)} b"
    ref = bpe.TiktokenBpe(ranks, specials, pat)
    assert ours.encode_ordinary(text) == ref.encode_ordinary(text)
    assert ours._fallback is not None


def test_every_ids_bytes_and_the_decode_of_many_are_tiktokens(pair):
    ours, ref = pair
    assert ours.n_vocab == ref.n_vocab
    for i in range(-2, ours.n_vocab + 3):
        assert ours.token_bytes(i) == ref.token_bytes(i), i
    ids = random.Random(3).sample(range(ours.n_vocab), 5000)
    present = [i for i in ids if ref.token_bytes(i) is not None]
    assert ours.decode_bytes(present) == ref.decode_bytes(present)
    assert ours.decode_bytes([]) == b""
    for bad in ([ours.n_vocab], [-1], [10 ** 30], [1, 2, 248_300]):
        if ref.token_bytes(bad[-1]) is None:
            assert ours.decode_bytes(bad) is None


def test_another_pre_tokenizer_keeps_tiktoken(vocab):
    _, ranks, specials, pat = vocab
    assert bpe.CompactBpe.build(ranks, specials, pat.replace(r"\p{N}", r"\p{N}{1,3}")) is None


def test_ranks_the_compact_table_cannot_hold_keep_tiktoken():
    """Two ranks with the same bytes (a dict keeps the later) or one rank given twice: the
    compact table would answer otherwise than tiktoken, so it is not built."""
    same_bytes = bpe.Ranks(b"abab", np.array([0, 2, 4]), np.array([0, 1]))
    assert bpe.CompactBpe.build(same_bytes, {}, bpe.QWEN_PAT) is None
    same_id = bpe.Ranks(b"ab", np.array([0, 1, 2]), np.array([0, 0]))
    assert bpe.CompactBpe.build(same_id, {}, bpe.QWEN_PAT) is None
    fine = bpe.Ranks(b"ab", np.array([0, 1, 2]), np.array([0, 1]))
    assert bpe.CompactBpe.build(fine, {}, bpe.QWEN_PAT) is not None
