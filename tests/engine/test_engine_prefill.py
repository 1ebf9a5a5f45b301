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

    # a GDN layer last: the last layer's queries are the head's rows alone (HybridModel._layers'
    # keep), its attention no chunk's whole
    config = dict(SMALL_CONFIG, num_hidden_layers=9,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2
                  + ["linear_attention"])
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


def test_the_rows_a_chunk_writes_do_not_depend_on_the_rows_its_head_reads(hybrid):
    """Gate: torch.equal. The last layer's work that only its output reads (its queries, out
    projection and MLP) runs for the rows the head reads: none before the last chunk, the
    last row, or every row for prompt logprobs. Every section and key/value row the chunks
    write is the same bits whichever, and so are the last row's logits with or without the
    other rows' (the small hybrid: decay near 0.98, its last layer attention)."""
    prompt = torch.randint(0, hybrid.vocab_size, (2 * CHUNK + 9,),
                           generator=torch.Generator().manual_seed(8))
    runs = {}
    for read in ("none", "last", "every"):
        engine = Engine(hybrid, window=256, prefix_chunk=CHUNK)
        rows = []
        for a in range(0, len(prompt), CHUNK):
            chunk = prompt[a:a + CHUNK]
            with torch.inference_mode():
                if read == "every":
                    out = hybrid.forward(engine.state, chunk, a,
                                         on_logits=lambda first, r: rows.append(r))
                else:
                    out = hybrid.forward(engine.state, chunk, a, logits=read == "last")
        runs[read] = (engine.state, out, rows)
    none, last, every = runs["none"], runs["last"], runs["every"]
    assert none[1] is None and last[1] is not None and len(every[2]) == 3
    assert torch.equal(last[1], every[1])
    for other in (last, every):
        for name, t in none[0].sections.items():
            assert torch.equal(t, other[0].sections[name]), name
        for name, v in none[0].views.items():
            assert torch.equal(v.tensor, other[0].views[name].tensor), name
    # the prompt-logprob rows are the model's next-token logits there, not the last row's again
    assert not torch.equal(every[2][-1][-1], every[1])
