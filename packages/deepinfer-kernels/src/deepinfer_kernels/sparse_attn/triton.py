"""Triton backend of sparse MQA attention with attn_sink (decode and prefill share one kernel).

One program = one token x a block of heads x one split of that token's index list (the head blocks of a token
are adjacent in launch order, so its gathered kv rows come from HBM about once). The kv rows named by the
indices are gathered tile by tile ([BLOCK_N, D], K = V = the row), scores and the online softmax run in fp32 in the
log2 domain, and the sink enters as the initial running max / denominator of split 0 (so an all-invalid row gives
exactly 0, as the reference). When one token cannot fill the GPU (decode), the index list is split over programs
(flash-decoding) and a second kernel merges the partial (max, denominator, accumulator) triples.
Precision: QK^T and P@V use bf16/fp16 tensor-core dots with fp32 accumulation (P is rounded to the input dtype
for the second dot, as in FlashAttention); fp32 inputs use exact fp32 dots. In the CPU interpreter bf16 dots are
wrong (triton#11584), so there every dot runs on fp32 upcasts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2, target_programs

__all__ = ["DEFAULT_CONFIG", "sparse_attn"]

_LOG2E = 1.4426950408889634
# Defaults picked for H=64, D=512 on sm_90 without a tuning run yet: a [16, 512] fp32 accumulator is 64
# registers per thread at 4 warps; a [32, 512] bf16 kv tile is 32 KiB of shared memory per stage.
DEFAULT_CONFIG: dict[str, int] = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
# Two sources (window + paged compressed entries) hold a second set of row pointers: at 4 warps the sm_90a build
# spills (255 registers, 440 B of stack, ahead-of-time report); 8 warps compile without spills.
TWO_SOURCE_NUM_WARPS = 8


# Per-call sizes are not specialised (one compile serves every batch / index count / pool size).
@triton.jit(do_not_specialize=["K", "S_ROWS", "blocks_per_split", "stride_it", "K1", "S_ROWS2", "stride_it2"])
def _sparse_attn_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    kv2_ptr,
    idx2_ptr,
    sink_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    H,
    D,
    K,
    S_ROWS,
    blocks_per_split,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_it,
    stride_ot,
    stride_oh,
    K1,
    S_ROWS2,
    stride_kv2,
    stride_it2,
    qk_scale,
    TWO: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_F32: tl.constexpr,
):
    # Axis 0 enumerates (token, head block) with the head blocks of one token adjacent, so the programs that
    # gather the same kv rows run together and all but the first read them from L2. Splits are axis 1 (<= 32).
    pid = tl.program_id(0)
    hb = pid % HEAD_BLOCKS
    t = (pid // HEAD_BLOCKS).to(tl.int64)
    s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    d_mask = offs_d < D

    q = tl.load(
        q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # The sink logit is one extra softmax column with no value row: start split 0 from it.
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    first = s == 0
    # Other splits start from a finite -1e30 (not -inf) so exp2(m_old - m_new) never evaluates inf - inf.
    m_i = tl.where(first, sink, -1.0e30)
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    n_lo = s * blocks_per_split * BLOCK_N
    n_hi = tl.minimum(n_lo + blocks_per_split * BLOCK_N, K)
    for start in range(n_lo, n_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if TWO:
            # columns [0, K1) index kv, columns [K1, K) index kv2; each row is loaded from exactly one source
            # (the other load is fully masked to 0, so the sum is that row, exactly)
            in_a = offs_n < K1
            ia = tl.load(idx_ptr + t * stride_it + offs_n, mask=(offs_n < n_hi) & in_a, other=-1)
            ib = tl.load(idx2_ptr + t * stride_it2 + (offs_n - K1), mask=(offs_n < n_hi) & ~in_a, other=-1)
            va = (ia >= 0) & (ia < S_ROWS)
            vb = (ib >= 0) & (ib < S_ROWS2)
            ka = tl.load(
                kv_ptr + tl.where(va, ia, 0)[:, None] * stride_kv + offs_d[None, :],
                mask=va[:, None] & d_mask[None, :],
                other=0.0,
            )
            kb = tl.load(
                kv2_ptr + tl.where(vb, ib, 0)[:, None] * stride_kv2 + offs_d[None, :],
                mask=vb[:, None] & d_mask[None, :],
                other=0.0,
            )
            kt = ka + kb
            valid = va | vb
        else:
            idx = tl.load(idx_ptr + t * stride_it + offs_n, mask=offs_n < n_hi, other=-1)
            # Out-of-range rows are treated as invalid so a bad index can never read outside kv.
            valid = (idx >= 0) & (idx < S_ROWS)
            rows = tl.where(valid, idx, 0)
            kt = tl.load(
                kv_ptr + rows[:, None] * stride_kv + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :],
                other=0.0,
            )
        if UPCAST:
            kt = kt.to(tl.float32)
        if EXACT_F32:
            qk = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(kt))
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT_F32:
            pv = tl.dot(p.to(kt.dtype), kt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kt.dtype), kt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        row = (t * num_splits + s) * H + offs_h  # workspace [T, splits, H(, D)]
        tl.store(m_ptr + row, m_i, mask=h_mask)
        tl.store(l_ptr + row, l_i, mask=h_mask)
        tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
    else:
        o = acc / l_i[:, None]  # l_i >= 1: the sink term is always in the denominator
        tl.store(
            out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _sparse_attn_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    H,
    D,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    row = (t * num_splits + offs_s) * H + h
    m = tl.load(m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always starts from the sink
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l, 0)
    acc = tl.load(
        acc_ptr + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Tensor,
    softmax_scale: float,
    *,
    kv2: Tensor | None = None,
    indices2: Tensor | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """q [T, H, D] bf16|fp16|fp32; kv [S, D] same dtype; indices [T, K] int (-1 / out of range = none);
    attn_sink [H] -> [T, H, D] in q's dtype; kv2 [S2, D] / indices2 [T, K2]: an optional second source whose
    index lists extend each token's list (one softmax over both). Inputs are validated by the package
    dispatcher; the keyword arguments override the launch configuration (benchmark sweeps, tests of the split
    path)."""
    t, h, d = q.shape
    two = kv2 is not None
    k1 = indices.shape[1]
    k = k1 + (indices2.shape[1] if two else 0)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block_h = block_h or DEFAULT_CONFIG["block_h"]
    block_n = block_n or DEFAULT_CONFIG["block_n"]
    num_warps = num_warps or (TWO_SOURCE_NUM_WARPS if two else DEFAULT_CONFIG["num_warps"])
    num_stages = num_stages or DEFAULT_CONFIG["num_stages"]
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    if two:
        kv2 = kv2 if kv2.stride(1) == 1 else kv2.contiguous()
        indices2 = indices2 if indices2.stride(1) == 1 else indices2.contiguous()
    else:  # unused pointers (the TWO=False specialisation never touches them)
        kv2, indices2 = kv, indices
    sink = attn_sink.float().contiguous()
    interp = check_launchable("sparse_attn", _sparse_attn_kernel, q, kv, indices, kv2, indices2, sink)
    block_d = max(16, next_pow2(d))
    head_blocks = cdiv(h, block_h)
    n_blocks = max(1, cdiv(k, block_n))
    if num_splits is None:
        progs = t * head_blocks
        want = target_programs(q.device)
        num_splits = 1 if progs >= want else min(n_blocks, cdiv(want, progs), 32)
    num_splits = max(1, min(int(num_splits), n_blocks))
    blocks_per_split = cdiv(n_blocks, num_splits)
    num_splits = cdiv(n_blocks, blocks_per_split)  # no empty trailing split
    split = num_splits > 1
    if split:
        m_ws = torch.empty((t, num_splits, h), dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty((t, num_splits, h, d), dtype=torch.float32, device=q.device)
    else:  # unused pointers (the SPLIT=False specialisation never touches them)
        m_ws = l_ws = acc_ws = sink
    exact = q.dtype == torch.float32
    _sparse_attn_kernel[(t * head_blocks, num_splits)](
        q,
        kv,
        indices,
        kv2,
        indices2,
        sink,
        out,
        m_ws,
        l_ws,
        acc_ws,
        h,
        d,
        k,
        kv.shape[0],
        blocks_per_split,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        k1,
        kv2.shape[0],
        kv2.stride(0),
        indices2.stride(0),
        float(softmax_scale) * _LOG2E,
        TWO=two,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        UPCAST=interp and not exact,
        EXACT_F32=exact or interp,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _sparse_attn_combine_kernel[(t, h)](
            m_ws,
            l_ws,
            acc_ws,
            out,
            h,
            d,
            num_splits,
            out.stride(0),
            out.stride(1),
            BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
