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


@triton.jit(do_not_specialize=["n"])
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def swiglu(g: Tensor, u: Tensor, limit: float, out_dtype: torch.dtype) -> Tensor:
    """g, u [..., I] (same shape) -> [..., I] out_dtype (reference.swiglu)."""
    g2, u2 = g.contiguous(), u.contiguous()
    y = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    n = g2.numel()
    if n == 0:
        return y
    check_launchable("swiglu", _swiglu_kernel, g2, u2)
    _swiglu_kernel[(cdiv(n, _BLOCK),)](g2, u2, y, n, float(limit), CLAMP=limit > 0, BLOCK=_BLOCK, num_warps=4)
    return y
