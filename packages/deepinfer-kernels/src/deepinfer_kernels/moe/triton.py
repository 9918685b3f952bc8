"""Triton backend of the routed experts over FP4 e2m1 weights (W4A16 decode path), with no host read.

Steps (all on the device):
1. permutation: the T*k (token, slot) pairs are sorted by expert (stable), and each expert's run is padded to a
   multiple of BLOCK_M rows; ``block_expert[b]`` names the expert of row block b (-1: unused block). The number
   of blocks is bounded by ``ceil(P / BLOCK_M) + min(E, P)`` (P = T*k), so grids never depend on expert counts.
2. gate/up grouped GEMM: per (row block, I tile) the w1 and w3 tiles are decoded from packed e2m1 + UE8M0 in
   registers, two fp32 accumulators, then the clamped SwiGLU ``silu(min(g, L)) * clamp(u, -L, L)`` is applied in
   the epilogue and h is stored once (x's dtype).
3. down grouped GEMM over h with w2 decoded the same way; the epilogue multiplies by the pair's routing weight
   and stores fp32 rows per pair; the k rows of a token are summed by one torch reduction (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable

__all__ = ["align_pairs", "moe_experts_fp4"]

_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)


@triton.jit
def _fp4_tile(w_ptrs, s_ptrs, mask, s_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed [BLOCK_N, BLOCK_K/2] uint8 + scales [BLOCK_N, BLOCK_K/32] e8m0 -> [BLOCK_N, BLOCK_K] fp32 values."""
    p = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    c = tl.join(lo, hi)  # [BLOCK_N, BLOCK_K/2, 2]: low nibble = even column
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pw = ((e + 126) << 23).to(tl.float32, bitcast=True)  # 2^(e-1)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pw)
    v = tl.where((c & 8) != 0, -v, v)
    v = tl.reshape(v, [BLOCK_N, BLOCK_K])
    b = tl.load(s_ptrs, mask=s_mask, other=127).to(tl.int32)
    s = tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))
    return tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_K // 32, 32]) * s[:, :, None], [BLOCK_N, BLOCK_K])


@triton.jit
def _dot(a, w, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    pairs_ptr,
    bexp_ptr,
    h_ptr,
    P,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_h,
    limit,
    TOPK: tl.constexpr,
    CLAMP: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= 0:
        rows = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_mask = rows < P
        tok = tl.where(r_mask, rows // TOPK, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_off = e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_off = e.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + tok[:, None] * stride_x + offs_k[None, :],
                mask=r_mask[:, None] & (offs_k[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            wm = n_mask[:, None] & (kb[None, :] * 2 < K)
            sm = n_mask[:, None] & (ks[None, :] * 32 < K)
            w1 = _fp4_tile(
                w1_ptr + w_off + kb[None, :], s1_ptr + s_off + ks[None, :], wm, sm, BLOCK_N, BLOCK_K
            )
            g += _dot(a, w1, DOT_F32)
            w3 = _fp4_tile(
                w3_ptr + w_off + kb[None, :], s3_ptr + s_off + ks[None, :], wm, sm, BLOCK_N, BLOCK_K
            )
            u += _dot(a, w3, DOT_F32)
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        hp = (
            h_ptr
            + (pid_b * BLOCK_M + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * stride_h
            + offs_n[None, :]
        )
        tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    pairs_ptr,
    bexp_ptr,
    rw_ptr,
    out_ptr,
    P,
    N,
    K,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_o,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= 0:
        rows = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_mask = rows < P
        hrow = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_off = e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_off = e.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                h_ptr + hrow[:, None] * stride_h + offs_k[None, :],
                mask=r_mask[:, None] & (offs_k[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            w2 = _fp4_tile(
                w2_ptr + w_off + kb[None, :],
                s2_ptr + s_off + ks[None, :],
                n_mask[:, None] & (kb[None, :] * 2 < K),
                n_mask[:, None] & (ks[None, :] * 32 < K),
                BLOCK_N,
                BLOCK_K,
            )
            acc += _dot(a, w2, DOT_F32)
        wt = tl.load(rw_ptr + rows, mask=r_mask, other=0.0)
        op = out_ptr + tl.where(r_mask, rows, 0)[:, None].to(tl.int64) * stride_o + offs_n[None, :]
        tl.store(op, acc * wt[:, None], mask=r_mask[:, None] & n_mask[None, :])


def align_pairs(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """ids [T, k] -> (pairs [B * block_m] int32: pair id t*k+j per padded row, P for padding;
    block_expert [B] int32: expert of each row block, -1 unused), B = ceil(P/block_m) + min(E, P). Device ops
    only (no host read: torch.bincount would read the max back, so counts come from scatter_add)."""
    flat = ids.reshape(-1)
    p = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    cstart = torch.cumsum(counts, 0) - counts
    se = flat[order]
    pos = pstart[se] + torch.arange(p, device=dev) - cstart[se]
    nblocks = cdiv(p, block_m) + min(num_experts, p)
    pairs = torch.full((nblocks * block_m,), p, dtype=torch.int32, device=dev)
    pairs[pos] = order.to(torch.int32)
    starts = torch.arange(nblocks, device=dev) * block_m
    be = torch.searchsorted(pend, starts, right=True)
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    return pairs, block_expert


def moe_experts_fp4(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    s1: Tensor,
    s3: Tensor,
    s2: Tensor,
    limit: float,
) -> Tensor:
    """x [T, d]; weights [T, k] fp32; ids [T, k] int64; w1 / w3 [E, I, d/2] int8, w2 [E, d, I/2] int8; scales
    [E, I, d/32] / [E, d, I/32] e8m0 -> [T, d] float32 (Σ_k weight * expert(x)). Validated by the dispatcher."""
    t, d = x.shape
    k = ids.shape[1]
    e_count, inter = w1.shape[0], w1.shape[1]
    out = torch.zeros((t, d), dtype=torch.float32, device=x.device)
    p = t * k
    if p == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    interp = check_launchable("moe_experts", _gate_up_kernel, x, w1, w3, w2)
    block_m = 16
    block_n, block_k = (16, 32) if interp else (64, 128)
    pairs, bexp = align_pairs(ids, e_count, block_m)
    nb = bexp.shape[0]
    h = torch.empty((nb * block_m, inter), dtype=x.dtype, device=x.device)
    u8 = [t_.view(torch.uint8) for t_ in (w1, w3, w2, s1, s3, s2)]
    dot_f32 = interp or x.dtype == torch.float32
    _gate_up_kernel[(nb, cdiv(inter, block_n))](
        x, u8[0], u8[1], u8[3], u8[4], pairs, bexp, h,
        p, inter, d, x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        float(limit),
        TOPK=k, CLAMP=limit > 0, DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=1 if interp else 3,
    )  # fmt: skip
    rows = torch.empty((p, d), dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    _down_kernel[(nb, cdiv(d, block_n))](
        h, u8[2], u8[5], pairs, bexp, rw, rows,
        p, d, inter, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), rows.stride(0),
        DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=1 if interp else 3,
    )  # fmt: skip
    return torch.sum(rows.view(t, k, d), dim=1, out=out)
