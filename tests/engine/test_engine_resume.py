"""Gate 1 (bit-exact): a prefill resumed at a grid line from a copy taken through cache_state()
equals a cold prefill: logits, every section and every view's rows (torch.equal).
Greedy gate: decode after such a restore writes the same greedy tokens as the uninterrupted run.
"""

import pytest
import torch

from tandem.cache.copies import RowsCopy, SectionsCopy
from tandem.engine import Engine, SamplingParams, grid_chunks
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

CHUNK = 64
PROMPT = 300  # the last chunk is partial (300 = 4 * 64 + 44)


def _prompt(vocab: int, n: int = PROMPT, seed: int = 7) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _copy(engine: Engine, n: int) -> tuple[SectionsCopy, RowsCopy]:
    """What a cache keeps at line n, taken as the caches take it: every section whole, every
    view's rows 0..n (so scripts/mutation_check.py's broken restores reach these tests too)."""
    state = engine.cache_state()
    return SectionsCopy.take(state), RowsCopy.take(state, 0, n)


def _restore(engine: Engine, copy: tuple[SectionsCopy, RowsCopy], n: int,
             token_ids: list[int]) -> None:
    sections, rows = copy
    state = engine.cache_state()
    sections.restore(state)
    rows.restore(state)
    engine.resume_at(n, token_ids)


def _assert_same_state(a: Engine, b: Engine, n: int) -> None:
    sa, sb = a.cache_state(), b.cache_state()
    assert sa.sections.keys() == sb.sections.keys()
    for k in sa.sections:
        assert torch.equal(sa.sections[k], sb.sections[k]), k
    for k in sa.views:
        assert torch.equal(sa.views[k].rows(0, n), sb.views[k].rows(0, n)), k


@pytest.fixture(params=["qwen3_5", "qwen3_next", "qwen3_5_moe", "third"])
def model(request):
    if request.param == "third":
        return ThirdModel()
    return HybridModel.load(request.getfixturevalue(f"{request.param}_dir"))


def test_a_prefill_resumed_at_every_grid_line_equals_a_cold_prefill_bit_for_bit(model):
    prompt = _prompt(model.vocab_size)
    cold = Engine(model, window=512, prefix_chunk=CHUNK)
    copies = {}
    cold_logits = cold.prefill(prompt, on_chunk=lambda end: copies.setdefault(end, _copy(cold, end)))
    lines = [end for _, end in grid_chunks(0, PROMPT, CHUNK) if end % CHUNK == 0]
    assert lines == [64, 128, 192, 256]
    for line in lines:
        # A fresh engine whose buffers hold garbage past the line, as a reused one would.
        warm = Engine(model, window=512, prefix_chunk=CHUNK)
        warm.prefill(_prompt(model.vocab_size, 400, seed=99))
        _restore(warm, copies[line], line, prompt)
        logits = warm.prefill(prompt)
        assert torch.equal(logits, cold_logits), line
        _assert_same_state(warm, cold, PROMPT)


def test_decode_after_a_restore_writes_the_uninterrupted_runs_greedy_tokens(model):
    prompt = _prompt(model.vocab_size, seed=11)
    params = SamplingParams(max_tokens=24)
    straight = Engine(model, window=512, prefix_chunk=CHUNK)
    want = straight.generate(prompt, params).token_ids
    first = Engine(model, window=512, prefix_chunk=CHUNK)
    copies = {}
    first.prefill(prompt[:256], on_chunk=lambda end: copies.setdefault(end, _copy(first, end)))
    resumed = Engine(model, window=512, prefix_chunk=CHUNK)
    _restore(resumed, copies[192], 192, prompt)
    result = resumed.generate(prompt, params)
    assert result.reused_tokens == 192
    assert result.token_ids == want
    assert resumed.taint == PROMPT  # the first row decoding wrote
    # Resumed on the grid, the rest forwarded on the straight run's chunks: its bits too.
    _assert_same_state(resumed, straight, straight.length)


def test_the_same_inputs_on_the_same_grid_give_the_same_bits_twice(model):
    prompt = _prompt(model.vocab_size, seed=5)
    a = Engine(model, window=512, prefix_chunk=CHUNK)
    b = Engine(model, window=512, prefix_chunk=CHUNK)
    assert torch.equal(a.prefill(prompt), b.prefill(prompt))
    _assert_same_state(a, b, PROMPT)
    assert a.num_threads == torch.get_num_threads()


def test_a_prompt_extending_the_rows_in_place_forwards_only_the_new_tokens(model):
    prompt = _prompt(model.vocab_size, seed=3)
    engine = Engine(model, window=512, prefix_chunk=CHUNK)
    engine.prefill(prompt[:128])
    chunks = []
    engine.prefill(prompt, on_chunk=chunks.append)
    assert chunks == [192, 256, 300]
    cold = Engine(model, window=512, prefix_chunk=CHUNK)
    cold.prefill(prompt)
    _assert_same_state(engine, cold, PROMPT)
