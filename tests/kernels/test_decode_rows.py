"""Decode's matmul gives a row the same bits whatever the batch around it: alone, beside 1 to
20 others, at any place, in fp32 and bf16, on the decode shapes of tiny, a 0.8B-like model and
the small test models (where the platform's BLAS is not invariant, rows_linear must be made so
before batching: at hidden 64, MKL's F.linear moves a row's bits from M = 3 on)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import native
from tandem.kernels.decode import TORCH_BLOCK, _one_call_is_each_row, each_row, rows_linear

# (outputs, inputs): tiny's GDN in_proj, MLP gate_up, down, the head; a 0.8B-like in_proj,
# gate_up, down and out_proj; the small hybrid's and the oracle models' (hidden 64, 24)
SHAPES = [(1568, 256), (1024, 256), (256, 512), (248_320, 256),
          (8224, 1024), (7168, 1024), (1024, 3584), (1024, 2048),
          (328, 64), (256, 64), (64, 128), (8, 64), (97, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_alone_and_at_any_place_in_any_batch(shape, dtype,
                                                                     decode_matmuls):
    gen = torch.Generator().manual_seed(shape[0])
    n, k = shape
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    rows = torch.randn(22, k, generator=gen).to(dtype)
    alone = rows_linear(rows[:1], w)[0]
    sizes = (2, 3, 4, 5, 7, 8, 9, 21) if n < 100_000 else (2, TORCH_BLOCK + 1, 4, 8)
    for size in sizes:
        for place in sorted({0, size // 2, size - 1}):
            batch = rows[1:size + 1].clone()
            batch[place] = rows[0]
            got = rows_linear(batch, w)
            assert got.shape == (size, n)
            assert torch.equal(got[place], alone), (size, place)


def test_rows_linear_is_x_times_w_transposed(decode_matmuls):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(11, 64, generator=gen)
    assert torch.allclose(rows_linear(x, w), x @ w.T, atol=1e-5)
    assert torch.allclose(rows_linear(x[:1], w), F.linear(x[:1], w), atol=1e-5)


def test_rows_linear_on_a_weight_transposed_once_is_f_linear_s_bits(torch_matmuls):
    gen = torch.Generator().manual_seed(1)
    for n, k in ((1568, 256), (256, 512), (8, 64)):
        w = torch.randn(n, k, generator=gen)
        for b in (1, 2, 3, 5):
            x = torch.randn(b, k, generator=gen)
            assert torch.equal(rows_linear(x, w, w.t()), rows_linear(x, w))
        assert torch.equal(rows_linear(x[:2], w, w.t()), F.linear(x[:2], w))


# each_row's one-call cases, by layout: a projection's slice (rows apart), contiguous rows of a
# multiple of 64, a call under 16 elements, rows themselves in runs (half of each head's [q,
# gate], as attention's projection gives them); and where one call must not be taken (contiguous
# rows of 4 to 48 elements at 2 to 8 rows, whose tails move with the batch)
ONE_CALL = [("slice", 4), ("slice", 16), ("slice", 24), ("slice", 100), ("slice", 128),
            ("contiguous", 64), ("contiguous", 384), ("contiguous", 3584), ("small", 4),
            ("heads", 24), ("heads", 32)]
ROW_A_CALL = [("contiguous", 16), ("contiguous", 24), ("contiguous", 48), ("contiguous", 100)]


def _rows(layout: str, width: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    if layout == "slice":  # a part of a fused projection's output, as decode takes it
        return torch.randn(rows, width + 40, generator=gen)[:, 8:8 + width]
    if layout == "heads":  # 3 heads of `width`, each the second half of its [2 * width]
        return torch.randn(rows, 3, 2 * width, generator=gen)[..., width:]
    return torch.randn(rows, width, generator=gen) * 4


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, F.softplus, torch.exp])
@pytest.mark.parametrize("layout,width", ONE_CALL + ROW_A_CALL)
def test_each_row_gives_a_row_the_bits_it_gets_alone_in_one_call_or_a_call_a_row(
        fn, layout, width):
    gen = torch.Generator().manual_seed(width)
    for rows in ((2, 3) if layout == "small" else (2, 3, 5, 8)):
        x = _rows(layout, width, rows, gen)
        got = each_row(fn, x)
        for b in range(rows):
            assert torch.equal(got[b], fn(x[b])), (rows, b)  # the row as it lies, alone


def test_one_call_over_contiguous_rows_of_a_few_elements_would_move_a_rows_bits():
    """Why each_row takes a call a row for ROW_A_CALL's layouts: one call over them gives some
    row other bits than alone (the vectorised loop's tail falls elsewhere)."""
    gen = torch.Generator().manual_seed(0)
    moved = 0
    for _, width in ROW_A_CALL:
        for rows in (2, 3, 5, 8):
            x = _rows("contiguous", width, rows, gen)
            whole = F.silu(x)
            moved += any(not torch.equal(whole[b], F.silu(x[b].clone())) for b in range(rows))
    assert moved > 0
    assert not _one_call_is_each_row(_rows("contiguous", 24, 3, gen))
    assert _one_call_is_each_row(_rows("slice", 24, 3, gen))
