"""Triton kernels of the lightning indexer: the scores (one fused pass over the bf16 keys) and the causal top-k.

Scores: per (query, block of entries) one dot of the query's heads [H, D] with the keys [BLOCK_N, D] (fp32
accumulation; bf16 operands multiply exactly), ReLU, and the head-weighted sum, without fp32 copies of q or the
keys and without the two cuBLAS calls of the reference. A score depends only on its query and key, not on the
tile or the batch shape, so every forward path (prefill, chunked, fixed-shape decode) sees the same values.

Top-k: one program per query row selects the k largest finite scores
(ties: the lower entry id) and writes their ids ascending, -1 padded, exactly `reference.topk_indices` (optionally
after `reference.causal_mask`), without sorting.

How: each score maps to an integer key with the order of the floats (-0.0 counted as +0.0, NaN above +inf as
torch's sort has it; masked, -inf and causally hidden entries get key 0, below every selectable one). The k-th
largest key T is found digit by digit from the top (8 passes of 4 bits: the count of keys >= each of the 15
candidate digits gives the digit). Then a row's selection is every key > T plus the first k - #(key > T) keys
equal to T in entry order, and its output slot is the running count of selected entries before it: ids come out
ascending. A row of up to MAX_ROW entries is read once into registers; a longer one is walked in chunks of BLOCK
(each pass re-reads it from cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["BLOCK", "MAX_ROW", "index_scores", "store_rows", "topk_indices"]

MAX_ROW = 4096  # rows up to this length are held in registers (read once)
BLOCK = 1024  # entries of a longer row per chunk
_NAN_KEY = tl.constexpr(0x7F800001)  # just above the key of +inf


@triton.jit
def _keys(s_ptr, offs, N, vis):
    """[BLOCK] int64 order keys of the scores at offs (0: not selectable)."""
    ok = offs < N
    x = tl.load(s_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in the reference's sort
    bits = x.to(tl.int32, bitcast=True)
    s = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
    s = tl.where(x != x, _NAN_KEY, s)
    valid = ok & (x != float("-inf")) & (offs < vis)
    # shifted by 2^31 into [0, 2^32) (0 would be a NaN bit pattern, remapped above); two int32-range constants
    return tl.where(valid, (s.to(tl.int64) + 1) + 0x7FFFFFFF, 0)


@triton.jit
def _digit_counts(key, thr, shift, digits):
    """[16] int32: for each digit j, the keys >= thr with its digit at `shift` replaced by j (thr's lower digits
    are still 0). Only keys that agree with thr above the digit need their digit compared (int32, small)."""
    hi = key >> (shift + 4)
    t_hi = thr >> (shift + 4)
    higher = tl.sum((hi > t_hi).to(tl.int32), axis=0)
    dk = tl.where(hi == t_hi, ((key >> shift) & 15).to(tl.int32), -1)
    return higher + tl.sum((dk[:, None] >= digits[None, :]).to(tl.int32), axis=0)


@triton.jit
def _select_store(key, offs, thr, need, eq_seen, taken, o_row):
    """Store the ids of a chunk's selected entries at their output slots; returns (eq_seen, taken) after it."""
    eq = ((key == thr) & (thr > 0)).to(tl.int32)
    eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
    sel = ((key > thr) | ((eq != 0) & (eq_rank < need))).to(tl.int32)
    slot = taken + tl.cumsum(sel, axis=0) - sel
    tl.store(o_row + slot, offs.to(tl.int64), mask=sel != 0)
    return eq_seen + tl.sum(eq, axis=0), taken + tl.sum(sel, axis=0)


@triton.jit(do_not_specialize=["N", "K"])
def _topk_kernel(s_ptr, vis_ptr, out_ptr, N, K, stride_s, stride_o, HAS_VIS: tl.constexpr, CHUNKED: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    o_row = out_ptr + row * stride_o
    if HAS_VIS:
        vis = tl.load(vis_ptr + row)
    else:
        vis = N
    base = tl.arange(0, BLOCK)
    digits = tl.arange(0, 16)
    # T: the largest threshold with at least K keys >= T (0 when fewer than K entries are selectable)
    thr = tl.zeros([], dtype=tl.int64)
    if CHUNKED:  # a row longer than BLOCK: every pass walks it again
        for p in tl.static_range(8):
            shift = 28 - 4 * p  # p is a constexpr of the unrolled loop
            cnt = tl.zeros([16], dtype=tl.int32)
            for c in range(0, N, BLOCK):
                cnt += _digit_counts(_keys(s_row, c + base, N, vis), thr, shift, digits)
            # counts fall with the digit: the digit is the number of digits 1..15 still reaching K
            d = tl.sum(((cnt >= K) & (digits > 0)).to(tl.int64), axis=0)
            thr = thr | (d << shift)
        above = tl.zeros([], dtype=tl.int32)
        for c in range(0, N, BLOCK):
            above += tl.sum((_keys(s_row, c + base, N, vis) > thr).to(tl.int32), axis=0)
        eq_seen = tl.zeros([], dtype=tl.int32)
        taken = tl.zeros([], dtype=tl.int32)
        for c in range(0, N, BLOCK):
            eq_seen, taken = _select_store(_keys(s_row, c + base, N, vis), c + base, thr, K - above, eq_seen, taken,
                                           o_row)  # fmt: skip
    else:  # the whole row in registers, read once
        key = _keys(s_row, base, N, vis)
        for p in tl.static_range(8):
            shift = 28 - 4 * p
            cnt = _digit_counts(key, thr, shift, digits)
            d = tl.sum(((cnt >= K) & (digits > 0)).to(tl.int64), axis=0)
            thr = thr | (d << shift)
        above = tl.sum((key > thr).to(tl.int32), axis=0)
        zero = tl.zeros([], dtype=tl.int32)
        eq_seen, taken = _select_store(key, base, thr, K - above, zero, zero, o_row)
    for j in range(0, K, BLOCK):
        offs = j + base
        tl.store(o_row + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs >= taken) & (offs < K))


