"""Triton kernels for the spill's byte moves: byte planes cut and joined (planes.py) and the two
64-bit block sums (blocksums.py), on CUDA tensors.

``planes.py`` and ``blocksums.py`` look these up for a CUDA tensor (``tandem.kernels.cuda_op``)
and keep their torch paths everywhere else. Both are exact: byte moves, and integer sums mod
2**64 (unsigned 64-bit adds and multiplies wrap, by definition in Triton's IR as in numpy), held
to the references with torch.equal under ``TRITON_INTERPRET=1``
(tests/kernels/test_triton_spill.py).

The sums are taken in two launches, no atomics: each program sums a tile of a block's words
into one partial pair, and one program a block adds its partials in tile order. Integer sums
mod 2**64 give the same bits in any order, so this is deterministic for any shape by arithmetic,
not by care.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ELEMENTS = 1024  # elements a plane program moves
TILE_WORDS = 4096  # words a partial sum covers
FINAL_TILES = 256  # partials a final program adds a step


@triton.jit
def _cut_kernel(data, planes, n, E: tl.constexpr, BN: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = i < n
    for j in tl.static_range(E):
        tl.store(planes + j * n + i, tl.load(data + i * E + j, mask=m), mask=m)


@triton.jit
def _join_kernel(planes, data, n, E: tl.constexpr, BN: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = i < n
    for j in tl.static_range(E):
        tl.store(data + i * E + j, tl.load(planes + j * n + i, mask=m), mask=m)


def cut_planes_bytes(data: torch.Tensor, planes: torch.Tensor) -> None:
    """data uint8 [n, e] (an element a row, contiguous) into planes uint8 [e, n]."""
    n, e = data.shape
    if n:
        _cut_kernel[(triton.cdiv(n, BLOCK_ELEMENTS),)](data, planes, n, E=e, BN=BLOCK_ELEMENTS)


def join_planes_bytes(planes: torch.Tensor, data: torch.Tensor) -> None:
    """planes uint8 [e, n] into data uint8 [n, e] (contiguous), cut_planes_bytes' inverse."""
    n, e = data.shape
    if n:
        planes = planes.contiguous()
        _join_kernel[(triton.cdiv(n, BLOCK_ELEMENTS),)](planes, data, n, E=e, BN=BLOCK_ELEMENTS)


@triton.jit
def _partial_sums(data, part, nbytes, s_row, n_tiles, BW: tl.constexpr):
    """Tile ``t`` of block ``b``: the plain and weighted sums of its words (the word at index i
    of the block weighted by i + 1), mod 2**64, as int64 bits in part[b, t]."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    wi = t * BW + tl.arange(0, BW)  # the words' indices in the block
    row = data + b * s_row
    word = tl.zeros([BW], dtype=tl.uint64)
    for j in tl.static_range(4):  # little-endian; bytes past the block are the zero padding
        at = wi * 4 + j
        byte = tl.load(row + at, mask=at < nbytes, other=0)
        word = word | (byte.to(tl.uint64) << (8 * j))
    plain = tl.sum(word, axis=0)
    weighted = tl.sum(word * (wi + 1).to(tl.uint64), axis=0)
    at = (b * n_tiles + t) * 2
    tl.store(part + at, plain.to(tl.int64, bitcast=True))
    tl.store(part + at + 1, weighted.to(tl.int64, bitcast=True))


@triton.jit
def _final_sums(part, out, n_tiles, BT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    plain = tl.zeros([BT], dtype=tl.uint64)
    weighted = tl.zeros([BT], dtype=tl.uint64)
    for first in range(0, n_tiles, BT):
        t = first + tl.arange(0, BT)
        at = (b * n_tiles + t) * 2
        m = t < n_tiles
        plain += tl.load(part + at, mask=m, other=0).to(tl.uint64, bitcast=True)
        weighted += tl.load(part + at + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
    tl.store(out + b * 2, tl.sum(plain, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + b * 2 + 1, tl.sum(weighted, axis=0).to(tl.int64, bitcast=True))


def block_sums_of_bytes(data: torch.Tensor) -> torch.Tensor:
    """blocksums._sums_of_bytes: data uint8 [B, nbytes] (each row a block's bytes) -> int64
    [B, 2], (plain, weighted) holding the uint64 bits."""
    num_blocks, nbytes = data.shape
    if data.stride(1) != 1:
        data = data.contiguous()
    num_words = -(-nbytes // 4)
    n_tiles = max(1, triton.cdiv(num_words, TILE_WORDS))
    part = torch.empty(num_blocks, n_tiles, 2, dtype=torch.int64, device=data.device)
    out = torch.empty(num_blocks, 2, dtype=torch.int64, device=data.device)
    if num_blocks:
        _partial_sums[(num_blocks, n_tiles)](data, part, nbytes, data.stride(0), n_tiles,
                                             BW=TILE_WORDS)
        _final_sums[(num_blocks,)](part, out, n_tiles, BT=FINAL_TILES)
    return out


CUDA_OPS = {
    "cut_planes_bytes": cut_planes_bytes,
    "join_planes_bytes": join_planes_bytes,
    "block_sums_of_bytes": block_sums_of_bytes,
}
