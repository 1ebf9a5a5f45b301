"""A prefill's chunks before the last skip the head: only the last chunk's logits are read, and
the head (vocab x hidden, 254 MB on tiny) cost a read of the whole matrix a chunk."""

import torch

from tandem.engine import Engine

CHUNK = 64


def test_a_prefill_in_chunks_computes_the_head_for_its_last_chunk_alone(model):
    asked = []
    forward = model.forward

    def spy(state, token_ids, start, **kw):
        asked.append(kw.get("logits", True))
        return forward(state, token_ids, start, **kw)

    prompt = torch.randint(0, model.vocab_size, (3 * CHUNK + 5,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    every = Engine(model, window=256, prefix_chunk=CHUNK)
    want = [forward(every.state, torch.tensor(prompt[a:a + CHUNK]), a)
            for a in range(0, len(prompt), CHUNK)][-1]
    engine = Engine(model, window=256, prefix_chunk=CHUNK)
    engine.model.forward = spy
    try:
        got = engine.prefill(prompt)
    finally:
        del engine.model.forward
    assert asked == [False, False, False, True]
    assert torch.equal(got, want)  # the head changes nothing the chunks write


def test_the_hybrid_returns_no_logits_when_asked_for_none(hybrid):
    engine = Engine(hybrid, window=128, prefix_chunk=CHUNK)
    assert hybrid.forward(engine.state, torch.arange(10), 0, logits=False) is None


def test_a_prefill_chunk_gives_every_attention_layer_one_additive_mask(monkeypatch):
    # SDPA converts a boolean mask to this additive one in every call (about 35 ms a layer at
    # 16k keys on tiny): the forward builds it once, for both attention layers here.
    from small_hybrid import SMALL_CONFIG
    from tandem.models import hybrid as hybrid_module
    from tandem.models.hybrid import HybridConfig, HybridModel
    from tandem.models.tiny import _weights

    config = dict(SMALL_CONFIG, num_hidden_layers=8,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    model = HybridModel(HybridConfig.from_dict(config),
                        {k.removeprefix("model."): v for k, v in _weights(config).items()})
    masks = []
    sdpa = hybrid_module.F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kw):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(hybrid_module.F, "scaled_dot_product_attention", spy)
    Engine(model, window=256, prefix_chunk=CHUNK).prefill(list(range(100)))
    assert len(masks) == 4  # two layers, a chunk of 64 then one of 36
    assert masks[0] is masks[1] and masks[2] is masks[3]
    for mask, (start, n) in zip(masks[::2], [(0, 64), (64, 36)]):
        want = torch.zeros(n, start + n)
        want[:, start:] = torch.full((n, n), float("-inf")).triu(1)
        assert mask.dtype == model.dtype and torch.equal(mask, want)
