"""Triton backend of `linear`: one tiled GEMM kernel for decode and prefill sizes whose weight tiles are decoded
in registers (FP8 e4m3 x per-block UE8M0 / fp32 scale, or a plain bf16 / fp16 weight for the LM head), with the
optional FP8 activation quantization applied to each activation tile as it is loaded.

Why one kernel: at decode sizes (M <= 256) the step is bound by reading the weight once; the kernel streams each
weight byte once per M tile, multiplies with tensor-core dots in bf16 (values e4m3 x 2^k are exact in bf16; fp32
accumulation) and splits K over programs when N alone cannot fill the GPU (the partial sums are added by a
deterministic torch sum, never atomics, so results do not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, target_programs

__all__ = ["fp8_linear", "linear_f32_out"]

# dot operand precision: bf16 tensor cores, or exact fp32 (fp32 activations, and always under the interpreter,
# whose bf16 dot is wrong)
_DOT_BF16, _DOT_F16, _DOT_F32 = 0, 1, 2
# 2^-127: UE8M0 byte 0 (a float32 subnormal; no real checkpoint scale uses it)
_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)


@triton.jit
def _e8m0_decode(b):
    b = b.to(tl.int32)
    return tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def _round_e4m3(y):
    """fp32 values in [-448, 448] -> nearest e4m3 value (ties to even, subnormals kept), as fp32.

    Arithmetic instead of a float8 cast: the interpreter's cast rounds ties away and flushes subnormals."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6) - 3  # exponent of one e4m3 step at |y| (3 mantissa bits; subnormal step 2^-9)
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    r = a / ulp  # exact: ulp is a power of two, r < 16
    n = r.to(tl.int32)
    frac = r - n.to(tl.float32)
    n = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    return tl.where(y < 0, -1.0, 1.0) * n.to(tl.float32) * ulp


@triton.jit
def _act_fake_quant(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_M, BLOCK_K] fp32 -> e4m3 per 1 x GROUP with s = 2^ceil(log2(fp32(max(amax,1e-4) * (1/448)))), back
    to fp32 values (bit-exact with deepinfer_kernels.quant.act_quant_fp8)."""
    a3 = tl.reshape(a, [BLOCK_M, BLOCK_K // GROUP, GROUP])
    amax = tl.maximum(tl.max(tl.abs(a3), axis=2), 1e-4)
    xs = amax * (1.0 / 448.0)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    q = _round_e4m3(tl.clamp(a3 / s[:, :, None], -448.0, 448.0))
    return tl.reshape(q * s[:, :, None], [BLOCK_M, BLOCK_K])


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_split,
    k_blocks_per_split,
    B0: tl.constexpr,
    B1: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    ACT_QUANT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k0 = pid_s * k_blocks_per_split * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, k_blocks_per_split):
        offs_k = k0 + kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if ACT_QUANT:
            a = _act_fake_quant(a, BLOCK_M, BLOCK_K, B1)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if W_FP8:
            g = (k0 + kb * BLOCK_K) // B1 + tl.arange(0, BLOCK_K // B1)
            sc = tl.load(
                s_ptr + (offs_n // B0)[:, None] * stride_sn + g[None, :],
                mask=n_mask[:, None] & (g[None, :] * B1 < K),
                other=0,
            )
            if SCALE_E8M0:
                sc = _e8m0_decode(sc)
            w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // B1, B1]) * sc[:, :, None], [BLOCK_N, BLOCK_K])
        if DOT == 2:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        elif DOT == 1:
            acc += tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)))
        else:
            acc += tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    y_ptrs = y_ptr + pid_s * stride_split + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _dot_kind(x: Tensor, w_dtype: torch.dtype, interp: bool) -> int:
    if interp or x.dtype == torch.float32 or w_dtype == torch.float32:
        return _DOT_F32
    return _DOT_F16 if x.dtype == torch.float16 or w_dtype == torch.float16 else _DOT_BF16


def _launch(
    x: Tensor,
    w: Tensor,
    s: Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int],
    act_quant: bool,
    op: str,
) -> Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    interp = check_launchable(op, _linear_kernel, x, w)
    b0, b1 = block
    block_k = max(128, b1) if s is not None else 128
    if interp:
        block_m, block_n, block_k = 16, 16, max(32, b1) if s is not None else 32
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
    grid_n, grid_m = cdiv(n, block_n), cdiv(m, block_m)
    k_blocks = cdiv(k, block_k)
    split = 1
    if not interp:
        want = target_programs(x.device) // max(1, grid_n * grid_m)
        split = max(1, min(want, k_blocks // 4, 16))
    per = cdiv(k_blocks, split)
    split = cdiv(k_blocks, per)
    dst = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    if s is not None and s.dtype == torch.float8_e8m0fnu:
        s_arg, e8m0 = s.view(torch.uint8), True
    else:
        s_arg, e8m0 = (s if s is not None else w), False
    _linear_kernel[(grid_n, grid_m, split)](
        x,
        w,
        s_arg,
        dst,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        s_arg.stride(0) if s is not None else 0,
        n,
        m * n,
        per,
        B0=b0,
        B1=b1,
        W_FP8=s is not None,
        SCALE_E8M0=e8m0,
        ACT_QUANT=act_quant,
        DOT=_dot_kind(x, w.dtype if s is None else x.dtype, interp),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=1 if interp else 4,
    )
    if split > 1:
        torch.sum(dst, dim=0, out=y) if out_dtype == torch.float32 else y.copy_(dst.sum(0))
    return y


def fp8_linear(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], *, act_quant: bool
) -> Tensor:
    """x [M, K] (bf16 / fp16 / fp32), weight [N, K] e4m3, scale [ceil(N/b0), ceil(K/b1)] e8m0 | f32 -> [M, N]
    x's dtype. Validated by the package dispatcher."""
    return _launch(x, weight, scale, x.dtype, block=block, act_quant=act_quant, op="fp8_linear")


def linear_f32_out(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K], weight [N, K] bf16 / fp16 -> [M, N] float32 (fp32 accumulation, W read in its own dtype)."""
    return _launch(x, weight, None, torch.float32, block=(1, 1), act_quant=False, op="linear_f32_out")
