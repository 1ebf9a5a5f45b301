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
    # 16k keys on tiny): the forward builds it once, for both attention layers here. A first
    # chunk sees only its own keys: SDPA's is_causal, no mask, and the mask's very bits
    # (checked here by running each such call with the mask too).
    from small_hybrid import SMALL_CONFIG
    from tandem.models import hybrid as hybrid_module
    from tandem.models.hybrid import HybridConfig, HybridModel
    from tandem.models.tiny import _weights

    config = dict(SMALL_CONFIG, num_hidden_layers=8,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    model = HybridModel(HybridConfig.from_dict(config),
                        {k.removeprefix("model."): v for k, v in _weights(config).items()})
    masks, causal = [], []
    sdpa = hybrid_module.F.scaled_dot_product_attention

    def spy(q, k, v, *args, attn_mask=None, is_causal=False, **kw):
        masks.append(attn_mask)
        causal.append(is_causal)
        out = sdpa(q, k, v, *args, attn_mask=attn_mask, is_causal=is_causal, **kw)
        if is_causal:
            n = q.shape[-2]
            explicit = torch.full((n, n), float("-inf")).triu(1)
            assert torch.equal(out, sdpa(q, k, v, *args, attn_mask=explicit, **kw))
        return out

    monkeypatch.setattr(hybrid_module.F, "scaled_dot_product_attention", spy)
    Engine(model, window=256, prefix_chunk=CHUNK).prefill(list(range(100)))
    assert len(masks) == 4  # two layers, a chunk of 64 then one of 36
    assert masks[:2] == [None, None] and causal == [True, True, False, False]
    assert masks[2] is masks[3]
    start, n = 64, 36
    want = torch.zeros(n, start + n)
    want[:, start:] = torch.full((n, n), float("-inf")).triu(1)
    assert masks[2].dtype == model.dtype and torch.equal(masks[2], want)
