"""The disk tier's keys and index: a chain of hashes along the grid, with the cache salt in every
key, and an anchor that serves only with every chunk below it on disk."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cache.namespace import SHARED, namespace_of
from tandem.io.chain import chain_keys, is_key
from tandem.io.tierindex import AnchorEntry, ChunkEntry, TierIndex, scan
from tandem.models.third import ThirdModel

from tier_rig import ACCEPT, FP, GRID, engine, restore, tokens, write_prompt


def test_the_cache_salt_is_part_of_every_key():
    prompt = tokens(1000, 5 * GRID, 1)
    chains = [chain_keys(prompt, GRID, ns) for ns in
              (SHARED, namespace_of("tenant a"), namespace_of("tenant b"), namespace_of(""))]
    for i in range(5):
        assert len({c[i] for c in chains}) == len(chains), i
    assert chain_keys(prompt, GRID, namespace_of("tenant a")) == chains[1]


def test_a_prompt_that_extends_another_shares_its_keys_and_parts_where_the_tokens_do():
    head = tokens(1000, 3 * GRID, 2)
    longer = head + tokens(1000, 2 * GRID + 7, 3)
    assert chain_keys(longer, GRID, SHARED)[:3] == chain_keys(head, GRID, SHARED)
    edited = list(longer)
    edited[GRID + 5] += 1  # inside the second chunk: every key from its line on differs
    a, b = chain_keys(longer, GRID, SHARED), chain_keys(edited, GRID, SHARED)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    assert len(a) == 5 and all(is_key(k) for k in a)
    assert chain_keys(longer, GRID, SHARED, stop=2 * GRID + 3) == a[:2]


def test_the_grid_is_part_of_the_key():
    prompt = tokens(1000, 4 * GRID, 4)
    assert chain_keys(prompt, GRID, SHARED)[1] != chain_keys(prompt, 2 * GRID, SHARED)[0]


def test_a_key_is_a_hash_and_no_token_or_salt():
    prompt = [11, 22, 33] * GRID
    key = chain_keys(prompt, GRID, namespace_of("secret"))[0]
    assert is_key(key) and "secret" not in key and "11" not in key[:2]


def test_a_prompt_that_extends_one_on_disk_writes_only_its_new_chunks(files):
    model = ThirdModel()
    head = tokens(model.vocab_size, 2 * GRID, 5)
    write_prompt(files, model, head, [2 * GRID])
    index, _ = scan(files, ACCEPT, GRID)
    longer = head + tokens(model.vocab_size, 2 * GRID, 6)
    chain = chain_keys(longer, GRID, SHARED)
    assert index.missing_chunks(chain) == [2, 3]
    assert index.chunks_present(chain) == 2


def test_an_anchor_is_unusable_while_a_chunk_below_it_is_missing(files):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, 4 * GRID + 9, 7)
    cold, want, chain = write_prompt(files, model, prompt, [2 * GRID, 4 * GRID])
    index, _ = scan(files, ACCEPT, GRID)
    assert index.longest_anchor(chain).line == 4 * GRID
    files.discard("chunk", chain[2])  # under the anchor at 4 G only
    index, _ = scan(files, ACCEPT, GRID)
    assert not index.usable(index.anchors[chain[3]])
    assert index.longest_anchor(chain).line == 2 * GRID
    fresh = engine(model)
    assert restore(files, fresh, prompt, index) == 2 * GRID
    assert torch.equal(fresh.prefill(prompt), want)
    files.discard("chunk", chain[0])
    index, _ = scan(files, ACCEPT, GRID)
    assert index.longest_anchor(chain) is None
    assert index.readers(chain[1]) == [index.anchors[chain[1]], index.anchors[chain[3]]]


def test_an_anchor_serves_only_the_chain_it_lists():
    index = TierIndex()
    chain = chain_keys(tokens(1000, 2 * GRID, 8), GRID, SHARED)
    other = chain_keys(tokens(1000, 2 * GRID, 9), GRID, SHARED)
    for k, (a, b) in zip(chain, [(0, GRID), (GRID, 2 * GRID)]):
        index.add_chunk(ChunkEntry(k, a, b, 4096, FP))
    index.add_chunk(ChunkEntry(other[0], 0, GRID, 4096, FP))
    # an entry whose list is not the chain to its key (a corrupt or forged header)
    index.add_anchor(AnchorEntry(chain[1], 2 * GRID, (other[0], chain[1]), 4096, FP))
    index.check_invariants()
    assert index.usable(index.anchors[chain[1]])
    assert index.longest_anchor(chain) is None


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), chunks=st.sets(st.integers(0, 11)),
       anchors=st.sets(st.integers(0, 11)), stop=st.none() | st.integers(0, 12))
def test_the_longest_anchor_is_the_longest_whose_chunks_are_all_on_disk(n, chunks, anchors,
                                                                         stop):
    chain = chain_keys(list(range(n * GRID)), GRID, SHARED)
    index = TierIndex()
    for i in chunks & set(range(n)):
        index.add_chunk(ChunkEntry(chain[i], i * GRID, (i + 1) * GRID, 4096, FP))
    for i in anchors & set(range(n)):
        index.add_anchor(AnchorEntry(chain[i], (i + 1) * GRID, tuple(chain[:i + 1]), 4096, FP))
    index.check_invariants()
    top = n if stop is None else min(stop, n)
    usable = [i for i in anchors if i < top and all(j in chunks for j in range(i + 1))]
    hit = index.longest_anchor(chain, stop)
    assert (hit.line if hit else None) == ((max(usable) + 1) * GRID if usable else None)
    present = 0
    while present < n and present in chunks:
        present += 1
    assert index.chunks_present(chain) == present


def test_removing_an_entry_is_reflected_at_once():
    chain = chain_keys(list(range(GRID)), GRID, SHARED)
    index = TierIndex()
    index.add_chunk(ChunkEntry(chain[0], 0, GRID, 8192, FP))
    index.add_anchor(AnchorEntry(chain[0], GRID, (chain[0],), 4096, FP))
    assert index.nbytes == 12288 and index.longest_anchor(chain).line == GRID
    assert index.remove("chunk", chain[0]) and not index.remove("chunk", chain[0])
    assert index.longest_anchor(chain) is None and index.has("anchor", chain[0])


@pytest.mark.parametrize("salt", ["a", "b"])
def test_a_file_of_another_salt_is_never_found_for_a_prompt(files, salt):
    model = ThirdModel()
    prompt = tokens(model.vocab_size, GRID + 3, 10)
    write_prompt(files, model, prompt, [GRID], namespace=namespace_of("a"))
    fresh = engine(model)
    got = restore(files, fresh, prompt, namespace=namespace_of(salt))
    assert got == (GRID if salt == "a" else 0)
    assert restore(files, engine(model), prompt) == 0  # and none for the shared namespace
