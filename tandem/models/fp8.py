"""Native FP8 linear layers (issue 20, part 4): where the device multiplies FP8
(tandem.devices.has_fp8_matmul: capability 8.9 and up), an FP8 block-scaled checkpoint's
matrices stay FP8 on the device, one byte a weight, and every product with them is a scaled
FP8 matmul (torch._scaled_mm / F.scaled_mm) with their block scales, instead of a bf16 product
with the weights dequantised at load (quant.py, which every other device keeps).

``Fp8Weight`` is the weight: a tensor of the FP8 values (its shape is the matrix's) carrying its
``scale_inv`` grid, so the model's code stays as it is: ``F.linear(x, w)`` and decode's
``torch.mm(x, w.t())`` reach ``fp8_linear`` through ``__torch_function__``, and ``w.to(dtype)``
keeps it FP8. Any other op on it sees the raw FP8 values, as a plain tensor.

The product (``activation_scheme: dynamic``, as the checkpoint's authors run it, DeepSeek-V3's
recipe): the activations are quantized at run time to FP8 a row and a group of ``block_cols``
columns at a time (scale = amax / 448), and

    out[m, n] = sum over column blocks kb of  (xq[m, kb] . wq[n, kb]) * sx[m, kb] * sw[n // br, kb]

One ``F.scaled_mm`` with BlockWise1x128 x BlockWise128x128 scales does it where torch has the
kernel (Hopper, blocks of 128 x 128); elsewhere (a CPU, Ada, other block sizes) one row-wise
scaled matmul a column block, summed in fp32: the same sum, in a blocked order. Which one a
device takes is chosen at its first product and kept (``_METHODS``). The activations' FP8
rounding is the error against the dequantised weights' product: about 1e-2 relative.
"""

from __future__ import annotations

import math

import structlog
import torch
import torch.nn.functional as F

from tandem.models.base import ModelError

log = structlog.get_logger("tandem.fp8")

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_METHODS: dict[tuple, str] = {}  # (device, block) -> "blockwise" | "rowwise"


