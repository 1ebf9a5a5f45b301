"""The spill's block sums (tandem.kernels.blocksums): the torch path held to the numpy reference,
the reference to plain Python integers, and the sums held to what they are for (issue 16,
part 3): a flipped bit is seen, equal blocks are equal wherever they lie."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tandem.cache.copies import SectionsCopy
from tandem.kernels import blocksums
from tandem.kernels.blocksums import (ROW_WORDS, block_sums, block_sums_python,
                                      block_sums_reference, host_sums, sections_sums,
                                      view_block_sums, views_block_sums)
from tandem.models.base import View

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_tensor(shape, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # e4m3 rows are stored as uint8
        t = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    else:
        t = (torch.randn(shape, generator=gen) * 3).to(dtype)
    return t.to(device)


def as_ints(sums: torch.Tensor) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in row) for row in host_sums(sums).reshape(-1, 2)]


def reference_blocks(tensor, axis, start, stop, g):
    return [block_sums_reference(tensor.narrow(axis, a, min(a + g, stop) - a))
            for a in range(start, stop, g)]


LAYOUTS = {
    # name: (make the tensor from a seed and dtype, token axis)
    "contiguous rows first": (lambda d, dev: random_tensor((300, 2, 24), d, 1, dev), 0),
    "token axis inside (K of [layers, heads, rows, dim])":
        (lambda d, dev: random_tensor((2, 3, 300, 16), d, 2, dev), 2),
    "a transposed buffer": (lambda d, dev: random_tensor((40, 300), d, 3, dev).t(), 0),
    "a strided slice of a wider buffer":
        (lambda d, dev: random_tensor((3, 300, 40), d, 4, dev)[:, :, 5:31:2], 1),
    "odd bytes a block (not whole words)": (lambda d, dev: random_tensor((300, 3), d, 5, dev), 0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_sums_of_a_views_blocks_equal_the_reference_in_every_dtype_and_layout(
        dtype, layout, device):
    make, axis = LAYOUTS[layout]
    tensor = make(dtype, device)
    # from an offset row, in blocks of 64 with a short last block
    got = as_ints(view_block_sums(tensor, axis, 7, 300, 64))
    assert got == reference_blocks(tensor.cpu(), axis, 7, 300, 64)
    assert len(got) == 5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_sums_of_a_block_are_those_of_its_bytes_in_the_order_the_file_stores_them(dtype):
    t = random_tensor((2, 3, 50, 8), dtype, 9)
    block = t[:, :, 10:20]
    stored = block.contiguous().reshape(-1).view(torch.uint8)  # what tierfile writes
    assert as_ints(block_sums(block)) == as_ints(block_sums(stored))
    assert as_ints(block_sums(block)) == [block_sums_reference(stored)]


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_the_numpy_reference_equals_plain_python_integers_on_any_bytes(data):
    t = torch.tensor(list(data), dtype=torch.uint8)
    assert block_sums_reference(t) == block_sums_python(t)
    assert as_ints(block_sums(t)) == [block_sums_python(t)]


def test_the_sums_carry_exactly_at_the_largest_words_over_many_rows():
    # Every word 2**32 - 1 over 2**22 words: each limb sum near its bound, every carry taken.
    n = 1 << 22
    block = torch.full((n,), -1, dtype=torch.int32)
    want = ((2 ** 32 - 1) * n % 2 ** 64, (2 ** 32 - 1) * n * (n + 1) // 2 % 2 ** 64)
    assert as_ints(block_sums(block)) == [want] == [block_sums_reference(block)]


def test_the_sums_equal_the_reference_for_a_block_not_a_whole_number_of_rows_of_the_layout():
    t = random_tensor((ROW_WORDS * 4 * 3 + 4 * 17 + 3,), torch.uint8, 11)
    assert as_ints(block_sums(t)) == [block_sums_reference(t)]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.data())
def test_a_single_flipped_bit_anywhere_changes_its_blocks_sum_and_no_other(dtype, data):
    tensor = random_tensor((2, 200, 6), dtype, 13)
    before = as_ints(view_block_sums(tensor, 1, 0, 200, 32))
    nbytes = tensor.numel() * tensor.element_size()
    bit = data.draw(st.integers(0, nbytes * 8 - 1))
    raw = tensor.view(-1).view(torch.uint8)
    raw[bit // 8] ^= 1 << (bit % 8)
    after = as_ints(view_block_sums(tensor, 1, 0, 200, 32))
    # the byte's element: [layer, row, col] in C order
    row = (bit // 8 // tensor.element_size()) // 6 % 200
    for k, (b, a) in enumerate(zip(before, after)):
        if k == row // 32:
            assert b[0] != a[0] and b[1] != a[1]
        else:
            assert b == a


def test_two_words_swapped_keep_the_plain_sum_and_change_the_weighted_one():
    t = random_tensor((64,), torch.float32, 17)
    swapped = t.clone()
    swapped[[3, 40]] = t[[40, 3]]
    (p, w), (p2, w2) = as_ints(block_sums(t))[0], as_ints(block_sums(swapped))[0]
    assert p == p2 and w != w2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equal_blocks_have_equal_sums_whatever_else_is_in_the_tensor(dtype):
    block = random_tensor((2, 1, 64, 16), dtype, 19)
    a = random_tensor((2, 1, 512, 16), dtype, 20)
    b = random_tensor((2, 1, 320, 16), dtype, 21)
    a[:, :, 128:192] = block
    b[:, :, 256:320] = block
    sums_a = as_ints(view_block_sums(a, 2, 0, 512, 64))
    sums_b = as_ints(view_block_sums(b, 2, 0, 320, 64))
    assert sums_a[2] == sums_b[4] == as_ints(block_sums(block))[0]
    assert sums_a[1] != sums_b[4]


def test_every_views_sums_come_in_one_tensor_in_the_views_order():
    k = random_tensor((2, 1, 200, 8), torch.bfloat16, 23)
    keys = random_tensor((200, 12), torch.float32, 24)
    views = {"K": View(k, 2), "keys": View(keys, 0)}
    sums = views_block_sums(views, 0, 150, 64)
    assert sums.shape == (2, 3, 2) and sums.dtype == torch.int64
    assert as_ints(sums[0]) == reference_blocks(k, 2, 0, 150, 64)
    assert as_ints(sums[1]) == reference_blocks(keys, 0, 0, 150, 64)
    assert host_sums(sums).dtype == np.uint64


def test_every_section_of_an_anchor_is_summed_whole():
    sections = {"gdn.S": random_tensor((3, 4, 16, 16), torch.float32, 25),
                "gdn.conv": random_tensor((3, 40, 3), torch.bfloat16, 26).transpose(1, 2)}
    want = [block_sums_reference(t) for t in sections.values()]
    assert as_ints(sections_sums(sections)) == want
    assert as_ints(sections_sums(SectionsCopy(sections))) == want


def test_no_rows_are_no_blocks_and_a_bad_range_is_refused():
    t = random_tensor((10, 4), torch.float32)
    assert view_block_sums(t, 0, 4, 4, 8).shape == (0, 2)
    with pytest.raises(ValueError):
        view_block_sums(t, 0, 0, 11, 8)
    with pytest.raises(ValueError):
        view_block_sums(t, 0, 0, 10, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, ROW_WORDS * 4 * 3 + 9), st.integers(0, 2 ** 31))
def test_the_hosts_numpy_sums_and_the_torch_limbs_both_equal_the_reference(blocks, nbytes, seed):
    # The host path (numpy, wrapping uint64) and the torch path (limbs, for another device)
    # are two computations of one definition: whole rows of the [R, C] layout, a tail of part
    # of a row, a last word of fewer than 4 bytes, and several blocks in one call.
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (blocks, nbytes), generator=gen, dtype=torch.uint8)
    want = [block_sums_reference(row) for row in data]
    assert as_ints(blocksums._sums_of_bytes(data)) == want
    assert as_ints(torch.from_numpy(blocksums._host_sums_of_bytes(data.numpy()))) == want
    assert as_ints(blocksums._torch_sums_of_bytes(data)) == want


def test_the_hosts_sums_carry_exactly_at_the_largest_words_in_the_tail_and_the_rows():
    n = ROW_WORDS * 3 + 5  # three whole rows and a tail, every word 2**32 - 1
    data = torch.full((1, n * 4), 255, dtype=torch.uint8)
    want = ((2 ** 32 - 1) * n % 2 ** 64, (2 ** 32 - 1) * n * (n + 1) // 2 % 2 ** 64)
    assert as_ints(torch.from_numpy(blocksums._host_sums_of_bytes(data.numpy()))) == [want]
