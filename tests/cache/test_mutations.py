"""The cache tests can fail (issue 12, part 7): under each broken restore of tests/mutations.py
(the recurrent sections skipped, the conv tails skipped, the view rows skipped, the sections
scaled by 1.001) one test of each tier fails, and the mutated restore did change the state.
scripts/mutation_check.py runs every cache test under every mutation and names the survivors."""

import pytest
import torch

import mutations
import test_cache
import test_resident
import test_resident_park
import test_resident_pin
from resident_rig import tokens
from small_hybrid import make_small_hybrid
from tandem.engine import Engine
from tandem.models import hybrid as hybrid_module
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel

# One test a tier: the store (prefix and session snapshots), the guest stash with the end
# anchor, the park's in-place swap, the pinned head.
TIERS = {
    "store_prefix": test_cache.test_a_prefix_snapshot_is_taken_at_the_longest_line_that_fits_and_resumes_bit_for_bit,
    "store_session": test_cache.test_a_session_snapshot_resumes_the_next_turn_greedy_equal,
    "stash_end": test_resident.test_a_guest_between_two_turns_costs_the_conversation_nothing,
    "park_swap": test_resident_park.test_a_swap_parks_the_leaving_conversation_in_the_returning_ones_buffer,
    "pin": test_resident_pin.test_the_turn_after_a_compaction_gets_the_pinned_head_back_bit_for_bit,
}
# The store's tests run on the hybrid only, as in test_cache.py.
ON_THIRD = ("stash_end", "park_swap")


@pytest.fixture(scope="module")
def hybrid(qwen3_5_dir):
    return HybridModel.load(qwen3_5_dir)


CASES = [(m, t, "qwen3_5") for m in mutations.NAMES for t in TIERS] + \
    [(m, t, "third") for m in mutations.NAMES for t in ON_THIRD]


@pytest.mark.parametrize("mutation,tier,which", CASES)
def test_a_broken_restore_fails_the_cache_test_of_each_tier(mutation, tier, which, hybrid,
                                                            monkeypatch):
    model = hybrid if which == "qwen3_5" else ThirdModel()
    TIERS[tier](model)  # passes with the true restores
    mutations.apply(mutation, monkeypatch)
    with pytest.raises(AssertionError):
        TIERS[tier](model)
    assert mutations.hits.count > 0, "the mutated restore changed nothing"


@pytest.mark.parametrize("which", ["qwen3_5_dir", "qwen3_next_dir", "small"])
def test_the_test_models_remember_their_recurrent_state(which, request, monkeypatch, tmp_path,
                                                        torch_matmuls):
    """A median per-token decay near 1: with the 0.06 of transformers' random init the state was
    forgotten within three tokens and a restore that lost it still passed the greedy gate. The
    reference ops run (torch_matmuls), so that the decays are seen where they are computed."""
    path = (make_small_hybrid(tmp_path / "small", tokenizer=False) if which == "small"
            else request.getfixturevalue(which))
    model = HybridModel.load(path)
    decays = []
    chunk = hybrid_module.kernels.chunk_gated_delta_rule

    def watching(q, k, v, g, beta, s):
        decays.append(g.exp().flatten())
        return chunk(q, k, v, g, beta, s)

    monkeypatch.setattr(hybrid_module.kernels, "chunk_gated_delta_rule", watching)
    Engine(model, window=512, prefix_chunk=64).prefill(tokens(model.vocab_size, 256, 1))
    assert torch.cat(decays).median() > 0.95
