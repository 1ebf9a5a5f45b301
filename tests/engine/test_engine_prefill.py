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


def test_a_prefill_chunk_gives_every_attention_layer_one_mask_line_and_the_whole_masks_bits(
        monkeypatch):
    # SDPA converts a boolean mask to an additive one in every call (about 35 ms a layer at
    # 16k keys on tiny): the forward builds its mask once, for both attention layers here, as
    # one line of n + end - 1 values that the queries, in reverse, read with strides (1, 1)
    # (hybrid.ChunkMask; a whole mask was 64 MiB at 16k keys). Gate: torch.equal: every such
    # call gives the bits of the whole additive mask over the queries in order. A first chunk
    # sees only its own keys: SDPA's is_causal, no mask, and the mask's very bits (checked
    # here by running each such call with the mask too).
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
        n, end = q.shape[-2], k.shape[-2]
        if is_causal:
            explicit = torch.full((n, n), float("-inf")).triu(1)
            assert torch.equal(out, sdpa(q, k, v, *args, attn_mask=explicit, **kw))
        if attn_mask is not None:
            start = end - n
            whole = torch.zeros(n, end)
            whole[:, start:] = torch.full((n, n), float("-inf")).triu(1)
            assert torch.equal(attn_mask, whole.flip(0))
            in_order = sdpa(q.flip(-2), k, v, *args, attn_mask=whole, **kw)
            assert torch.equal(out.flip(-2), in_order)
        return out

    monkeypatch.setattr(hybrid_module.F, "scaled_dot_product_attention", spy)
    for length in (100, 64 + 64 + 37):  # chunks of 64 then 36; of 64, 64 then 37
        masks.clear(), causal.clear()
        Engine(model, window=256, prefix_chunk=CHUNK).prefill(list(range(length)))
        later = len(masks) - 2
        assert masks[:2] == [None, None] and causal == [True, True] + [False] * later
        for a, b in zip(masks[2::2], masks[3::2]):  # the two layers of a chunk share one line
            assert a.stride() == (1, 1) and a.untyped_storage().data_ptr() \
                == b.untyped_storage().data_ptr()
            n, end = a.shape
            assert a.untyped_storage().nbytes() == (n + end - 1) * a.element_size()
        assert [tuple(m.shape) for m in masks[2:]] == (
            [(36, 100)] * 2 if length == 100 else [(64, 128)] * 2 + [(37, 165)] * 2)


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
