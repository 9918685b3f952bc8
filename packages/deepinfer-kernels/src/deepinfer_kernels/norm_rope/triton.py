"""Triton backend of RMSNorm: one pass over [rows, D], whole rows in registers, fp32 math, io in x's dtype.

Rows of small D (q/kv/index heads: 128 .. 1280) are packed BLOCK_R to a program so a program moves ~8 K elements;
D = 5120 (hidden) is one row per program with 8 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2

__all__ = ["MAX_D", "rms_norm"]

MAX_D = 16384  # a whole row lives in registers; longer rows stay on the reference


@triton.jit(do_not_specialize=["R"])  # one compile for every row count
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    R,
    D,
    stride_x,
    stride_y,
    eps,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r < R)[:, None] & (offs_d < D)[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * inv[:, None]
    if HAS_W:
        w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + offs_r[:, None] * stride_y + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., D] bf16|fp16|fp32 (D <= MAX_D); weight [D] or None -> x's shape and dtype."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return y.reshape(x.shape)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer when HAS_W is False
    check_launchable("rms_norm", _rms_norm_kernel, x2, w)
    block_d = next_pow2(d)
    block_r = max(1, min(next_pow2(rows), 8192 // block_d))
    num_warps = 8 if block_r * block_d >= 8192 else 4 if block_r * block_d >= 2048 else 2
    _rms_norm_kernel[(cdiv(rows, block_r),)](
        x2,
        w,
        y,
        rows,
        d,
        x2.stride(0),
        y.stride(0),
        float(eps),
        HAS_W=weight is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return y.reshape(x.shape)
