"""Decode's fast paths (the transposed head copy, the conv step) change decode's last bits only:
prefill reads what it read before, bit for bit, and decode's logits stay within 1e-5 of the
largest logit of the old path's, with the same greedy tokens."""

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.engine import Engine
from tandem.models import load_model


def _tiny(tmp_path):
    return load_model("tiny", tmp_path / "models").model


def test_a_small_model_holds_a_transposed_head_for_decode_and_prefill_never_reads_it(tmp_path):
    model = _tiny(tmp_path)
    head = model.w["lm_head.weight"]
    assert model.head_t is not None and model.head_t.is_contiguous()
    assert torch.equal(model.head_t, head.t())
    prompt = torch.randint(0, 248_000, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(model, window=256, prefix_chunk=64)
    with_copy = engine.prefill(prompt)
    model.head_t = None
    engine.reset()
    without = engine.prefill(prompt)
    # with head_t None the model runs the code from before the copy existed
    assert torch.equal(with_copy, without)


def test_decode_with_the_fast_paths_stays_within_1e_5_of_the_old_path_and_greedy_agrees(tmp_path):
    model = _tiny(tmp_path)
    new_head = model.head_t
    new_conv = kernels.implementation("causal_conv1d_step")
    prompt = torch.randint(0, 248_000, (40,), generator=torch.Generator().manual_seed(5)).tolist()

    def run() -> tuple[list[int], torch.Tensor]:
        engine = Engine(model, window=256, prefix_chunk=64)
        logits = engine.prefill(prompt)
        tokens, rows = [], []
        for _ in range(12):
            tokens.append(int(torch.argmax(logits)))
            logits = engine.decode(tokens[-1])
            rows.append(logits)
        return tokens, torch.stack(rows)

    fast_tokens, fast = run()
    model.head_t = None
    previous = kernels.register("causal_conv1d_step", kernels.implementation("causal_conv1d"))
    try:
        old_tokens, old = run()
    finally:
        kernels.register("causal_conv1d_step", previous)
        model.head_t = new_head
    assert previous is new_conv
    assert fast_tokens == old_tokens
    # 7e-6 of the largest logit here over 12 tokens (the head's and the conv's sums rounded in
    # another order, carried through the recurrent state)
    assert (fast - old).abs().max() <= 1e-5 * old.abs().max()
    # the old decode head, as it was: F.linear over [vocab, hidden]
    x = torch.randn(1, model.config.hidden_size)
    assert torch.allclose(torch.mm(x, new_head), F.linear(x, model.w["lm_head.weight"]),
                          atol=1e-5, rtol=0)
