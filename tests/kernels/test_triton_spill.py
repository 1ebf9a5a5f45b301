"""The spill's Triton byte kernels (tandem.kernels.triton_spill) against the references, under
the interpreter on a CPU (issue 20, part 2), all torch.equal (the math is exact): byte planes
against the numpy reference and back, the block sums against the numpy specification and the
torch path, with blocks that are not whole words, span many tiles, and wrap 2**64."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import blocksums, planes  # noqa: E402
from tandem.kernels import triton_spill  # noqa: E402


def _tensor(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (37, 5)), (torch.float32, (3001,)),
                                          (torch.float16, (1, 3)), (torch.uint8, (7,)),
                                          (torch.float64, (2, 700))])
def test_byte_planes_match_the_numpy_reference_and_join_back(device, dtype, shape):
    t = _tensor(shape, dtype, seed=len(shape))
    e = t.element_size()
    data = _bytes(t).reshape(-1, e).to(device)
    cut = torch.empty(e, data.shape[0], dtype=torch.uint8, device=device)
    triton_spill.cut_planes_bytes(data, cut)
    want = planes.cut_planes_reference(_bytes(t).numpy(), e)
    assert np.array_equal(cut.cpu().numpy(), want)
    joined = torch.empty_like(data)
    triton_spill.join_planes_bytes(cut, joined)
    assert torch.equal(joined, data)


def _want_sums(rows: torch.Tensor) -> list[tuple[int, int]]:
    return [blocksums.block_sums_reference(row) for row in rows.cpu()]


def _got_sums(sums: torch.Tensor) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in row) for row in blocksums.host_sums(sums)]


@pytest.mark.parametrize("nbytes", [1, 6, 4096 * 4, 3 * 4096 * 4 + 3])
def test_block_sums_match_the_specification_and_the_torch_path(device, nbytes):
    rows = _tensor((3, nbytes), torch.uint8, seed=nbytes)
    got = triton_spill.block_sums_of_bytes(rows.to(device))
    assert _got_sums(got) == _want_sums(rows)
    assert torch.equal(got.cpu(), blocksums._sums_of_bytes(rows))


def test_block_sums_wrap_mod_two_to_the_64_as_the_specification_does(device):
    # 2**17 words of 0xFFFFFFFF: the weighted sum is near 2**65
    rows = torch.full((1, 4 << 17), 255, dtype=torch.uint8)
    plain, weighted = blocksums.block_sums_reference(rows[0])
    assert weighted < (2 ** 32 - 1) * (2 ** 17) * (2 ** 17 + 1) // 2  # it wrapped
    assert _got_sums(triton_spill.block_sums_of_bytes(rows.to(device))) == [(plain, weighted)]
