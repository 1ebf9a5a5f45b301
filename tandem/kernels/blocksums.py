"""Two 64-bit sums of a block of rows, computed where the rows are (spec: "Incremental by content").

A block's bytes are the bytes the spill's file stores for it: the block tensor in C order (as
``block.contiguous()`` lays it out, the token axis where the view has it), padded with zero bytes
to a whole number of 32-bit words, each word read little-endian as an unsigned integer
``w_0 .. w_{n-1}``. The two sums are

    plain    = sum(w_i)            mod 2**64
    weighted = sum(w_i * (i + 1))  mod 2**64

A flipped bit changes ``plain`` (by +-2**k, never 0 mod 2**64), and the weighted sum catches what
the plain one cannot: two words swapped, a block's words shifted. Positions count from the
block's first word, so equal blocks have equal sums wherever they lie in their tensor.

``block_sums_reference`` (numpy, whose uint64 arithmetic wraps by definition) is the
specification; the functions here run on the tensor's device: on a CUDA tensor the Triton kernel
``triton_spill.block_sums_of_bytes``, on a host tensor numpy over its bytes
(``_host_sums_of_bytes``), elsewhere torch ops (``_torch_sums_of_bytes``, the limbs below), each
held to the same reference. Sums are returned as int64 tensors holding the uint64 bit patterns
(torch's uint64 has too few ops), ``host_sums`` reads them back as numpy uint64 in one copy.

The torch path never relies on int64 overflow (its wrap-around is not defined for every device
and reduction): a block's words are laid out as ``[R, C]`` (C = 4,096 words), so that with
``i = r*C + c``

    weighted = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c

where every row and column sum is exact in int64, and the two dot products are taken in 16-bit
limbs whose partial sums stay below 2**55 and are carried into four 16-bit limbs of the result.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

import tandem.kernels as _kernels
from tandem.models.base import View

WORD_NBYTES = 4
ROW_WORDS = 4096  # C: the words of one row of the [R, C] layout; a power of two below 2**16
# R * C words: every row sum < C * 2**32 = 2**44 and column sum < R * 2**32 <= 2**51, so that
# the limb products below (< 2**32) summed over R or C terms stay far below 2**63.
MAX_BLOCK_WORDS = 1 << 31  # 8 GiB a block
GROUP_NBYTES = 256 << 20  # blocks summed in one pass; the int64 words take twice that
_M16 = 0xFFFF
_M32 = 0xFFFFFFFF


def block_sums_reference(block: torch.Tensor) -> tuple[int, int]:
    """(plain, weighted) of one block, in numpy on the host: the specification."""
    words = _words_reference(block).astype(np.uint64)
    positions = np.arange(1, words.size + 1, dtype=np.uint64)
    return int(words.sum(dtype=np.uint64)), int((words * positions).sum(dtype=np.uint64))


def block_sums_python(block: torch.Tensor) -> tuple[int, int]:
    """The same in plain Python integers (slow; for small blocks in tests of the reference)."""
    words = [int(w) for w in _words_reference(block)]
    return (sum(words) % 2 ** 64,
            sum(w * (i + 1) for i, w in enumerate(words)) % 2 ** 64)


def _words_reference(block: torch.Tensor) -> np.ndarray:
    data = _c_order_bytes(block.detach().cpu()).numpy()
    pad = -data.size % WORD_NBYTES
    if pad:
        data = np.concatenate([data, np.zeros(pad, dtype=np.uint8)])
    return data.view("<u4")


def _c_order_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order, flat uint8, on its device (a copy where not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def block_sums(block: torch.Tensor) -> torch.Tensor:
    """(plain, weighted) of one block on its device: int64 [2] holding the uint64 bits."""
    return _sums_of_bytes(_c_order_bytes(block).unsqueeze(0))[0]


def view_block_sums(tensor: torch.Tensor, token_axis: int, start: int, stop: int,
                    rows_per_block: int) -> torch.Tensor:
    """Sums of the blocks of rows ``[start, stop)`` along ``token_axis``: block k is rows
    ``[start + k*G, min(start + (k+1)*G, stop))`` (the last one may be short). int64
    ``[num_blocks, 2]`` on the tensor's device; a block's sums are ``block_sums`` of its rows."""
    if rows_per_block <= 0 or not 0 <= start <= stop <= tensor.shape[token_axis]:
        raise ValueError(f"rows [{start}, {stop}) in blocks of {rows_per_block} outside a "
                         f"token axis of {tensor.shape[token_axis]}")
    token_axis %= tensor.dim()
    num_full = (stop - start) // rows_per_block
    out = []
    if num_full:
        pre = int(np.prod(tensor.shape[:token_axis], dtype=np.int64))
        post = int(np.prod(tensor.shape[token_axis + 1:], dtype=np.int64))
        block_nbytes = pre * rows_per_block * post * tensor.element_size()
        per_group = max(1, GROUP_NBYTES // max(1, block_nbytes))
        for first in range(0, num_full, per_group):
            n = min(per_group, num_full - first)
            rows = tensor.narrow(token_axis, start + first * rows_per_block, n * rows_per_block)
            # [pre, n, G, post] -> [n, pre, G, post]: each block's elements in its own C order
            blocks = rows.reshape(pre, n, rows_per_block, post).permute(1, 0, 2, 3)
            out.append(_sums_of_bytes(blocks.contiguous().reshape(n, -1).view(torch.uint8)))
    tail = start + num_full * rows_per_block
    if tail < stop:
        out.append(block_sums(tensor.narrow(token_axis, tail, stop - tail)).unsqueeze(0))
    if not out:
        return torch.zeros((0, 2), dtype=torch.int64, device=tensor.device)
    return torch.cat(out)


def views_block_sums(views: Mapping[str, View], start: int, stop: int,
                     rows_per_block: int) -> torch.Tensor:
    """Every view's block sums, int64 ``[num_views, num_blocks, 2]`` in the views' order, one
    tensor so that a save takes them off the device in one copy (``host_sums``)."""
    return torch.stack([view_block_sums(v.tensor, v.token_axis, start, stop, rows_per_block)
                        for v in views.values()])


def sections_sums(sections) -> torch.Tensor:
    """Every section's sums, each section whole as one block: int64 ``[num_sections, 2]`` in
    the sections' order. Takes a ``{name: tensor}`` dict or a ``SectionsCopy`` (an anchor)."""
    tensors = getattr(sections, "tensors", sections)
    return torch.stack([block_sums(t) for t in tensors.values()])


