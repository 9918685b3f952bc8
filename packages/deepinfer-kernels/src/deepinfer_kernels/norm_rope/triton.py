"""Triton backends of RMSNorm and RoPE.

RMSNorm: one pass over [rows, D], whole rows in registers, fp32 math, io in x's dtype.

Rows of small D (q/kv/index heads: 128 .. 1280) are packed BLOCK_R to a program so a program moves ~8 K elements;
D = 5120 (hidden) is one row per program with 8 warps.
RoPE: one pass that copies the leading channels and rotates the trailing pairs (what the reference does in ~12
torch ops: slices, fp32 casts, four products, stack, cast, cat); from cos/sin tables, or from the positions and
frequencies with the angles computed in the kernel (what rope_cos_sin does in ~6 more torch ops per positions
tensor).

PDL (``pdl=True``, docs/pdl.md): both kernels wait for the previous kernel at the top (only the RMSNorm weight, a
constant, is requested before) and let the next kernel launch right after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2
from deepinfer_kernels._pdl import launch_kwargs, use_pdl

__all__ = ["MAX_D", "apply_rope", "apply_rope_at", "rms_norm"]

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
    PDL: tl.constexpr = False,
):
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r < R)[:, None] & (offs_d < D)[None, :]
    if HAS_W:  # a constant: may be read before the wait
        w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    y = x * inv[:, None]
    if HAS_W:
        y = y * w[None, :]
    tl.store(y_ptr + offs_r[:, None] * stride_y + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, pdl: bool = False) -> Tensor:
    """x [..., D] bf16|fp16|fp32 (D <= MAX_D); weight [D] or None -> x's shape and dtype. pdl: launch as a
    programmatic dependent launch where `deepinfer_kernels._pdl.use_pdl` allows."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return y.reshape(x.shape)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer when HAS_W is False
    on = use_pdl(pdl, x.device, interpreted=check_launchable("rms_norm", _rms_norm_kernel, x2, w))
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
        PDL=on,
        num_warps=num_warps,
        **launch_kwargs(on),
    )
    return y.reshape(x.shape)


@triton.jit(do_not_specialize=["R", "M"])
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    w_ptr,
    R,
    M,
    D,
    stride_x,
    stride_y,
    stride_c,
    eps,
    P: tl.constexpr,
    INVERSE: tl.constexpr,
    FROM_POS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # x and the positions / tables may be the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    # FROM_POS: cos_ptr holds the token positions [T] (int) and sin_ptr the frequencies [P] fp32; the angles are
    # computed here as rope_cos_sin does (fp32(position) * freq, one fp32 product, then cos / sin)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    tok = rows // M  # cos/sin row of each x row (the middle dims share their token's angles)
    # channels before the rope dims: copied unchanged
    offs_d = tl.arange(0, BLOCK_D)
    keep = row_ok[:, None] & (offs_d < D - 2 * P)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs_d[None, :], mask=keep, other=0.0)
    # interleaved pairs (2j, 2j+1) of the last 2P channels, fp32 math in the reference's operation order
    offs_p = tl.arange(0, BLOCK_P)
    pm = row_ok[:, None] & (offs_p < P)[None, :]
    ia = D - 2 * P + 2 * offs_p
    a = tl.load(x_ptr + rows[:, None] * stride_x + ia[None, :], mask=pm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + rows[:, None] * stride_x + ia[None, :] + 1, mask=pm, other=0.0).to(tl.float32)
    ty = y_ptr.dtype.element_ty
    if NORM:  # RMSNorm of the whole row first (rms_norm's math), rounded to the output dtype as rms_norm returns it
        xf = x.to(tl.float32)
        ss = tl.sum(xf * xf, 1) + tl.sum(a * a, 1) + tl.sum(b * b, 1)
        inv = 1.0 / tl.sqrt(ss / D + eps)
        xf = xf * inv[:, None]
        a = a * inv[:, None]
        b = b * inv[:, None]
        if HAS_W:
            xf = xf * tl.load(w_ptr + offs_d, mask=offs_d < D - 2 * P, other=0.0).to(tl.float32)[None, :]
            a = a * tl.load(w_ptr + ia, mask=offs_p < P, other=0.0).to(tl.float32)[None, :]
            b = b * tl.load(w_ptr + ia + 1, mask=offs_p < P, other=0.0).to(tl.float32)[None, :]
        x = xf.to(ty)
        a = a.to(ty).to(tl.float32)
        b = b.to(ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + offs_d[None, :], x, mask=keep)
    if FROM_POS:
        pos = tl.load(cos_ptr + tok, mask=row_ok, other=0).to(tl.float32)
        f = tl.load(sin_ptr + offs_p, mask=offs_p < P, other=0.0)
        ang = pos[:, None] * f[None, :]
        c = tl.cos(ang)
        s = tl.sin(ang)
    else:
        c = tl.load(cos_ptr + tok[:, None] * stride_c + offs_p[None, :], mask=pm, other=0.0)
        s = tl.load(sin_ptr + tok[:, None] * stride_c + offs_p[None, :], mask=pm, other=0.0)
    if INVERSE:
        s = -s
    ra = a * c - b * s
    rb = a * s + b * c
    tl.store(y_ptr + rows[:, None] * stride_y + ia[None, :], ra.to(ty), mask=pm)
    tl.store(y_ptr + rows[:, None] * stride_y + ia[None, :] + 1, rb.to(ty), mask=pm)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False, pdl: bool = False) -> Tensor:
    """x [T, ..., D] bf16|fp16|fp32, cos/sin [T, P] fp32 -> x's shape and dtype, the last 2P channels rotated
    in interleaved pairs. Asks for no fp contraction (enable_fp_fusion=False), so each product and sum rounds
    like the reference's separate torch ops (tested to 1 ULP of the output dtype). pdl: as `rms_norm`."""
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return _launch_rope(x, cos, sin, cos.shape[1], inverse, from_pos=False, pdl=pdl)


