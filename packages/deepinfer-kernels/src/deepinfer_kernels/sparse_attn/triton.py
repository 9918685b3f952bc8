"""Triton backend of sparse MQA attention with attn_sink (decode and prefill share one kernel).

One program = one token x a block of heads x one slice of the output columns x one split of that token's index
list. K = V = the gathered kv row and every head of a token reads the same rows, so the default covers all 64
V4.1 heads in one program: each gathered [BLOCK_N, D] tile is read once and feeds tensor-core dots whose M is
the head count (docs/perf.md "Sparse decode attention" has the measured configurations).
Two dot orientations (constexpr QK_T):
- False (default): S = Q K^T [heads, BLOCK_N], O += P V; on sm_90 Q stays in shared memory as the A operand.
- True: S^T = K Q^T [BLOCK_N, heads], O^T += V^T P^T; Q^T and P^T are the B operands of the dots (Q^T is loaded
  transposed: a B operand straight from a load is allocated in shared memory once, outside the loop).
DV_SPLIT = 2 gives each program half the output columns (QK^T still runs over all of D, from both halves of the
tile): half the accumulator registers, twice the programs, no merge, at the price of gathering each row twice
(the second read mostly hits L2) and computing its scores twice.
IDX_AHEAD loads each tile's indices one iteration before its gather (loop-carried): without it triton's pipeliner
issues a synchronous index load right before every gather, and with 32-row tiles and 3-5 stages it then keeps 2-4
gathers in flight instead of one.
Scores and the online softmax run in fp32 in the log2 domain, and the sink enters as the initial running max /
denominator of split 0 (so an all-invalid row gives exactly 0, as the reference). When the programs cannot fill
the GPU (decode), the index list is split over programs (flash-decoding) and a second kernel merges the partial
(max, denominator, normalised output) triples.
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
from deepinfer_kernels.quant.kv_formats import KVFormat

__all__ = [
    "DEFAULT_CONFIG",
    "LARGE_BATCH_CONFIG",
    "RECORD_SMALL_BATCH_CONFIG",
    "SMALL_BATCH_CONFIG",
    "record_format_code",
    "sparse_attn",
]

_LOG2E = 1.4426950408889634
# Launch configurations from the H200 sweep (packages/deepinfer-kernels/benchmarks/sweep_sparse_attn.py; numbers in
# docs/perf.md "Sparse decode attention"). fill = programs per SM below which the index list is split.
# Batches of more than SMALL_BATCH_CONFIG["max_tokens"] tokens: all 64 heads x 32 rows per tile, 8 warps, 3 stages
# with the indices loaded one tile ahead (2 gathers in flight).
DEFAULT_CONFIG: dict[str, int] = {
    "block_h": 64,
    "block_n": 32,
    "num_warps": 8,
    "num_stages": 3,
    "qk_t": 0,
    "dv_split": 1,
    "idx_ahead": 1,
    "fill": 1,
}
# Batches of at least min_tokens tokens: 4 stages (3 gathers in flight) and no column mask (H200: 130.6 vs 135.6 us
# at T = 256 and 67.4 vs 69.9 at T = 128 with two sources, a tie with one; slower at T = 64).
LARGE_BATCH_CONFIG: dict[str, int] = {
    "min_tokens": 128,
    "block_h": 64,
    "block_n": 32,
    "num_warps": 8,
    "num_stages": 4,
    "qk_t": 0,
    "dv_split": 1,
    "idx_ahead": 1,
    "even_d": 1,
    "fill": 1,
}
# fp32 inputs (exact dots; tests and fp32 runs): 16 heads x 32 rows per tile keep the fp32 Q and kv stages
# within an H200 SM's shared memory (the bf16 configs' [64 x 512] fp32 tiles would need over 227 KiB).
FP32_CONFIG: dict[str, int] = {
    "block_h": 16,
    "block_n": 32,
    "num_warps": 8,
    "num_stages": 2,
    "qk_t": 0,
    "dv_split": 1,
    "idx_ahead": 0,
    "fill": 1,
}
# Up to max_tokens tokens (the GPU is filled by splits anyway): half the output columns per program, 4 warps.
SMALL_BATCH_CONFIG: dict[str, int] = {
    "max_tokens": 16,
    "block_h": 64,
    "block_n": 32,
    "num_warps": 4,
    "num_stages": 3,
    "qk_t": 0,
    "dv_split": 2,
    "idx_ahead": 0,
    "fill": 1,
}

# Record sources (kv_format / kv2_format) up to SMALL_BATCH_CONFIG["max_tokens"] tokens: the decode in the gather
# makes the whole-column tiles of 16 rows with the index prefetch the fastest (H200, 128 MXFP8 + 512 NVFP4 rows
# per token: 27.1 against 36.0 us at T = 8, 19.7 against 21.6 at T = 1; docs/perf.md "KV records read in place").
# Larger batches keep DEFAULT_CONFIG / LARGE_BATCH_CONFIG, which were also the fastest there.
RECORD_SMALL_BATCH_CONFIG: dict[str, int] = {
    "block_h": 64,
    "block_n": 16,
    "num_warps": 8,
    "num_stages": 4,
    "qk_t": 0,
    "dv_split": 1,
    "idx_ahead": 1,
    "even_d": 1,
    "fill": 1,
}


@triton.jit
def _tile_idx(start, hi, idx_row_ptr, col0, idx2_row_ptr, K1, BLOCK_N: tl.constexpr, TILE_SRC: tl.constexpr):
    """The indices of the tile of columns [start, start + BLOCK_N) (-1 past hi)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if TILE_SRC:
        ip = tl.where(start >= K1, idx2_row_ptr + (start - K1), idx_row_ptr + (start - col0))
    else:
        ip = idx_row_ptr + (start - col0)
    return tl.load(ip + tl.arange(0, BLOCK_N), mask=offs_n < hi, other=-1)


