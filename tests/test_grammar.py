"""Grammar-constrained decoding on the engine (tandem.grammar.TokenGrammar): the mask holds greedy
and sampled output to the grammar, the greedy shortcut (the raw argmax when the grammar allows
it) is the masked argmax, and speculation's verify blocks carry only drafts the grammar allows
and accept exactly the tokens plain decoding gives (greedy and seeded: identical tokens)."""

from __future__ import annotations

import json

import pytest

from small_hybrid import make_small_hybrid
from tandem.engine import Engine, SamplingParams
from tandem.grammar import TokenGrammar, from_lark, ll_tokenizer
from tandem.models.chat import encode_chat
from tandem.models.hybrid import HybridModel
from tandem.models.structured import build_lark
from tandem.models.tokenizer import load_tokenizer, write_qwen_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["city", "days", "sunny"],
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "sunny": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_qwen_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(scope="module")
def compiled(tok) -> str:
    return from_lark(build_lark(thinking=False, special_ids=tok.special_ids, response_format={
        "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}))


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return encode_chat(tok, [{"role": "user", "content": "Plan a trip, as JSON."}],
                       enable_thinking=False)


def params(tok, temperature=0.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=temperature, seed=11,
                          stop_token_ids=tuple(tok.eos_ids), **kw)


def generate(hybrid, prompt, p, **options):
    return Engine(hybrid, window=1024, prefix_chunk=64).generate(prompt, p, **options)


def valid_trip(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"city", "days", "sunny"}
            and value["city"] in ("Paris", "Rome", "Oslo")
            and type(value["days"]) is int and 1 <= value["days"] <= 14
            and type(value["sunny"]) is bool)


class FullMasks(TokenGrammar):
    """Takes neither greedy shortcut (the raw argmax when allowed, the argmax over a few allowed
    ids): every position's token is the argmax of a masked copy of all the logits."""

    def allows(self, token: int) -> bool:
        return False

    def _few_allowed(self, words, size):
        return None


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_mask_holds_the_output_to_the_schema_and_stops_it_when_complete(
        hybrid, tok, compiled, prompt, temperature):
    p = params(tok, temperature)
    free = generate(hybrid, prompt, p)
    assert not valid_trip(tok.decode(free.token_ids))  # the random model writes no JSON alone
    result = generate(hybrid, prompt, p, grammar=TokenGrammar(tok, compiled))
    assert valid_trip(tok.decode(result.token_ids)), tok.decode(result.token_ids)
    assert result.finish_reason == "stop" and result.stop_token is None


@pytest.mark.parametrize("thinking", [False, True])
def test_the_greedy_shortcut_gives_the_masked_argmax(hybrid, tok, prompt, thinking):
    # Thinking: the reasoning is free, so the raw argmax mostly passes and no mask is computed.
    compiled = from_lark(build_lark(thinking=thinking, special_ids=tok.special_ids,
                                    response_format={"type": "json_object"}))
    shortcut = TokenGrammar(tok, compiled)
    fast = generate(hybrid, prompt, params(tok), grammar=shortcut)
    full = FullMasks(tok, compiled)
    slow = generate(hybrid, prompt, params(tok), grammar=full)
    assert fast.token_ids == slow.token_ids
    assert full.masks == len(slow.token_ids)
    if thinking:
        assert shortcut.masks < len(fast.token_ids) // 2


def recording(engine: Engine, blocks: list[list[int]]) -> Engine:
    verify = engine.verify

    def spy(token_ids, **kw):
        blocks.append([len(engine.token_ids)] + list(token_ids))
        return verify(token_ids, **kw)
    engine.verify = spy
    return engine


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_accepts_the_plain_tokens_and_verifies_no_refused_draft(
        hybrid, tok, compiled, prompt, temperature):
    p = params(tok, temperature)
    plain = generate(hybrid, prompt, p, grammar=TokenGrammar(tok, compiled)).token_ids
    junk = tok.encode("[[[[ ]]]] nope")

    def draft(context, k):
        # Right continuations and, every other call, tokens the grammar refuses.
        done = len(context) - len(prompt)
        right = plain[done:done + k]
        return right[:1] + junk[:k - 1] if done % 2 else right
    blocks: list[list[int]] = []
    engine = recording(Engine(hybrid, window=1024, prefix_chunk=64), blocks)
    grammar = TokenGrammar(tok, compiled)
    result = engine.generate(prompt, p, draft=draft, draft_max=8, grammar=grammar)
    assert result.token_ids == plain
    assert result.drafted > 0 and result.accepted > 0 and blocks
    # Every verified draft is one the grammar allows after the tokens before it.
    import llguidance as llg
    for block in blocks:
        start, drafts = block[0] - len(prompt), block[2:]
        matcher = llg.LLMatcher(ll_tokenizer(tok), compiled, log_level=0)
        assert matcher.consume_tokens(plain[:start + 1])
        assert matcher.validate_tokens(drafts) == len(drafts)


def test_a_forced_token_the_grammar_refuses_ends_the_generation(hybrid, tok, compiled, prompt):
    refused = tok.encode("[")[0]
    grammar = TokenGrammar(tok, compiled)
    result = generate(hybrid, prompt, params(tok), grammar=grammar,
                      force=lambda out: refused if len(out) == 1 else None)
    assert grammar.broken and result.finish_reason == "stop" and len(result.token_ids) == 2


def test_the_mask_agrees_with_the_matcher_and_refuses_the_padding_rows(tok, compiled):
    import torch

    grammar = TokenGrammar(tok, compiled)
    refused = grammar.refused(tok.vocab_size + 243, torch.device("cpu"))
    assert refused[tok.vocab_size:].all()  # a model's padding logits are never a token
    allowed = (~refused).nonzero().flatten().tolist()
    assert allowed and all(grammar.allows(t) for t in allowed)
    assert not any(grammar.allows(t) for t in range(0, tok.vocab_size, 997) if refused[t])
    assert tok.encode("[")[0] not in allowed