def apply_rope_at(
    x: Tensor, positions: Tensor, freqs: Tensor, *, inverse: bool = False,
    norm: tuple[Tensor | None, float] | None = None, pdl: bool = False,
) -> Tensor:  # fmt: skip
    """`apply_rope` at positions [T] int with freqs [P] fp32: the angles and their cos / sin are computed in the
    kernel (no cos/sin tensors, no extra launch per positions tensor). norm (weight [D] | None, eps): each row
    [D] (the last dim; D <= MAX_D) is RMS-normalized first, as rms_norm, in the same pass. pdl: as `rms_norm`."""
    return _launch_rope(x, positions.contiguous(), freqs.float().contiguous(), freqs.shape[0], inverse,
                        from_pos=True, norm=norm, pdl=pdl)


def _launch_rope(
    x: Tensor, cos: Tensor, sin: Tensor, p: int, inverse: bool, *, from_pos: bool,
    norm: tuple[Tensor | None, float] | None = None, pdl: bool = False,
) -> Tensor:  # fmt: skip
    d, t = x.shape[-1], x.shape[0]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return y.reshape(x.shape)
    weight = None if norm is None else norm[0]
    w = weight.contiguous() if weight is not None else x2  # dummy pointer without a weight
    on = use_pdl(pdl, x.device, interpreted=check_launchable("apply_rope", _rope_kernel, x2, cos, sin, w))
    block_d = next_pow2(max(1, d - 2 * p))
    block_r = max(1, min(next_pow2(rows), 4096 // max(block_d, 2 * next_pow2(p))))
    _rope_kernel[(cdiv(rows, block_r),)](
        x2, cos, sin, y, w, rows, rows // t, d, x2.stride(0), y.stride(0), 0 if from_pos else cos.stride(0),
        0.0 if norm is None else float(norm[1]), P=p, INVERSE=bool(inverse), FROM_POS=from_pos,
        NORM=norm is not None, HAS_W=weight is not None, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_P=next_pow2(p),
        PDL=on, num_warps=4, enable_fp_fusion=False, **launch_kwargs(on),
    )  # fmt: skip
    return y.reshape(x.shape)
