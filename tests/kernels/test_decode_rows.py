"""Decode's matmul gives a row the same bits whatever the batch around it: alone, beside 1 to
20 others, at any place, in fp32 and bf16, on the decode shapes of tiny, a 0.8B-like model and
the small test models (where the platform's BLAS is not invariant, rows_linear must be made so
before batching: at hidden 64, MKL's F.linear moves a row's bits from M = 3 on)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.decode import BLOCK, rows_linear

# (outputs, inputs): tiny's GDN in_proj, MLP gate_up, down, the head; a 0.8B-like in_proj,
# gate_up, down and out_proj; the small hybrid's and the oracle models' (hidden 64, 24)
SHAPES = [(1568, 256), (1024, 256), (256, 512), (248_320, 256),
          (8224, 1024), (7168, 1024), (1024, 3584), (1024, 2048),
          (328, 64), (256, 64), (64, 128), (8, 64), (97, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_alone_and_at_any_place_in_any_batch(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    n, k = shape
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    rows = torch.randn(22, k, generator=gen).to(dtype)
    alone = rows_linear(rows[:1], w)[0]
    sizes = (2, 3, 4, 5, 7, 8, 9, 21) if n < 100_000 else (2, BLOCK, BLOCK + 1, 8)
    for size in sizes:
        for place in sorted({0, size // 2, size - 1}):
            batch = rows[1:size + 1].clone()
            batch[place] = rows[0]
            got = rows_linear(batch, w)
            assert got.shape == (size, n)
            assert torch.equal(got[place], alone), (size, place)


def test_rows_linear_is_x_times_w_transposed():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(11, 64, generator=gen)
    assert torch.allclose(rows_linear(x, w), x @ w.T, atol=1e-5)
    assert torch.allclose(rows_linear(x[:1], w), F.linear(x[:1], w), atol=1e-5)
