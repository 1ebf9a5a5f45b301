"""Every architecture the hybrid adapter reads, through the spill (issue 16's tests: "the third
architecture through the spill"). test_session_spill.py's ``any_model`` runs the small Qwen3.5
(dense) and the made-up third architecture; here the other two checkpoints tandem serves,
Qwen3-Next and Qwen3.5-MoE (small oracle checkpoints), in fp32 and bf16.

Gate: torch.equal for every row, the end and the anchors, and the restored engine's next-turn
logits equal to those of the engine that kept its rows."""

from __future__ import annotations

import pytest
import torch

from test_session_spill import (Conversation, assert_rows_equal, assert_sections_equal, meta_of,
                                open_spill)
from tandem.engine import Engine
from tandem.models.hybrid import HybridModel
from tier_rig import GRID, tokens


@pytest.fixture(scope="module", params=[("qwen3_next", "float32"), ("qwen3_next", "bfloat16"),
                                        ("qwen3_5_moe", "float32"),
                                        ("qwen3_5_moe", "bfloat16")],
                ids=lambda p: "-".join(p))
def checkpoint_model(request):
    arch, dtype = request.param
    path = request.getfixturevalue(f"{arch}_dir")
    model = HybridModel.load(path, dtype=getattr(torch, dtype))
    assert model.model_type.startswith(arch)
    return model


def test_a_save_and_a_restore_of_the_moe_checkpoints_are_equal_bit_for_bit(checkpoint_model,
                                                                            tmp_path):
    model = checkpoint_model
    conv = Conversation(model, tokens(model.vocab_size, 200, 51), decoded=9)
    meta = meta_of(taint=conv.engine.taint)
    with open_spill(tmp_path / "sessions") as spill:
        first = conv.save(spill, meta)
        assert first.blocks_written == -(-conv.valid // GRID)
        conv.extend(tokens(model.vocab_size, 80, 52), decoded=3)  # incremental
        second = conv.save(spill, meta)
        assert second.blocks_kept == 3 and second.blocks_written == -(-conv.valid // GRID) - 3

        fresh = Engine(model, window=640, prefix_chunk=GRID)
        got = spill.restore(meta.entry_id, fresh.cache_state(), [])
        assert got.line == conv.valid
        assert_rows_equal(conv.engine, fresh, conv.valid)
        assert_sections_equal(fresh.cache_state().sections, conv.engine.cache_state().sections)
        for line, copy in got.anchors.items():
            assert_sections_equal(copy, conv.anchors[line])

        fresh.resume_at(got.line, got.token_ids, taint=got.taint)
        nxt = int(torch.argmax(conv.logits))
        assert torch.equal(fresh.decode(nxt), conv.engine.decode(nxt))
