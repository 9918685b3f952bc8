"""FP4 routed-expert GEMVs on the CUDA cores, for decode token counts (variants "gemv" and "gemv_expert" of
`deepinfer_kernels.moe.triton`; docs/moe_fp4_kernel.md, "CUDA-core GEMV for decode").

At T = 1..4 tokens an expert sees one row (rarely more), so a tensor-core tile of 16 or 64 rows holds one real row
and the decoded weights still pay the conversion to the MMA operand layout. Here no MMA and no shared memory are
used: a program owns BLOCK_N weight rows of one expert and a few token slots, and per K tile of BLOCK_K columns

* every lane reads 16-byte vectors of packed codes (4 words of 8 e2m1 codes) with plain coalesced loads,
* decodes each word in registers (the PTX of `fp4_grouped`: four bf16 pairs; with the multiplier 2^126 the pairs
  are the exact e2m1 values, so the scale is left to fp32) and multiplies by the activations on the CUDA cores,
* sums a word's 8 products in fp32 and multiplies that sum by its group's UE8M0 scale (exact: a power of two),
* loads the next K tile's codes and scales before computing this one (``PREFETCH``), so DRAM latency overlaps the
  decode.

Tiles are 3-D ``[BLOCK_T, BLOCK_N, BLOCK_K / 8]`` (code words along K, word ``4a + b`` of each 128-column chunk)
from their pointers on: the weight load's coalesced layout (lanes along K first, 16-byte vectors) is then the layout
of the products and of the accumulators, with no layout conversion inside the loop, and the rows a lane holds share
its activations. The activations and scale words are loaded by PTX (they would otherwise get their own coalesced
layout and be converted through shared memory every iteration). A word holds 8 consecutive columns, so a token's
activations for it are one 16-byte (bf16 / fp16) or two (fp32) vector loads, shared by the BLOCK_N rows of the lane.

Layouts (`moe.fp4_layout`): in the chunked layout word ``4a + b`` of a chunk is word a of scale group b; in the
checkpoint layout it is word b of group a. Both are read the same way, only the column and scale byte of a word
differ.

Slots: "gemv" runs one program per (token, slot) pair (``BLOCK_T`` 1, the expert read from ``ids``: no permutation
launch); "gemv_expert" one program per row block of `moe.triton.align_pairs` (an expert's pairs together, its
weights read once for all of them). The portable path (``ASM`` False: the CPU interpreter) decodes with integer
ops (`fp4_grouped`) and loads with ``tl.load``; it computes the same fp32 products.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels.moe.fp4_grouped import triton as fp4_grouped

__all__ = ["aligned_rows", "launch_down", "launch_gate_up", "supports"]

_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)  # UE8M0 code 0: 2^-127
# The decode of one code word is `fp4_grouped`'s (four bf16 pairs value * 2^-126 times a bf16x2 multiplier), with
# each pair's two bf16 lanes widened to fp32 in the PTX (a shift and a mask) instead of 16-bit outputs that Triton
# would extract and convert again: outputs (0, 4), (1, 5), (2, 6), (3, 7) as fp32 bits.
_WORD_F32 = tl.constexpr(
    re.sub(
        r"mov\.b32 \{(\$\d+), (\$\d+)\}, t;",
        r"shl.b32 \1, t, 16;\nand.b32 \2, t, 0xFFFF0000;",
        fp4_grouped._word_ptx(False),
    )
)
_nibble_f32 = fp4_grouped._nibble_f32
# bf16 2^126 in both lanes: the decoded pairs become the exact e2m1 values (|v| <= 6)
_TWO_POW_126_X2 = tl.constexpr(0x7E807E80)
# activation dtypes (X_KIND)
_X_BF16, _X_F16, _X_F32 = 0, 1, 2

_LOAD_V4 = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")
_LOAD_V8 = tl.constexpr(
    """
{
ld.global.v4.b32 {$0, $1, $2, $3}, [$8];
ld.global.v4.b32 {$4, $5, $6, $7}, [$8+16];
}
"""
)
_LOAD_B32 = tl.constexpr("ld.global.b32 $0, [$1];")


@triton.jit
def _tile_words(BLOCK_K: tl.constexpr, CHUNKED: tl.constexpr):
    """Word j of a K tile, [1, 1, BLOCK_K / 8] (word 4a + b of chunk q = j // 16) -> (j, its chunk q, its first
    column, the bit shift of its group's byte in the chunk's scale word)."""
    j = tl.arange(0, BLOCK_K // 8)[None, None, :]
    q = j // 16
    a = (j // 4) % 4
    b = j % 4
    if CHUNKED:  # word a of group b
        col = q * 128 + b * 32 + a * 8
        shift = b * 8
    else:  # word b of group a
        col = q * 128 + a * 32 + b * 8
        shift = a * 8
    return j, q, col, shift


@triton.jit
def _load_x(p, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """Pointers p [BLOCK_T, 1, BLOCK_K / 8] to the first of 8 consecutive activations -> the 8 as fp32 tensors."""
    if ASM and X_KIND == 2:
        x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
            _LOAD_V8, "=r,=r,=r,=r,=r,=r,=r,=r,l", [p], dtype=(tl.float32,) * 8, is_pure=True, pack=1
        )
    elif ASM:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            _LOAD_V4, "=r,=r,=r,=r,l", [p], dtype=(tl.int32,) * 4, is_pure=True, pack=1
        )
        if X_KIND == 0:  # bf16 -> fp32 is a shift
            x0 = (r0 << 16).to(tl.float32, bitcast=True)
            x1 = (r0 & -65536).to(tl.float32, bitcast=True)
            x2 = (r1 << 16).to(tl.float32, bitcast=True)
            x3 = (r1 & -65536).to(tl.float32, bitcast=True)
            x4 = (r2 << 16).to(tl.float32, bitcast=True)
            x5 = (r2 & -65536).to(tl.float32, bitcast=True)
            x6 = (r3 << 16).to(tl.float32, bitcast=True)
            x7 = (r3 & -65536).to(tl.float32, bitcast=True)
        else:
            x0 = r0.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (r0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x2 = r1.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x3 = (r1 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x4 = r2.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x5 = (r2 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x6 = r3.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x7 = (r3 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x0 = tl.load(p).to(tl.float32)
        x1 = tl.load(p + 1).to(tl.float32)
        x2 = tl.load(p + 2).to(tl.float32)
        x3 = tl.load(p + 3).to(tl.float32)
        x4 = tl.load(p + 4).to(tl.float32)
        x5 = tl.load(p + 5).to(tl.float32)
        x6 = tl.load(p + 6).to(tl.float32)
        x7 = tl.load(p + 7).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _scale(p, shift, ASM: tl.constexpr):
    """Scale-word pointers p [1, BLOCK_N, BLOCK_K / 8] (a word's chunk: the 4 words of a lane's vector share one
    address, loaded once) and the byte shift of each word's group -> fp32 scales 2^(code - 127) (code 0: 2^-127)."""
    if ASM:
        sw = tl.inline_asm_elementwise(_LOAD_B32, "=r,l", [p], dtype=tl.int32, is_pure=True, pack=1)
    else:
        sw = tl.load(p)
    b = (sw >> shift) & 255
    return tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def _word_dot(w, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Code words w [1, BLOCK_N, BLOCK_K / 8] int32 and the 8 activations of each word [BLOCK_T, 1, BLOCK_K / 8]
    -> Σ_m x_m * code m (exact e2m1 values, fp32 products and sum), [BLOCK_T, BLOCK_N, BLOCK_K / 8]."""
    if ASM:
        mul = tl.full(w.shape, _TWO_POW_126_X2, tl.int32)
        f0, f4, f1, f5, f2, f6, f3, f7 = tl.inline_asm_elementwise(
            _WORD_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w, mul], dtype=(tl.float32,) * 8, is_pure=True, pack=1
        )
    else:
        f0, f1, f2, f3 = _nibble_f32(w, 0), _nibble_f32(w, 1), _nibble_f32(w, 2), _nibble_f32(w, 3)
        f4, f5, f6, f7 = _nibble_f32(w, 4), _nibble_f32(w, 5), _nibble_f32(w, 6), _nibble_f32(w, 7)
    # explicit fmas: one instruction a product whatever the compiler's fp-fusion default (operands broadcast by
    # hand: older triton versions do not broadcast fma operands)
    acc = x0 * f0
    acc = tl.fma(tl.broadcast_to(x1, acc.shape), tl.broadcast_to(f1, acc.shape), acc)
    acc = tl.fma(tl.broadcast_to(x2, acc.shape), tl.broadcast_to(f2, acc.shape), acc)
    acc = tl.fma(tl.broadcast_to(x3, acc.shape), tl.broadcast_to(f3, acc.shape), acc)
    acc = tl.fma(tl.broadcast_to(x4, acc.shape), tl.broadcast_to(f4, acc.shape), acc)
    acc = tl.fma(tl.broadcast_to(x5, acc.shape), tl.broadcast_to(f5, acc.shape), acc)
    acc = tl.fma(tl.broadcast_to(x6, acc.shape), tl.broadcast_to(f6, acc.shape), acc)
    return tl.fma(tl.broadcast_to(x7, acc.shape), tl.broadcast_to(f7, acc.shape), acc)


@triton.jit
def _gemv_loop(
    x_rows, wa_ptr, sa_ptr, wb_ptr, sb_ptr, w_off, s_off, K, stride_sq,
    TWO: tl.constexpr, X_KIND: tl.constexpr, ASM: tl.constexpr, CHUNKED: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Σ over K of x · W for one (TWO: two) weight matrices sharing the activations: x_rows [BLOCK_T, 1, 1] row
    pointers, w_off [1, BLOCK_N, 1] word offsets of the weight rows, s_off the same for their scale words (chunk q at
    + q * stride_sq) -> fp32 [BLOCK_T, BLOCK_N] (and the second matrix's; a zero tile when not TWO).
    K % BLOCK_K == 0."""
    word, qs, col, shift = _tile_words(BLOCK_K, CHUNKED)
    wpa = wa_ptr + w_off + word
    spa = sa_ptr + s_off + qs * stride_sq
    wpb = wb_ptr + w_off + word
    spb = sb_ptr + s_off + qs * stride_sq
    xp = x_rows + col
    acc_a = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    # offsets are tile index * per-tile step: the compiler then knows the code words of a lane are 16-byte aligned
    # (a division of a column offset would lose that, and split the loads)
    WT: tl.constexpr = BLOCK_K // 8  # code words per K tile
    ST: tl.constexpr = BLOCK_K // 128  # scale words per K tile
    n_tiles = K // BLOCK_K
    if PREFETCH:
        wa_n = tl.load(wpa)
        sa_n = _scale(spa, shift, ASM)
        wb_n = wa_n
        sb_n = sa_n
        if TWO:
            wb_n = tl.load(wpb)
            sb_n = _scale(spb, shift, ASM)
    for kt in range(0, n_tiles):
        if PREFETCH:
            # the next tile (the last tile again at the end: in cache, and no mask) before this one is computed
            nt = tl.minimum(kt + 1, n_tiles - 1)
            wa, sa, wb, sb = wa_n, sa_n, wb_n, sb_n
            wa_n = tl.load(wpa + nt * WT)
            sa_n = _scale(spa + nt * ST * stride_sq, shift, ASM)
            if TWO:
                wb_n = tl.load(wpb + nt * WT)
                sb_n = _scale(spb + nt * ST * stride_sq, shift, ASM)
        else:
            wa = tl.load(wpa + kt * WT)
            sa = _scale(spa + kt * ST * stride_sq, shift, ASM)
            wb = wa
            sb = sa
            if TWO:
                wb = tl.load(wpb + kt * WT)
                sb = _scale(spb + kt * ST * stride_sq, shift, ASM)
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x(xp + kt * BLOCK_K, X_KIND, ASM)
        acc_a = tl.fma(_word_dot(wa, x0, x1, x2, x3, x4, x5, x6, x7, ASM), tl.broadcast_to(sa, acc_a.shape), acc_a)
        if TWO:
            acc_b = tl.fma(_word_dot(wb, x0, x1, x2, x3, x4, x5, x6, x7, ASM), tl.broadcast_to(sb, acc_b.shape), acc_b)
    out_a = tl.sum(acc_a, axis=2)
    out_b = tl.sum(acc_b, axis=2)
    return out_a, out_b


@triton.jit
def _slots(exp_ptr, pairs_ptr, P, PER_PAIR: tl.constexpr, BLOCK_T: tl.constexpr):
    """(expert of this program, its slots [BLOCK_T] (rows of h), their pair ids, which pairs are real)."""
    pid_b = tl.program_id(0)
    e = tl.load(exp_ptr + pid_b).to(tl.int64)
    slot = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
    if PER_PAIR:
        pair = slot
    else:
        pair = tl.load(pairs_ptr + slot)
    return e, slot.to(tl.int64), pair, pair < P


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, exp_ptr, pairs_ptr, h_ptr,
    P, N, K, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_h, limit,
    TOPK: tl.constexpr, CLAMP: tl.constexpr, X_KIND: tl.constexpr, ASM: tl.constexpr, CHUNKED: tl.constexpr,
    PER_PAIR: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x [T, K] (X_KIND: bf16 / fp16 / fp32); w1 / w3 [E, N, K/8] int32 code words; s1 / s3 int32 scale words (4
    groups each), word (n, q) of chunk q at n * stride_sn + q * stride_sq; exp [programs] the expert of each program
    (PER_PAIR: ids [P], one pair a program, BLOCK_T 1; else `align_pairs`' block experts, -1 unused, and pairs
    [programs * BLOCK_T]) -> h [programs * BLOCK_T, N] (x's dtype) = clamped SwiGLU of the slot's token."""
    e, slot, pair, real = _slots(exp_ptr, pairs_ptr, P, PER_PAIR, BLOCK_T)
    if e >= 0:
        tok = tl.where(real, pair // TOPK, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        wrow = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1: no predicates in the loop
        w_off = (e * stride_we + wrow * stride_wn)[None, :, None]
        s_off = (e * stride_se + wrow * stride_sn)[None, :, None]
        x_rows = x_ptr + (tok * stride_x)[:, None, None]
        g, u = _gemv_loop(x_rows, w1_ptr, s1_ptr, w3_ptr, s3_ptr, w_off, s_off, K, stride_sq, True, X_KIND, ASM,
                          CHUNKED, PREFETCH, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + slot[:, None] * stride_h + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=(offs_n < N)[None, :])  # fmt: skip


@triton.jit
def _down_gemv_kernel(
    h_ptr, w2_ptr, s2_ptr, exp_ptr, pairs_ptr, rw_ptr, out_ptr,
    P, N, K, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_o,
    X_KIND: tl.constexpr, ASM: tl.constexpr, CHUNKED: tl.constexpr, PER_PAIR: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h [programs * BLOCK_T, K] (the gate/up kernel's, same slots); w2 [E, N, K/8] int32 and s2 scale words as in
    the gate/up kernel; rw [P] fp32 routing weights -> out [P, N] fp32: rw[pair] * (h[slot] @ w2^T) per real pair."""
    e, slot, pair, real = _slots(exp_ptr, pairs_ptr, P, PER_PAIR, BLOCK_T)
    if e >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        wrow = tl.minimum(offs_n, N - 1).to(tl.int64)
        w_off = (e * stride_we + wrow * stride_wn)[None, :, None]
        s_off = (e * stride_se + wrow * stride_sn)[None, :, None]
        h_rows = h_ptr + (slot * stride_h)[:, None, None]
        acc, _ = _gemv_loop(h_rows, w2_ptr, s2_ptr, w2_ptr, s2_ptr, w_off, s_off, K, stride_sq, False, X_KIND, ASM,
                            CHUNKED, PREFETCH, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip
        wt = tl.load(rw_ptr + pair, mask=real, other=0.0)
        op = out_ptr + tl.where(real, pair, 0).to(tl.int64)[:, None] * stride_o + offs_n[None, :]
        tl.store(op, acc * wt[:, None], mask=real[:, None] & (offs_n < N)[None, :])


def supports(d: int, inter: int, *packed: Tensor) -> bool:
    """Same word reads as the grouped kernels (`fp4_grouped.supports`): d and I multiples of 128, packed tensors
    viewable as int32."""
    return fp4_grouped.supports(d, inter, *packed)


_X_KINDS = {torch.bfloat16: _X_BF16, torch.float16: _X_F16, torch.float32: _X_F32}


def _block_k(k: int, want: int) -> int:
    bk = max(128, want)
    while k % bk:
        bk //= 2
    return bk


def aligned_rows(x: Tensor) -> bool:
    """Whether the kernels can read x [rows, K] as 16-byte vectors: unit column stride, 16-byte aligned rows."""
    size = x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and (x.stride(0) * size) % 16 == 0


def _common(x: Tensor, exp: Tensor, pairs: Tensor | None, block_t: int, asm: bool) -> dict:
    if pairs is None and block_t != 1:
        raise ValueError(f"fp4 gemv: one pair a program (pairs None) needs block_t 1, found {block_t}")
    if not aligned_rows(x):
        raise ValueError(
            f"fp4 gemv: activations {tuple(x.shape)} strides {tuple(x.stride())}: the kernels read 16-byte vectors; "
            "expected a unit column stride and 16-byte aligned rows (call .clone() first)"
        )
    return {"X_KIND": _X_KINDS[x.dtype], "ASM": asm, "PER_PAIR": pairs is None, "BLOCK_T": block_t}


def launch_gate_up(
    x: Tensor, w1: Tensor, w3: Tensor, s1: Tensor, s3: Tensor, exp: Tensor, pairs: Tensor | None, h: Tensor,
    topk: int, limit: float, block_t: int, block_n: int, block_k: int, num_warps: int, prefetch: bool, asm: bool,
    chunked: bool,
) -> None:  # fmt: skip
    """h [programs * block_t, I] (x's dtype) = clamped SwiGLU of the gate / up GEMVs of every slot; x [T, d] bf16 /
    fp16 / fp32 with a unit column stride. exp: ids [T * k] (pairs None, block_t 1: one pair a program) or the
    block experts of `align_pairs` (pairs its padded pair ids, block_t its block_m). asm: PTX loads and decode (GPU);
    else the portable path (the CPU interpreter). chunked: weights and scales in the chunked layout."""
    inter, d = w1.shape[1], x.shape[1]
    u1, u3 = w1.view(torch.int32), w3.view(torch.int32)
    v1, sse, ssn, ssq = fp4_grouped.scale_words(s1, chunked)
    v3, *strides3 = fp4_grouped.scale_words(s3, chunked)
    if strides3 != [sse, ssn, ssq]:
        raise ValueError(
            f"fp4 gemv gate/up: s1 and s3 strides differ: {(sse, ssn, ssq)} vs {tuple(strides3)}"
        )
    _gate_up_gemv_kernel[(exp.shape[0], -(-inter // block_n))](
        x, u1, u3, v1, v3, exp, exp if pairs is None else pairs, h,
        x.shape[0] * topk, inter, d, x.stride(0), u1.stride(0), u1.stride(1), sse, ssn, ssq, h.stride(0),
        float(limit),
        TOPK=topk, CLAMP=limit > 0, CHUNKED=chunked, PREFETCH=prefetch, BLOCK_N=block_n,
        BLOCK_K=_block_k(d, block_k), **_common(x, exp, pairs, block_t, asm), num_warps=num_warps, num_stages=1,
    )  # fmt: skip


def launch_down(
    h: Tensor, w2: Tensor, s2: Tensor, exp: Tensor, pairs: Tensor | None, rw: Tensor, rows: Tensor, block_t: int,
    block_n: int, block_k: int, num_warps: int, prefetch: bool, asm: bool, chunked: bool,
) -> None:  # fmt: skip
    """rows [P, d] fp32 = rw[pair] * (h[slot] @ w2^T) per pair; h, exp, pairs and block_t those of the gate/up
    launch; asm, chunked as there."""
    p, d = rows.shape
    inter = h.shape[1]
    u2 = w2.view(torch.int32)
    v2, sse, ssn, ssq = fp4_grouped.scale_words(s2, chunked)
    _down_gemv_kernel[(exp.shape[0], -(-d // block_n))](
        h, u2, v2, exp, exp if pairs is None else pairs, rw, rows,
        p, d, inter, h.stride(0), u2.stride(0), u2.stride(1), sse, ssn, ssq, rows.stride(0),
        CHUNKED=chunked, PREFETCH=prefetch, BLOCK_N=block_n, BLOCK_K=_block_k(inter, block_k),
        **_common(h, exp, pairs, block_t, asm), num_warps=num_warps, num_stages=1,
    )  # fmt: skip
