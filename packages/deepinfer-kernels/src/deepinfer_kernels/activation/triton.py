"""Triton clamped SwiGLU: one elementwise pass (the reference is ~7 torch ops: two fp32 casts, two clamps, silu,
product, cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable

__all__ = ["swiglu"]

_BLOCK = 1024


@triton.jit(do_not_specialize=["n", "cols", "stride_g", "stride_u"])
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, cols, stride_g, stride_u, limit, CLAMP: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if ROWS:  # row-strided [R, cols] inputs (the two column halves of one fused GEMM output); y is contiguous
        row = offs // cols
        col = offs - row * cols
        g_offs, u_offs = row * stride_g + col, row * stride_u + col
    else:
        g_offs, u_offs = offs, offs
    g = tl.load(g_ptr + g_offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_offs, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows(t: Tensor) -> Tensor:
    """t [..., I] as [R, I] with unit column stride: a view when the rows are evenly strided, else a copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def swiglu(g: Tensor, u: Tensor, limit: float, out_dtype: torch.dtype) -> Tensor:
    """g, u [..., I] (same shape; rows may be strided, e.g. column slices of one [T, 2I] GEMM output, read in place)
    -> [..., I] out_dtype, contiguous (reference.swiglu)."""
    y = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    n = g.numel()
    if n == 0:
        return y
    g2, u2 = _rows(g), _rows(u)
    flat = g2.is_contiguous() and u2.is_contiguous()
    check_launchable("swiglu", _swiglu_kernel, g2, u2)
    _swiglu_kernel[(cdiv(n, _BLOCK),)](g2, u2, y, n, g2.shape[1], g2.stride(0), u2.stride(0), float(limit),
                                       CLAMP=limit > 0, ROWS=not flat, BLOCK=_BLOCK, num_warps=4)
    return y