class Fp8Weight(torch.Tensor):
    """An FP8 matrix ``[N, K]`` (or its transpose, ``transposed``) and its block scales."""

    scale_inv: torch.Tensor
    block: tuple[int, int]
    transposed: bool
    row_scales: torch.Tensor | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                transposed: bool = False, row_scales: torch.Tensor | None = None):
        if data.dtype != FP8 or data.dim() != 2:
            raise ModelError(f"an FP8 weight is a 2-d {FP8} matrix, not {data.dim()}-d "
                             f"{data.dtype}")
        out = torch.Tensor._make_subclass(cls, data)
        out.scale_inv, out.block, out.transposed = scale_inv, tuple(block), transposed
        out.row_scales = row_scales if row_scales is not None else _row_scales(
            data if not transposed else data.t(), scale_inv, block)
        return out

    def raw(self) -> torch.Tensor:
        """The FP8 values as a plain tensor ``[N, K]``."""
        with torch._C.DisableTorchFunctionSubclass():
            t = torch.Tensor.as_subclass(self, torch.Tensor)
            return t.t() if self.transposed else t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return fp8_linear(x, w, bias)
        if func in (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul) \
                and isinstance(args[1], Fp8Weight) and args[1].transposed \
                and not isinstance(args[0], Fp8Weight):
            got = fp8_linear(args[0], args[1].t())
            out = kwargs.get("out")
            return got if out is None else out.copy_(got)
        if func is torch.Tensor.t:
            w = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                data = torch.Tensor.as_subclass(w, torch.Tensor).t()
            return Fp8Weight(data, w.scale_inv, w.block, not w.transposed, w.row_scales)
        if func is torch.Tensor.contiguous:
            return args[0]
        if func is torch.Tensor.to:
            return args[0]._moved(*args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _moved(self, *args, **kwargs) -> "Fp8Weight":
        """``to``: a device moves the values and the scales; a dtype is ignored (the weight
        stays FP8: the products take it as it is)."""
        device = kwargs.get("device")
        for a in args:
            if isinstance(a, (torch.device, str)):
                device = a
        if device is None or torch.device(device) == self.device:
            return self
        return Fp8Weight(self.raw().to(device), self.scale_inv.to(device), self.block,
                         row_scales=self.row_scales.to(device)).t_if(self.transposed)

    def t_if(self, transposed: bool) -> "Fp8Weight":
        return self.t() if transposed else self


def _row_scales(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                ) -> torch.Tensor:
    """The weight's scale for each output row and column block, ``[K blocks, 1, N]`` fp32:
    the row-wise product's ``scale_b``, one a column block."""
    rows = data.shape[0]
    grid = (math.ceil(rows / block[0]), math.ceil(data.shape[1] / block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ModelError(f"an FP8 weight of shape {tuple(data.shape)} has a scale grid "
                         f"{tuple(scale_inv.shape)}; blocks of {block[0]}x{block[1]} need {grid}")
    per_row = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows]  # [N, K blocks]
    return per_row.t().contiguous().unsqueeze(1)


def quantize_rows(x: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as FP8 a row and a group of ``cols`` columns at a time: (values [M, K],
    scales [M, K groups] fp32), x ~ values * scale over each group (amax / FP8_MAX)."""
    m, k = x.shape
    groups = math.ceil(k / cols)
    xf = x.float()
    pad = groups * cols - k
    padded = F.pad(xf, (0, pad)) if pad else xf
    amax = padded.view(m, groups, cols).abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded.view(m, groups, cols) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(m, -1)[:, :k].to(FP8), scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantised w, bias)`` as scaled FP8 matmuls, in x's dtype."""
    if w.transposed:
        raise ValueError("fp8_linear takes the weight [N, K], not its transpose")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    br, bc = w.block
    xq, sx = quantize_rows(x2, bc)
    key = (w.device, w.block)
    method = _METHODS.get(key)
    if method is None:
        method = _METHODS[key] = _choose(xq, sx, w)
    out = _blockwise(xq, sx, w) if method == "blockwise" else _rowwise(xq, sx, w)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, out.shape[-1])


def _rowwise(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """One row-wise scaled matmul a column block, summed in fp32."""
    wq = w.raw()
    bc = w.block[1]
    out = None
    for kb in range(sx.shape[1]):
        a, b = kb * bc, min((kb + 1) * bc, wq.shape[1])
        part = torch._scaled_mm(xq[:, a:b].contiguous(), wq[:, a:b].t(),
                                scale_a=sx[:, kb:kb + 1].contiguous(),
                                scale_b=w.row_scales[kb], out_dtype=torch.float32)
        out = part if out is None else out.add_(part)
    return out


def _blockwise(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """One matmul with DeepSeek's block scales (torch's Hopper kernel: blocks of 128 x 128)."""
    S = F.ScalingType
    return F.scaled_mm(xq, w.raw().t(), sx, S.BlockWise1x128, w.scale_inv.float(),
                       S.BlockWise128x128, output_dtype=torch.float32)


def _choose(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight) -> str:
    """The blockwise kernel where it runs and agrees with the row-wise sum (close: the two
    sum the blocks in different orders), else the row-wise sum."""
    method, why = "rowwise", "not tried"
    if w.device.type == "cuda" and w.block == (128, 128):
        try:
            got = _blockwise(xq, sx, w)
            want = _rowwise(xq, sx, w)
            if torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                method = "blockwise"
            else:
                why = "disagrees with the row-wise sum"
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            # AttributeError, TypeError: a torch without F.scaled_mm, or with another signature
            why = f"{type(exc).__name__}: {str(exc)[:120]}"
    log.info("fp8_matmul", device=str(w.device), block=list(w.block), method=method,
             **({} if method == "blockwise" else {"blockwise": why}))
    return method


def dequantized(w: Fp8Weight) -> torch.Tensor:
    """The weight as the load would have dequantised it, fp32 ``[N, K]`` (the reference)."""
    wq = w.raw().float()
    rows, cols = wq.shape
    br, bc = w.block
    scale = w.scale_inv.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return wq * scale[:rows, :cols]