# Record formats of a kv source (the cache's deployed rows, decoded in the gather; docs/kernels.md §8):
# 0 = plain values in q's dtype family; 1 = MXFP8 (e4m3 codes, UE8M0 scale per 32); 2 = NVFP4 (e2m1 nibbles, e4m3
# scale per 16); 3 = MXFP4 (e2m1 nibbles, UE8M0 scale per 32). A record row is its codes followed by its scale bytes.
FMT_PLAIN, FMT_MXFP8, FMT_NVFP4, FMT_MXFP4 = 0, 1, 2, 3
_FORMAT_CODES = {("e4m3", "ue8m0", 32): FMT_MXFP8, ("e2m1", "e4m3", 16): FMT_NVFP4, ("e2m1", "ue8m0", 32): FMT_MXFP4}


@triton.jit
def _e4m3_to_f32(c):
    """e4m3 bit patterns (int32, 0..255; no NaN codes) -> float32, exactly (subnormals included). Integer
    arithmetic rather than an fp8 cast: the CPU interpreter runs it too, and the values are the same."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((c & 128) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return tl.where(e == 0, tl.where(c >= 128, -sub, sub), normal)


@triton.jit
def _e2m1_to_f32(n):
    """e2m1 codes (int32, 0..15; bit 3 the sign) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True))
    return tl.where(n >= 8, -mag, mag)