def topk_indices(scores: Tensor, k: int, visible: Tensor | None = None) -> Tensor:
    """scores [T, N] fp32 | bf16 | fp16, k >= 1, visible [T] int (optional causal counts) -> [T, k] int64: the
    reference's topk_indices(causal_mask(scores, visible) if visible given else scores, k). Validated by the
    package dispatcher."""
    t, n = scores.shape
    out = torch.empty((t, k), dtype=torch.int64, device=scores.device)
    if t == 0:
        return out
    x = scores if scores.stride(-1) == 1 else scores.contiguous()
    vis = visible.contiguous() if visible is not None else x
    check_launchable("topk_indices", _topk_kernel, x, vis)
    chunked = n > MAX_ROW
    block = BLOCK if chunked else max(16, next_pow2(n))
    _topk_kernel[(t,)](x, vis, out, n, k, x.stride(0), out.stride(0), HAS_VIS=visible is not None, CHUNKED=chunked,
                       BLOCK=block, num_warps=8 if block >= 1024 else 4)
    return out


@triton.jit(do_not_specialize=["N"])
def _scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, H, N, D, stride_qt, stride_qh, stride_wt, stride_kt, stride_kn,
                   stride_ot, w_scale, DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        k = tl.load(k_ptr + t * stride_kt + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        if DOT_F32:
            acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32) * w_scale  # the caller's fp32 multiply
    score = tl.sum(tl.maximum(acc, 0.0) * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_ot + offs_n, score, mask=n_ok)


def index_scores(q: Tensor, weights: Tensor, keys: Tensor, w_scale: float = 1.0) -> Tensor:
    """q [T, H, D], weights [T, H], keys [N, D] (shared by every query) or [T, N, D] (each query its own) ->
    [T, N] float32 = sum_h (weights[t, h] * w_scale) * relu(q[t, h] . keys[(t,) n]). q and keys of one dtype (bf16 / fp16:
    tensor-core dots with fp32 accumulation; fp32: exact fp32 dots). Validated by the package dispatcher."""
    t, h, d = q.shape
    per_query = keys.dim() == 3
    n = keys.shape[1] if per_query else keys.shape[0]
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    w = weights if weights.stride(-1) == 1 else weights.contiguous()
    interp = check_launchable("index_scores", _scores_kernel, q, w, keys)
    block_h = max(16, next_pow2(h))
    # [64 heads, 64 entries] fp32 accumulator over 64-column K steps in 8 warps: no spills on sm_90 (offline compile)
    block_d = max(16, min(64, next_pow2(d)))
    block_n = 64 if block_h <= 64 else 16
    _scores_kernel[(t, -(-n // block_n))](
        q, w, keys, out, h, n, d, q.stride(0), q.stride(1), w.stride(0), keys.stride(0) if per_query else 0,
        keys.stride(-2), out.stride(0), float(w_scale), DOT_F32=interp or q.dtype == torch.float32, BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["K", "E"])
def _store_rows_kernel(sel_ptr, seq_ptr, off_ptr, rows_ptr, out_ptr, K, E, stride_s, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    off = tl.load(off_ptr + tl.load(seq_ptr + t))
    for j in range(0, K, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        ok = offs < K
        sel = tl.load(sel_ptr + t * stride_s + offs, mask=ok, other=-1)
        flat = tl.minimum(tl.maximum(sel + off, 0), E - 1)
        r = tl.load(rows_ptr + flat, mask=ok & (sel >= 0), other=-1)  # -1 stays -1
        tl.store(out_ptr + t * stride_o + offs, r.to(tl.int64), mask=ok)


def store_rows(sel: Tensor, seq_of_token: Tensor, seq_offsets: Tensor, rows: Tensor) -> Tensor:
    """`reference.store_rows` in one launch: sel [T, K] int64, seq_of_token [T], seq_offsets [S], rows [E] int64
    (E > 0) -> [T, K] int64. Validated by the package dispatcher."""
    t, k = sel.shape
    out = torch.empty((t, k), dtype=torch.int64, device=sel.device)
    if t == 0 or k == 0:
        return out
    s = sel if sel.stride(-1) == 1 else sel.contiguous()
    seq, offs, r = seq_of_token.contiguous(), seq_offsets.contiguous(), rows.contiguous()
    check_launchable("store_rows", _store_rows_kernel, s, seq, offs, r)
    _store_rows_kernel[(t,)](s, seq, offs, r, out, k, r.numel(), s.stride(0), out.stride(0),
                             BLOCK=min(1024, max(16, next_pow2(k))), num_warps=4)  # fmt: skip
    return out