def host_sums(sums: torch.Tensor) -> np.ndarray:
    """The sums as numpy uint64, off the device in one copy."""
    return sums.detach().cpu().numpy().view(np.uint64)


# -- the torch path ---------------------------------------------------------------------------


def _sums_of_bytes(data: torch.Tensor) -> torch.Tensor:
    """data: uint8 ``[B, nbytes]`` (each row a block's bytes) -> int64 ``[B, 2]``."""
    num_blocks, nbytes = data.shape
    num_words = -(-nbytes // WORD_NBYTES)
    if num_words > MAX_BLOCK_WORDS:
        raise ValueError(f"a block of {nbytes} bytes is above the sums' {MAX_BLOCK_WORDS} words")
    kernel = _kernels.cuda_op("block_sums_of_bytes") if data.is_cuda else None
    if kernel is not None:  # triton_spill's: uint64 sums that wrap, no limbs needed
        return kernel(data)
    if data.device.type == "cpu":
        return torch.from_numpy(_host_sums_of_bytes(data.detach().contiguous().numpy()))
    return _torch_sums_of_bytes(data)


def _host_sums_of_bytes(data: np.ndarray) -> np.ndarray:
    """``_sums_of_bytes`` on the host, in numpy: uint8 ``[B, nbytes]`` -> int64 ``[B, 2]``.

    The same ``[R, C]`` decomposition as the torch path, but numpy's uint64 arithmetic wraps
    by definition, so no limbs: the row and column sums are exact (below 2**44 and 2**51) and
    the dot products wrap mod 2**64, as the sums do. Two reading passes over the words (the row
    and the column sums), no int64 copy of them: 30-200 times the torch path's rate on small
    blocks, where its dozens of ops a block were the restore's largest cost."""
    num_blocks, nbytes = data.shape
    num_rows = nbytes // (ROW_WORDS * WORD_NBYTES)
    body_nbytes = num_rows * ROW_WORDS * WORD_NBYTES
    body = data[:, :body_nbytes].view("<u4").reshape(num_blocks, num_rows, ROW_WORDS)
    rowsum = body.sum(axis=2, dtype=np.uint64)  # [B, R]
    colsum = body.sum(axis=1, dtype=np.uint64)  # [B, C]
    # the words past the last whole row, zero-padded to a whole word (zeros add nothing)
    rest = data[:, body_nbytes:]
    pad = -rest.shape[1] % WORD_NBYTES
    if pad:
        rest = np.concatenate([rest, np.zeros((num_blocks, pad), dtype=np.uint8)], axis=1)
    tail = np.ascontiguousarray(rest).view("<u4").astype(np.uint64)  # [B, T], T < C
    first = num_rows * ROW_WORDS + 1  # the position of the tail's first word
    r = np.arange(num_rows, dtype=np.uint64)
    c1 = np.arange(1, ROW_WORDS + 1, dtype=np.uint64)
    t1 = np.arange(first, first + tail.shape[1], dtype=np.uint64)
    out = np.empty((num_blocks, 2), dtype=np.uint64)
    out[:, 0] = rowsum.sum(axis=1, dtype=np.uint64) + tail.sum(axis=1, dtype=np.uint64)
    out[:, 1] = (np.uint64(ROW_WORDS) * (rowsum * r).sum(axis=1, dtype=np.uint64)
                 + (colsum * c1).sum(axis=1, dtype=np.uint64)
                 + (tail * t1).sum(axis=1, dtype=np.uint64))
    return out.view(np.int64)


def _torch_sums_of_bytes(data: torch.Tensor) -> torch.Tensor:
    """``_sums_of_bytes`` in torch ops on the data's device (neither CUDA's kernel nor the
    host's numpy): int64 limbs, since torch's int64 overflow is not defined everywhere."""
    num_blocks, nbytes = data.shape
    num_words = -(-nbytes // WORD_NBYTES)
    num_rows = max(1, -(-num_words // ROW_WORDS))
    # Zero words at the end add nothing to either sum, so the padding to [R, C] is free.
    pad = num_rows * ROW_WORDS * WORD_NBYTES - nbytes
    if pad:
        data = torch.nn.functional.pad(data, (0, pad))
    words = data.contiguous().view(torch.int32).reshape(num_blocks, num_rows, ROW_WORDS)
    words = words.to(torch.int64) & _M32  # the unsigned value of each little-endian word
    rowsum = words.sum(dim=2)  # [B, R] < 2**44
    colsum = words.sum(dim=1)  # [B, C] < 2**51
    del words
    plain = rowsum.sum(dim=1)  # < R * 2**44 <= 2**63: exact, and the sum itself
    r = torch.arange(num_rows, dtype=torch.int64, device=data.device)
    c1 = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=data.device)
    by_rows = _carry(_dot_limbs(rowsum, r))
    by_cols = _carry(_dot_limbs(colsum, c1))
    weighted = _carry([ROW_WORDS * a + b for a, b in zip(by_rows, by_cols)])
    return torch.stack([_to_bits(_carry(_limbs(plain))), _to_bits(weighted)], dim=1)


def _limbs(x: torch.Tensor, n: int = 4) -> list[torch.Tensor]:
    return [(x >> (16 * k)) & _M16 for k in range(n)]


def _dot_limbs(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """sum(x * y, dim=-1) mod 2**64 as four (uncarried) 16-bit limbs; x in [0, 2**63) and
    y in [0, 2**32) int64, at most 2**20 terms: each limb product is below 2**32 and each
    limb's sum below 2**54."""
    xs, ys = _limbs(x), _limbs(y, 2)
    out = [torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device) for _ in range(4)]
    for j, xj in enumerate(xs):
        for k, yk in enumerate(ys):
            if j + k < 4:  # a limb at 2**64 or above is 0 mod 2**64
                out[j + k] = out[j + k] + (xj * yk).sum(dim=-1)
    return out


def _carry(limbs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Four limbs (each below 2**62) carried into four 16-bit limbs, mod 2**64."""
    out, carry = [], 0
    for limb in limbs:
        v = limb + carry
        out.append(v & _M16)
        carry = v >> 16
    return out


def _to_bits(limbs: list[torch.Tensor]) -> torch.Tensor:
    """Four 16-bit limbs -> the int64 whose bits are the uint64 they make, with no overflow:
    the high word is made signed before it is scaled by 2**32."""
    lo = limbs[0] | (limbs[1] << 16)
    hi = limbs[2] | (limbs[3] << 16)
    hi = hi - ((hi >> 31) << 32)
    return hi * (1 << 32) + lo