@triton.jit
def _load_tile(rows, cols, col0, mask, D, FMT: tl.constexpr, BLOCK_N: tl.constexpr, DC: tl.constexpr):
    """The [BLOCK_N, DC] values of a gathered tile, columns cols = col0 + arange(DC): plain loads, or record rows
    decoded in registers to float32 (codes x block scale, exact; the caller casts to the dot dtype, which holds
    these products exactly). Record codes and scales are loaded as contiguous byte runs per row (vectorised), the
    scales once per block and broadcast through a [rows, blocks, block] view; records need DC = the whole
    power-of-two slice (no column mask)."""
    if FMT == 0:
        t = tl.load(rows[:, None] + cols[None, :], mask=mask, other=0.0)
    else:
        if FMT == 1:
            QB: tl.constexpr = 32
            v = _e4m3_to_f32(tl.load(rows[:, None] + cols[None, :], mask=mask, other=0).to(tl.int32))
            sb = tl.load(rows[:, None] + (D + col0 // QB) + tl.arange(0, DC // QB)[None, :], mask=mask, other=0)
        else:
            QB: tl.constexpr = 16 if FMT == 2 else 32
            byte = tl.load(rows[:, None] + col0 // 2 + tl.arange(0, DC // 2)[None, :], mask=mask, other=0)
            byte = byte.to(tl.int32)
            # low nibble = even column, high nibble = odd column: join + reshape interleaves them
            v = tl.reshape(tl.join(_e2m1_to_f32(byte & 15), _e2m1_to_f32(byte >> 4)), [BLOCK_N, DC])
            sb = tl.load(rows[:, None] + (D // 2 + col0 // QB) + tl.arange(0, DC // QB)[None, :], mask=mask, other=0)
        sb = sb.to(tl.int32)
        if FMT == 2:
            scale = _e4m3_to_f32(sb)
        else:
            scale = (sb << 23).to(tl.float32, bitcast=True)  # UE8M0: the byte is the float32 exponent field
        t = tl.reshape(tl.reshape(v, [BLOCK_N, DC // QB, QB]) * scale[:, :, None], [BLOCK_N, DC])
    return t


@triton.jit
def _attend(
    q,
    q2,
    m_i,
    l_i,
    acc,
    kv_ptr,
    stride_kv,
    s_rows,
    idx_row_ptr,
    col0,
    kv2_ptr,
    stride_kv2,
    s_rows2,
    idx2_row_ptr,
    K1,
    lo,
    hi,
    own,
    own_mask,
    oth,
    oth_mask,
    qk_scale,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    EXACT_F32: tl.constexpr,
    QK_T: tl.constexpr,
    DV_SPLIT: tl.constexpr,
    TILE_SRC: tl.constexpr,
    IDX_AHEAD: tl.constexpr = False,
    EVEN_D: tl.constexpr = False,
    D=0,
    FMT: tl.constexpr = 0,
    own0=0,
    oth0=0,
):
    """Online softmax over the index columns [lo, hi): column j reads idx_row_ptr[j - col0] over kv_ptr, or with
    TILE_SRC (K1 a multiple of BLOCK_N: no tile straddles the sources) columns j >= K1 read idx2_row_ptr[j - K1]
    over kv2_ptr, the source picked once per tile (scalar selects keep the gather pipelined).
    FMT: the record format of the source(s) read here (FMT_*; the values of a tile are decoded after the gather).
    IDX_AHEAD: each iteration loads the next tile's indices (loop-carried in registers), so the gather of a tile
    does not start with a dependent index load. EVEN_D: the tile spans exactly D columns (no column mask)."""
    if IDX_AHEAD:
        idx_nx = _tile_idx(lo, hi, idx_row_ptr, col0, idx2_row_ptr, K1, BLOCK_N, TILE_SRC)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if TILE_SRC:
            in_b = start >= K1
            src = tl.where(in_b, kv2_ptr, kv_ptr)
            stride = tl.where(in_b, stride_kv2, stride_kv)
            limit = tl.where(in_b, s_rows2, s_rows)
            if not IDX_AHEAD:
                ip = tl.where(in_b, idx2_row_ptr + (start - K1), idx_row_ptr + (start - col0))
                idx = tl.load(ip + tl.arange(0, BLOCK_N), mask=offs_n < hi, other=-1)
        else:
            src, stride, limit = kv_ptr, stride_kv, s_rows
            if not IDX_AHEAD:
                idx = tl.load(idx_row_ptr + (offs_n - col0), mask=offs_n < hi, other=-1)
        if IDX_AHEAD:
            idx = idx_nx
            idx_nx = _tile_idx(start + BLOCK_N, hi, idx_row_ptr, col0, idx2_row_ptr, K1, BLOCK_N, TILE_SRC)
        # Out-of-range rows are treated as invalid so a bad index can never read outside its source.
        valid = (idx >= 0) & (idx < limit)
        rows = src + tl.where(valid, idx, 0) * stride
        DC: tl.constexpr = own.shape[0]
        if EVEN_D or FMT != 0:
            kt = _load_tile(rows, own, own0, valid[:, None], D, FMT, BLOCK_N, DC)
        else:
            kt = _load_tile(rows, own, own0, valid[:, None] & own_mask[None, :], D, FMT, BLOCK_N, DC)
        if FMT != 0:
            kt = kt.to(q.dtype)
        if UPCAST:
            kt = kt.to(tl.float32)
        if DV_SPLIT == 2:
            if FMT != 0:
                kt2 = _load_tile(rows, oth, oth0, valid[:, None], D, FMT, BLOCK_N, DC)
            else:
                kt2 = _load_tile(rows, oth, oth0, valid[:, None] & oth_mask[None, :], D, FMT, BLOCK_N, DC)
            if FMT != 0:
                kt2 = kt2.to(q.dtype)
            if UPCAST:
                kt2 = kt2.to(tl.float32)
        if QK_T:
            if EXACT_F32:
                st = tl.dot(kt, q, input_precision="ieee")
                if DV_SPLIT == 2:
                    st = tl.dot(kt2, q2, st, input_precision="ieee")
            else:
                st = tl.dot(kt, q)
                if DV_SPLIT == 2:
                    st = tl.dot(kt2, q2, st)
            st = tl.where(valid[:, None], st * qk_scale, float("-inf"))  # [BLOCK_N, BLOCK_H]
            m_new = tl.maximum(m_i, tl.max(st, 0))
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pt, 0)
            if EXACT_F32:
                acc = tl.dot(tl.trans(kt), pt.to(kt.dtype), acc * alpha[None, :], input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(kt), pt.to(kt.dtype), acc * alpha[None, :])
        else:
            if EXACT_F32:
                qk = tl.dot(q, tl.trans(kt), input_precision="ieee")
                if DV_SPLIT == 2:
                    qk = tl.dot(q2, tl.trans(kt2), qk, input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(kt))
                if DV_SPLIT == 2:
                    qk = tl.dot(q2, tl.trans(kt2), qk)
            qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if EXACT_F32:
                acc = tl.dot(p.to(kt.dtype), kt, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(kt.dtype), kt, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


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
    QK_T: tl.constexpr = False,
    DV_SPLIT: tl.constexpr = 1,
    TILE_SRC: tl.constexpr = False,
    IDX_AHEAD: tl.constexpr = False,
    EVEN_D: tl.constexpr = False,
    FMT: tl.constexpr = 0,
    FMT2: tl.constexpr = 0,
):
    # Axis 0 enumerates (token, head block, column half) with the programs of one token adjacent, so the
    # programs that gather the same kv rows run together and all but the first read them from L2.
    # Splits are axis 1 (<= 32).
    DC: tl.constexpr = BLOCK_D // DV_SPLIT
    pid = tl.program_id(0)
    dh = pid % DV_SPLIT
    hb = (pid // DV_SPLIT) % HEAD_BLOCKS
    t = (pid // (DV_SPLIT * HEAD_BLOCKS)).to(tl.int64)
    s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    own0 = dh * DC
    own = own0 + tl.arange(0, DC)  # the output columns of this program
    own_mask = own < (BLOCK_D if EVEN_D else D)  # EVEN_D: D == BLOCK_D, a mask the compiler folds away
    q_base = q_ptr + t * stride_qt
    if QK_T:  # loaded as Q^T [DC, BLOCK_H]: a B operand straight from a load is kept in shared memory
        q = tl.load(
            q_base + own[:, None] + offs_h[None, :] * stride_qh, mask=own_mask[:, None] & h_mask[None, :], other=0.0
        )
    else:
        q = tl.load(
            q_base + offs_h[:, None] * stride_qh + own[None, :], mask=h_mask[:, None] & own_mask[None, :], other=0.0
        )
    if UPCAST:
        q = q.to(tl.float32)
    if DV_SPLIT == 2:  # the other half of D, for the scores only
        oth0 = (1 - dh) * DC
        oth = oth0 + tl.arange(0, DC)
        oth_mask = oth < (BLOCK_D if EVEN_D else D)
        if QK_T:
            q2 = tl.load(
                q_base + oth[:, None] + offs_h[None, :] * stride_qh,
                mask=oth_mask[:, None] & h_mask[None, :],
                other=0.0,
            )
        else:
            q2 = tl.load(
                q_base + offs_h[:, None] * stride_qh + oth[None, :],
                mask=h_mask[:, None] & oth_mask[None, :],
                other=0.0,
            )
        if UPCAST:
            q2 = q2.to(tl.float32)
    else:  # unused placeholders of the helper's arguments
        oth0, oth, oth_mask, q2 = own0, own, own_mask, q
    # The sink logit is one extra softmax column with no value row: start split 0 from it.
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    first = s == 0
    # Other splits start from a finite -1e30 (not -inf) so exp2(m_old - m_new) never evaluates inf - inf.
    m_i = tl.where(first, sink, -1.0e30)
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    if QK_T:
        acc = tl.zeros([DC, BLOCK_H], dtype=tl.float32)  # O^T
    else:
        acc = tl.zeros([BLOCK_H, DC], dtype=tl.float32)

    n_lo = s * blocks_per_split * BLOCK_N
    n_hi = tl.minimum(n_lo + blocks_per_split * BLOCK_N, K)
    # Two sources: columns [0, K1) over kv, [K1, K) over kv2. With K1 a multiple of BLOCK_N one loop picks the
    # source per tile; otherwise two loops. Either way each tile is one plain gather that triton's software
    # pipeliner turns into asynchronous copies (a per-row select between the sources it does not pipeline).
    idx_row = idx_ptr + t * stride_it
    idx2_row = idx2_ptr + t * stride_it2
    if TILE_SRC:
        m_i, l_i, acc = _attend(
            q, q2, m_i, l_i, acc, kv_ptr, stride_kv, S_ROWS, idx_row, 0, kv2_ptr, stride_kv2, S_ROWS2, idx2_row,
            K1, n_lo, n_hi, own, own_mask, oth, oth_mask, qk_scale, BLOCK_N, UPCAST, EXACT_F32, QK_T, DV_SPLIT, True,
            IDX_AHEAD, EVEN_D, D, FMT, own0, oth0,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _attend(
            q, q2, m_i, l_i, acc, kv_ptr, stride_kv, S_ROWS, idx_row, 0, kv_ptr, stride_kv, S_ROWS, idx_row, K1,
            n_lo, tl.minimum(n_hi, K1) if TWO else n_hi, own, own_mask, oth, oth_mask, qk_scale,
            BLOCK_N, UPCAST, EXACT_F32, QK_T, DV_SPLIT, False, IDX_AHEAD, EVEN_D, D, FMT, own0, oth0,
        )  # fmt: skip
        if TWO:
            m_i, l_i, acc = _attend(
                q, q2, m_i, l_i, acc, kv2_ptr, stride_kv2, S_ROWS2, idx2_row, K1, kv2_ptr, stride_kv2, S_ROWS2,
                idx2_row, K1, tl.maximum(n_lo, K1), n_hi, own, own_mask, oth, oth_mask, qk_scale,
                BLOCK_N, UPCAST, EXACT_F32, QK_T, DV_SPLIT, False, IDX_AHEAD, EVEN_D, D, FMT2, own0, oth0,
            )  # fmt: skip

    if QK_T:
        acc = tl.trans(acc)  # [BLOCK_H, DC]
    if SPLIT:
        row = (t * num_splits + s) * H + offs_h  # workspace [T, splits, H(, D)]
        first_half = h_mask & ((offs_h * 0 + dh) == 0)  # both column halves hold the same (m, l)
        tl.store(m_ptr + row, m_i, mask=first_half)
        tl.store(l_ptr + row, l_i, mask=first_half)
        # the partial output normalised by its own denominator (a split that saw only invalid rows has
        # acc = l = 0 -> 0), in the workspace dtype
        part = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(
            acc_ptr + row[:, None] * D + own[None, :],
            part.to(acc_ptr.dtype.element_ty),
            mask=h_mask[:, None] & own_mask[None, :],
        )
    else:
        o = acc / l_i[:, None]  # l_i >= 1: the sink term is always in the denominator
        tl.store(
            out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + own[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & own_mask[None, :],
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
    w = tl.exp2(m - m_max) * l  # weight of each split's normalised partial output
    part = tl.load(
        acc_ptr + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    ).to(tl.float32)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def record_format_code(fmt: KVFormat | None) -> int:
    """The kernel's FMT constexpr of a record format (None: plain values)."""
    if fmt is None:
        return FMT_PLAIN
    code = _FORMAT_CODES.get((fmt.element, fmt.scale, fmt.block))
    if code is None:
        raise ValueError(
            f"sparse_attn: no in-kernel decoder for record format {fmt.name} ({fmt.element}, {fmt.scale} scale per "
            f"{fmt.block}); supported: MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1"
        )
    return code


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
    qk_t: bool | None = None,
    dv_split: int | None = None,
    fill: float | None = None,
    tile_src: bool = True,
    partial_dtype: torch.dtype | None = None,
    idx_ahead: bool | None = None,
    even_d: bool | None = None,
    kv_format: KVFormat | None = None,
    kv2_format: KVFormat | None = None,
) -> Tensor:
    """q [T, H, D] bf16|fp16|fp32; kv [S, D] same dtype, or with kv_format [S, record bytes] uint8 records
    (`deepinfer_kernels.quant.kv_formats`, decoded in the gather; kv2_format likewise for kv2);
    indices [T, K] int (-1 / out of range = none);
    attn_sink [H] -> [T, H, D] in q's dtype; kv2 [S2, D] / indices2 [T, K2]: an optional second source whose
    index lists extend each token's list (one softmax over both). Inputs are validated by the package
    dispatcher; the keyword arguments override the launch configuration (benchmark sweeps, tests of the split
    path): qk_t picks the dot orientation, dv_split in {1, 2} the output columns per program, fill the
    programs per SM below which the index list is split (flash-decoding) when num_splits is not given,
    tile_src=False forces the two-loop form of two sources, partial_dtype the dtype of the split workspace
    (default fp32: a bf16 workspace was slower on the H200 and rounds each partial output once more),
    idx_ahead loads each tile's indices one iteration ahead (loop-carried), even_d drops the column mask when D
    is a power of two (both change only the generated code, not the result).
    Unset options come from SMALL_BATCH_CONFIG (T <= its max_tokens), LARGE_BATCH_CONFIG (T >= its min_tokens)
    or DEFAULT_CONFIG."""
    t, h, d = q.shape
    fmt1, fmt2 = record_format_code(kv_format), record_format_code(kv2_format)
    # an empty second source (no rows or no columns) adds only invalid entries: one source does the same
    two = kv2 is not None and kv2.shape[0] > 0 and indices2.shape[1] > 0
    k1 = indices.shape[1]
    k = k1 + (indices2.shape[1] if two else 0)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if t <= SMALL_BATCH_CONFIG["max_tokens"]:
        cfg = RECORD_SMALL_BATCH_CONFIG if fmt1 or fmt2 else SMALL_BATCH_CONFIG
    else:
        cfg = LARGE_BATCH_CONFIG if t >= LARGE_BATCH_CONFIG["min_tokens"] else DEFAULT_CONFIG
    if q.element_size() == 4:  # fp32 tiles are twice the bytes: the bf16 tiles would overflow shared memory
        cfg = FP32_CONFIG
    # heads per program: never wider than the (power-of-two padded) head count, >= 16 for the dots
    block_h = block_h or min(cfg["block_h"], max(16, next_pow2(h)))
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    qk_t = bool(cfg["qk_t"] if qk_t is None else qk_t)
    fill = float(cfg["fill"] if fill is None else fill)
    idx_ahead = bool(cfg["idx_ahead"] if idx_ahead is None else idx_ahead)
    even_d = bool(cfg.get("even_d", 0) if even_d is None else even_d)
    block_d = max(16, next_pow2(d))
    dv_split = int(dv_split or cfg["dv_split"])
    if dv_split not in (1, 2):
        raise ValueError(f"sparse_attn: dv_split {dv_split}, expected 1 or 2")
    if block_d < 32:  # each half must stay >= 16 wide for the dots
        dv_split = 1
    if fmt1 or fmt2:  # record tiles are whole scale blocks of a power-of-two D: no column mask
        if d != block_d or d < 32:
            raise ValueError(f"sparse_attn: kv records need D a power of two >= 32, found D = {d}")
        if d // dv_split < 32:
            dv_split = 1
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    if two:
        kv2 = kv2 if kv2.stride(1) == 1 else kv2.contiguous()
        indices2 = indices2 if indices2.stride(1) == 1 else indices2.contiguous()
    else:  # unused (the TWO=False specialisation never touches them)
        kv2, indices2 = kv, indices
    sink = attn_sink.float().contiguous()
    interp = check_launchable("sparse_attn", _sparse_attn_kernel, q, kv, indices, kv2, indices2, sink)
    head_blocks = cdiv(h, block_h)
    n_blocks = max(1, cdiv(k, block_n))
    if num_splits is None:
        progs = t * head_blocks * dv_split
        # fill programs per SM (target_programs is 2 per SM; a small constant on the interpreter); rounding the
        # split count down keeps every program in one wave
        want = max(1, round(target_programs(q.device) * fill / 2))
        num_splits = 1 if progs >= want else min(n_blocks, max(1, want // progs), 32)
    num_splits = max(1, min(int(num_splits), n_blocks))
    blocks_per_split = cdiv(n_blocks, num_splits)
    num_splits = cdiv(n_blocks, blocks_per_split)  # no empty trailing split
    split = num_splits > 1
    if split:
        m_ws = torch.empty((t, num_splits, h), dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty((t, num_splits, h, d), dtype=partial_dtype or torch.float32, device=q.device)
    else:  # unused pointers (the SPLIT=False specialisation never touches them)
        m_ws = l_ws = acc_ws = sink
    exact = q.dtype == torch.float32
    _sparse_attn_kernel[(t * head_blocks * dv_split, num_splits)](
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
        QK_T=qk_t,
        DV_SPLIT=dv_split,
        TILE_SRC=two and tile_src and k1 % block_n == 0 and fmt1 == fmt2,
        IDX_AHEAD=idx_ahead,
        EVEN_D=even_d and d == block_d,
        FMT=fmt1,
        FMT2=fmt2 if two else fmt1,
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
