"""Triton backend of the routed experts over FP4 e2m1 weights (W4A16 decode path), with no host read.

Steps (all on the device):
1. permutation: the T*k (token, slot) pairs are sorted by expert (stable), and each expert's run is padded to a
   multiple of BLOCK_M rows; ``block_expert[b]`` names the expert of row block b (-1: unused block). The number
   of blocks is bounded by ``ceil(P / BLOCK_M) + min(E, P)`` (P = T*k), so grids never depend on expert counts.
2. gate/up grouped GEMM: per (row block, I tile) the w1 and w3 tiles are decoded from packed e2m1 + UE8M0 in
   registers, two fp32 accumulators, then the clamped SwiGLU ``silu(min(g, L)) * clamp(u, -L, L)`` is applied in
   the epilogue and h is stored once (x's dtype).
3. down grouped GEMM over h with w2 decoded the same way; the epilogue multiplies by the pair's routing weight
   and stores fp32 rows per pair.
4. combine: one elementwise kernel sums each token's k rows in slot order (deterministic), adds the caller's
   shared-expert output and stores the result in the caller's dtype (`combine_rows`: one launch instead of a
   torch sum, an add and a cast).

Both GEMMs compute the transposed product ``W_tile [BLOCK_N, K] @ A^T [K, BLOCK_M]`` ("swap AB"): at decode an
expert sees a handful of rows, so the weight rows fill the MMA's M side and the token rows its narrow N side.

The decode is where the time goes: the kernels are bandwidth-bound only if decoding a weight costs a few
instructions. On the GPU (variant "asm", bf16 / fp16 activations) 8 codes = one 32-bit word are decoded by a few
lines of inline PTX, two bf16 lanes per instruction, exact for every scale code (the comment at the PTX). The
portable variant "bits" (the CPU interpreter, fp32 activations with exact fp32 dots) moves a nibble ``s e1 e0 m`` to
bits 15 and 11..9 of a half word, which is the fp16 number ``value * 2^-14`` exactly (fp16 subnormals for e = 0),
converts it and puts the ``2^14`` back on the fp32 accumulator. The launch configs come from an H200 sweep
(``benchmarks/sweep_moe_fp4.py``, docs/perf.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2
from deepinfer_kernels.moe.fp4_gemv import triton as fp4_gemv
from deepinfer_kernels.moe.fp4_grouped import triton as fp4_grouped
from deepinfer_kernels.moe.reference import add_shared, wait_shared

__all__ = ["GemmConfig", "align_pairs", "combine_rows", "default_configs", "moe_experts_fp4"]

_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)
_TWO_POW_14 = tl.constexpr(16384.0)


@dataclass(frozen=True)
class GemmConfig:
    """Launch config of one grouped GEMM. ``variant``: "asm" (PTX decode; GPU, bf16 / fp16 activations) or
    "bits" (portable integer decode; the CPU interpreter and fp32 activations) decode whole K-ordered tiles;
    "grouped" / "grouped_exact" (PTX) and "grouped_bits" (portable) decode per 32-column scale group straight into
    the dot operand registers (`deepinfer_kernels.moe.fp4_grouped`; d and I multiples of 128, block_k a multiple
    of 128; "grouped" multiplies each weight pair once and redoes a tile exactly when a scale code is >= 128).
    "gemv" / "gemv_expert" run both GEMMs on the CUDA cores (`deepinfer_kernels.moe.fp4_gemv`; decode token
    counts; d and I multiples of 128; both configs of a call the same variant): "gemv" one program per (token, slot)
    pair, "gemv_expert" one per expert run of BLOCK_M slots (`align_pairs`; an expert's weights read once for all
    its tokens); for them num_stages 1 loads each K tile when it is computed, 2 loads the next one first (register
    prefetch). On the chunked layout (`moe.fp4_layout`) block_k must be a multiple of 128. ``max_regs``: a cap on
    the registers per thread (ptxas ``.maxnreg``; None: ptxas decides; ignored by the gemv variants), to fit more
    CTAs per SM."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    variant: str = "bits"
    max_regs: int | None = None

    def launch_options(self) -> dict:
        """Compile options of a launch: warps, stages and the register cap when set."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_regs is not None:
            opts["maxnreg"] = self.max_regs
        return opts


@triton.jit
def _e2m1_x2pow14(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed [BLOCK_N, BLOCK_K/2] uint8 (low nibble = even column) -> [BLOCK_N, BLOCK_K] fp32 = value * 2^-14."""
    pi = p.to(tl.int32)
    lo = ((pi & 7) << 9) | ((pi & 8) << 12)
    hi = ((pi & 0x70) << 5) | ((pi & 0x80) << 8)
    bits = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K]).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0(b):
    b = b.to(tl.int32)
    return tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))


# One 32-bit word of packed codes (8 nibbles, K order n0..n7 from the low bits) -> 8 bf16 weights. Each pair of
# nibbles 16 bits apart is moved as one bf16x2 word: magnitude bits to 6..8 and sign to 15 of each lane make
# value * 2^-126 (e = 0 lands on bf16 subnormals, which bf16 fma keeps), then two bf16x2 multiplies (fma adding -0,
# which sm_80 has) by 2^(min(b, 128) - 1) and 2^(max(b, 128) - 128) apply the UE8M0 scale 2^(b - 127) and the
# 2^126 exactly for every code b (one multiplier alone would overflow bf16 for b > 128).
def _e2m1x8_ptx() -> str:
    """The PTX of the comment above: one block per nibble pair (n_k, n_k+4), k = 0..3, whose magnitude bits sit
    at 4k..4k+2 (and +16) and go to 6..8, and whose sign bit 4k+3 (and +16) goes to 15."""
    lines = ["{", ".reg .b32 a, b, t, z;", "mov.b32 z, 0x80008000;"]
    for k in range(4):
        mag, sign = 6 - 4 * k, 12 - 4 * k  # left shifts (a negative magnitude shift is a right shift)
        lines.append(f"shl.b32 a, $8, {mag};" if mag > 0 else f"shr.b32 a, $8, {-mag};")
        if sign:
            lines.append(f"shl.b32 b, $8, {sign};")
        lines += [
            "lop3.b32 t, a, 0x01C001C0, 0, 0xC0;",  # magnitudes: a & mask
            f"lop3.b32 t, {'b' if sign else '$8'}, 0x80008000, t, 0xEA;",  # | signs & mask
            "fma.rn.bf16x2 t, t, $9, z;",
            "fma.rn.bf16x2 t, t, $10, z;",
            f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, t;",
        ]
    return "\n".join(["", *lines, "}", ""])


_E2M1X8_TO_BF16 = tl.constexpr(_e2m1x8_ptx())


@triton.jit
def _per_word(m, CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 bits per 32-code scale group, [BLOCK_N, BLOCK_K/32] (CHUNKED: [BLOCK_N, BLOCK_K/128, 4]) -> the bf16x2
    word (both lanes) of every 8-code word of its group, [BLOCK_N, BLOCK_K/8] int32 in stored word order (CHUNKED:
    word 4c + g of a chunk belongs to group g; else words 4g .. 4g + 3)."""
    m2 = m | (m << 16)
    if CHUNKED:  # m [BLOCK_N, BLOCK_K/128, 4 (g)]; one return (a static if still traces what follows it)
        w = tl.reshape(tl.broadcast_to(m2[:, :, None, :], [BLOCK_N, BLOCK_K // 128, 4, 4]), [BLOCK_N, BLOCK_K // 8])
    else:
        w = tl.reshape(tl.broadcast_to(m2[:, :, None], [BLOCK_N, BLOCK_K // 32, 4]), [BLOCK_N, BLOCK_K // 8])
    return w


@triton.jit
def _chunked_col(k):
    """Position k of a row in the chunked layout's word order (word 4c + g of a 128-column chunk holds columns
    8(4g + c) .. +7) -> the natural column it holds (elementwise on int tensors; `moe.fp4_layout`)."""
    # divisions and remainders by powers of two only: Triton's axis analysis then still sees runs of 8 contiguous
    # columns (16-byte activation loads, pipelined as cp.async)
    return (k // 128) * 128 + ((k // 8) % 4) * 32 + ((k // 32) % 4) * 8 + k % 8


@triton.jit
def _e2m1_words_bf16(w, sb, CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed words [BLOCK_N, BLOCK_K/8] int32 + scale codes [BLOCK_N, BLOCK_K/32] uint8 in group order (CHUNKED:
    the scale words [BLOCK_N, BLOCK_K/128] int32, 4 groups each) -> [BLOCK_N, BLOCK_K] bf16 exact weights in
    stored column order (GPU only: inline PTX)."""
    if CHUNKED:  # codes [BLOCK_N, BLOCK_K/128, 4] straight from the words, without a reshape
        b = _word_codes(sb)
    else:
        b = sb.to(tl.int32)
    m1 = _per_word((tl.minimum(b, 128) + 126) << 7, CHUNKED, BLOCK_N, BLOCK_K)
    m2 = _per_word((tl.maximum(b, 128) - 1) << 7, CHUNKED, BLOCK_N, BLOCK_K)
    n0, n4, n1, n5, n2, n6, n3, n7 = tl.inline_asm_elementwise(
        _E2M1X8_TO_BF16,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
        [w, m1, m2],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    even = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    odd = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])


@triton.jit
def _a_cols(offs_k, CHUNKED: tl.constexpr):
    """Columns of the activations that meet the weight tile's stored column order."""
    if CHUNKED:
        return _chunked_col(offs_k)
    return offs_k


@triton.jit
def _scale_cols(k0, stride_sq, CHUNKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offsets, mask columns) of the tile's scales inside a row: the checkpoint layout's bytes (one per group);
    the chunked layout's 32-bit words (4 groups a word, chunks stride_sq words apart), which the pipeline copies
    asynchronously (a single byte per row and group it cannot) and the decode splits."""
    if CHUNKED:  # one return: the two branches' shapes differ
        kq = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        offs = kq * stride_sq
        cols = kq * 128
    else:
        offs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        cols = offs * 32
    return offs, cols


@triton.jit
def _word_codes(sw):
    """Scale words [BLOCK_N, BLOCK_K/128] int32 -> codes [BLOCK_N, BLOCK_K/128, 4 (group)] int32 (byte g of a
    chunk's word is its group g)."""
    return (sw[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255


@triton.jit
def _fp4_dot(
    acc,
    a,
    w_ptrs,
    s_ptrs,
    mask,
    s_mask,
    VARIANT: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN: tl.constexpr,
    CHUNKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] += W [BLOCK_N, BLOCK_K] @ a^T, a [BLOCK_M, BLOCK_K]. "bits" leaves the result
    scaled by 2^-14 (the caller multiplies once at the end); "asm" is exact. w_ptrs address bytes
    [BLOCK_N, BLOCK_K/2], or int32 words [BLOCK_N, BLOCK_K/8] for "asm", in stored order; s_ptrs the scale codes
    [BLOCK_N, BLOCK_K/32] in group order. CHUNKED: the weights are in the chunked layout (`moe.fp4_layout`), so
    the tile's columns come out in its word order and a must be loaded in that order (`_chunked_col`); s_ptrs
    then address the scale words [BLOCK_N, BLOCK_K/128]."""
    if EVEN:  # the tile lies inside the weight: unmasked loads save the per-element predicates
        p = tl.load(w_ptrs)
        sb = tl.load(s_ptrs)
    else:
        p = tl.load(w_ptrs, mask=mask, other=0)
        sb = tl.load(s_ptrs, mask=s_mask, other=127)  # masked weights are 0: any finite scale
    if VARIANT == "asm":
        acc = tl.dot(_e2m1_words_bf16(p, sb, CHUNKED, BLOCK_N, BLOCK_K), tl.trans(a.to(tl.bfloat16)), acc)
    else:
        v = _e2m1_x2pow14(p, BLOCK_N, BLOCK_K)
        if CHUNKED:  # stored order: chunk, c, g, 8 columns; the scale depends on (chunk, g)
            sc = _e8m0(_word_codes(sb))[:, :, None, :, None]
            w = tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_K // 128, 4, 4, 8]) * sc, [BLOCK_N, BLOCK_K])
        else:
            w = tl.reshape(
                tl.reshape(v, [BLOCK_N, BLOCK_K // 32, 32]) * _e8m0(sb)[:, :, None], [BLOCK_N, BLOCK_K]
            )
        if DOT_F32:
            acc = tl.dot(w, tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16)), acc)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pairs_ptr, bexp_ptr, h_ptr,
    P, N, K, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_h, limit,
    TOPK: tl.constexpr, CLAMP: tl.constexpr, DOT_F32: tl.constexpr, VARIANT: tl.constexpr, PACK: tl.constexpr,
    EVEN: tl.constexpr, CHUNKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
        g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + tok[:, None] * stride_x + _a_cols(offs_k, CHUNKED)[None, :],
                mask=r_mask[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            kb = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            sk, sc = _scale_cols(k0, stride_sq, CHUNKED, BLOCK_K)
            sk = sk[None, :]
            wm = n_mask[:, None] & (kb[None, :] * PACK < K)
            sm = n_mask[:, None] & (sc[None, :] < K)
            g = _fp4_dot(g, a, w1_ptr + w_off + kb[None, :], s1_ptr + s_off + sk, wm, sm,
                         VARIANT, DOT_F32, EVEN, CHUNKED, BLOCK_N, BLOCK_K)  # fmt: skip
            u = _fp4_dot(u, a, w3_ptr + w_off + kb[None, :], s3_ptr + s_off + sk, wm, sm,
                         VARIANT, DOT_F32, EVEN, CHUNKED, BLOCK_N, BLOCK_K)  # fmt: skip
        if VARIANT == "bits":
            g = g * _TWO_POW_14
            u = u * _TWO_POW_14
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        hrow = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        hp = h_ptr + hrow[None, :] * stride_h + offs_n[:, None]
        tl.store(hp, h.to(h_ptr.dtype.element_ty), mask=n_mask[:, None])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, s2_ptr, pairs_ptr, bexp_ptr, rw_ptr, out_ptr,
    P, N, K, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_o,
    DOT_F32: tl.constexpr, VARIANT: tl.constexpr, PACK: tl.constexpr, EVEN: tl.constexpr, CHUNKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                h_ptr + hrow[:, None] * stride_h + _a_cols(offs_k, CHUNKED)[None, :],
                mask=r_mask[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            kb = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            sk, sc = _scale_cols(k0, stride_sq, CHUNKED, BLOCK_K)
            acc = _fp4_dot(acc, a, w2_ptr + w_off + kb[None, :], s2_ptr + s_off + sk[None, :],
                           n_mask[:, None] & (kb[None, :] * PACK < K), n_mask[:, None] & (sc[None, :] < K),
                           VARIANT, DOT_F32, EVEN, CHUNKED, BLOCK_N, BLOCK_K)  # fmt: skip
        if VARIANT == "bits":
            acc = acc * _TWO_POW_14
        wt = tl.load(rw_ptr + rows, mask=r_mask, other=0.0)
        op = out_ptr + tl.where(r_mask, rows, 0)[None, :].to(tl.int64) * stride_o + offs_n[:, None]
        tl.store(op, acc * wt[None, :], mask=r_mask[None, :] & n_mask[:, None])


# Decode-size batches (P = T * k pairs up to this) are permuted by one single-program kernel instead of ~20 torch
# kernels: at B = 1 those launches cost more than the permutation itself. Larger P (prefill) keeps the torch form.
ALIGN_KERNEL_MAX_PAIRS = 2048


@triton.jit(do_not_specialize=["P", "E", "NB"])
def _align_pairs_kernel(
    ids_ptr, pairs_ptr, bexp_ptr, scratch_ptr, P, E, NB,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: counting sort of the P expert ids (stable), padded per expert to BLOCK_M rows. scratch
    [2 * BLOCK_E] int32 carries per-expert values between the program's threads (global memory + barrier)."""
    offs = tl.arange(0, BLOCK_P)
    valid = offs < P
    # padding pairs take the last bin (E < BLOCK_E) so they sort behind every real pair and are not counted
    e = tl.load(ids_ptr + offs, mask=valid, other=BLOCK_E - 1).to(tl.int32)
    eo = tl.arange(0, BLOCK_E)
    counts = tl.where(eo < E, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, 0)
    # pair of sorted rank j with expert x goes to row pstart[x] + (j - cstart[x])
    tl.store(scratch_ptr + eo, pend - padded - (tl.cumsum(counts, 0) - counts))
    tl.store(scratch_ptr + BLOCK_E + eo, tl.where(eo < E, pend, 2147483647))
    for r0 in range(0, NB * BLOCK_M, BLOCK_P):
        r = r0 + offs
        tl.store(pairs_ptr + r, tl.zeros([BLOCK_P], dtype=tl.int32) + P, mask=r < NB * BLOCK_M)
    tl.debug_barrier()
    key = tl.sort(e * BLOCK_P + offs)  # unique keys: sorted by expert, then by pair id (stable)
    se = key // BLOCK_P
    shift = tl.load(scratch_ptr + se, mask=valid, other=0)
    tl.store(pairs_ptr + shift + offs, key % BLOCK_P, mask=valid)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # expert of row block b = number of experts whose padded run ends at or before the block's first row:
        # a branchless binary search over the non-decreasing run ends (INT_MAX past E)
        x = tl.zeros([BLOCK_B], dtype=tl.int32)
        for i in tl.static_range(LOG_E):
            cand = x + (BLOCK_E >> (i + 1))
            x = tl.where(tl.load(scratch_ptr + BLOCK_E + cand - 1) <= b * BLOCK_M, cand, x)
        tl.store(bexp_ptr + b, tl.where(x < E, x, -1), mask=b < NB)


def _align_pairs_torch(flat: Tensor, num_experts: int, block_m: int, nblocks: int) -> tuple[Tensor, Tensor]:
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
    pairs = torch.full((nblocks * block_m,), p, dtype=torch.int32, device=dev)
    pairs[pos] = order.to(torch.int32)
    starts = torch.arange(nblocks, device=dev) * block_m
    be = torch.searchsorted(pend, starts, right=True)
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    return pairs, block_expert


def align_pairs(ids: Tensor, num_experts: int, block_m: int, *, use_kernel: bool | None = None
                ) -> tuple[Tensor, Tensor]:
    """ids [T, k] -> (pairs [B * block_m] int32: pair id t*k+j per padded row, P for padding;
    block_expert [B] int32: expert of each row block, -1 unused), B = ceil(P/block_m) + min(E, P). Device ops
    only (no host read: torch.bincount would read the max back, so counts come from scatter_add).
    use_kernel: None = the single-program kernel up to ALIGN_KERNEL_MAX_PAIRS pairs, else the torch form (both
    give identical tensors)."""
    flat = ids.reshape(-1)
    p = flat.numel()
    nblocks = cdiv(p, block_m) + min(num_experts, p)
    if use_kernel is None:
        use_kernel = 0 < p <= ALIGN_KERNEL_MAX_PAIRS
    if not use_kernel:
        return _align_pairs_torch(flat, num_experts, block_m, nblocks)
    block_e = next_pow2(num_experts + 1)
    dev = flat.device
    pairs = torch.empty(nblocks * block_m, dtype=torch.int32, device=dev)
    bexp = torch.empty(nblocks, dtype=torch.int32, device=dev)
    scratch = torch.empty(2 * block_e, dtype=torch.int32, device=dev)
    _align_pairs_kernel[(1,)](
        flat, pairs, bexp, scratch, p, num_experts, nblocks,
        BLOCK_M=block_m, BLOCK_P=max(16, next_pow2(p)), BLOCK_E=block_e, LOG_E=block_e.bit_length() - 1,
        BLOCK_B=256,
        num_warps=4,
    )  # fmt: skip
    return pairs, bexp


# Whether the GPU configs use the per-scale-group kernels ("grouped", docs/moe_fp4_kernel.md) instead of the
# swept "asm" tiles. Off until an H200 sweep (benchmarks/sweep_moe_fp4.py) shows them faster.
GROUPED_DEFAULT = True
# Below this many routed pairs the tile kernels ("asm") stay faster: H200 sweep 2026-12-02 (docs/perf.md "FP4 expert
# kernels, grouped vs tile"): at T = 1 (6 pairs) grouped was 0.75x / 0.82x (gate/up / down), at T = 8 (48 pairs)
# 1.06x / 1.12x, at T = 64 and 256 1.09-1.12x.
GROUPED_MIN_PAIRS = 48
# Whether decode token counts on the chunked layout take the CUDA-core gemv kernels (`fp4_gemv`): rows (max routed
# pairs, BLOCK_M, gate/up, down), the first row whose bound holds applies, above the last the grouped kernels run
# (the cut-off). H200 sweep 2026-12-02 09:47 UTC (`sweep_moe_fp4.py --gemv --quick`, docs/moe_fp4_kernel.md "H200
# sweep"): whole path 98 vs 162 us at T = 1, 118 vs 218 at T = 2, 214 vs 237 at T = 4; 394 vs 353 at T = 8 (grouped).
GEMV_DEFAULT = True
GEMV_TILES: tuple[tuple[int, int, GemmConfig, GemmConfig], ...] = (
    (6, 1, GemmConfig(64, 256, 8, 2, "gemv"), GemmConfig(32, 256, 4, 2, "gemv")),  # T = 1 at top-6
    (12, 1, GemmConfig(32, 256, 4, 2, "gemv"), GemmConfig(32, 512, 4, 2, "gemv")),  # T = 2
    (24, 1, GemmConfig(32, 256, 4, 2, "gemv"), GemmConfig(32, 256, 2, 2, "gemv")),  # T = 3, 4
)


def default_configs(
    pairs: int, interpreted: bool, fp32: bool, grouped: bool = GROUPED_DEFAULT, chunked: bool = False,
    gemv: bool = GEMV_DEFAULT,
) -> tuple[int, GemmConfig, GemmConfig]:
    """(BLOCK_M, gate/up config, down config) for P = T * k routed pairs. GPU configs: the best of the H200 sweep
    at T = 1 and 64 (docs/perf.md "FP4 expert kernels"); fp32 activations keep the exact fp32-dot "bits" path.
    grouped: bf16 / fp16 activations with at least GROUPED_MIN_PAIRS pairs take the per-scale-group kernels (the
    caller checks `fp4_grouped.supports`). chunked: the weights are in the chunked layout (`moe.fp4_layout`),
    whose tiles span whole 128-column chunks. gemv: on the chunked layout pair counts within GEMV_TILES take the
    CUDA-core kernels with that table's tiles (the caller checks `fp4_gemv.supports`)."""
    if gemv and chunked and not interpreted:
        for max_pairs, bm, up, down in GEMV_TILES:
            if pairs <= max_pairs:
                return bm, up, down
    if interpreted:
        bk = 128 if chunked else 32
        return 16, GemmConfig(16, bk, 4, 1, "bits"), GemmConfig(16, bk, 4, 1, "bits")
    block_m = 16 if pairs < 4096 else 64
    if grouped and not fp32 and chunked:
        # chunked layout, H200 sweep 2026-12-02 06:19 UTC (docs/perf.md "FP4 experts on the chunked layout"): the
        # grouped kernels win at every T there; 64 x 256 gate/up tiles from T = 8 (243 vs 258 us at T = 8, 1,174 vs
        # 1,276 at 64), and at T = 1 64 x 128 gate/up + 128 x 256 down (63 + 25 us against the tiles' 73 + 46)
        if pairs >= GROUPED_MIN_PAIRS:
            return block_m, GemmConfig(64, 256, 4, 3, "grouped"), GemmConfig(64, 256, 4, 3, "grouped")
        return block_m, GemmConfig(64, 128, 4, 4, "grouped"), GemmConfig(128, 256, 8, 3, "grouped")
    if grouped and not fp32 and pairs >= GROUPED_MIN_PAIRS:  # the sweep's best grouped tiles at T = 8 .. 256
        return block_m, GemmConfig(64, 128, 4, 4, "grouped"), GemmConfig(64, 256, 4, 3, "grouped")
    variant = "bits" if fp32 else "asm"
    up = GemmConfig(64, 128, 4, 3, variant)
    down = GemmConfig(64, 128, 4, 3, variant) if pairs >= 64 else GemmConfig(128, 256, 8, 3, variant)
    return block_m, up, down


def _decode(cfg: GemmConfig, dot_f32: bool) -> str:
    """Decode of a grouped config: the portable one for "grouped_bits" or fp32 dots, else PTX ("grouped": one
    multiply per weight pair with an exact redo of tiles holding a scale code >= 128; "grouped_exact": two)."""
    if dot_f32 or cfg.variant == "grouped_bits":
        return "bits"
    return "exact" if cfg.variant == "grouped_exact" else "fast"


def _tile_scales(s: Tensor, chunked: bool) -> tuple[Tensor, int, int, int]:
    """Scales -> (the tile kernels' view, strides of an expert, a row and a 128-column chunk in its elements):
    bytes in the checkpoint layout, 32-bit words (4 groups) in the chunked one."""
    if chunked:
        return fp4_grouped.scale_words(s, True)
    return s.view(torch.uint8), s.stride(0), s.stride(1), 4


def _check_chunked(cfg: GemmConfig, chunked: bool) -> None:
    if chunked and not cfg.variant.startswith("grouped") and cfg.block_k % 128:
        raise ValueError(
            f"moe_experts_fp4: block_k {cfg.block_k} with the chunked layout; expected a multiple of 128 (a tile "
            "spans whole 128-column chunks)"
        )


def _packed(cfg: GemmConfig, *ws: Tensor) -> tuple:
    """(K elements per addressed unit, the packed weights viewed as bytes or, for "asm", as int32 words)."""
    if cfg.variant == "asm":
        return (8, *(w.view(torch.int32) for w in ws))
    return (2, *(w.view(torch.uint8) for w in ws))


def launch_gate_up(
    x: Tensor,
    w1: Tensor,
    w3: Tensor,
    s1: Tensor,
    s3: Tensor,
    pairs: Tensor,
    bexp: Tensor,
    h: Tensor,
    topk: int,
    limit: float,
    block_m: int,
    cfg: GemmConfig,
    dot_f32: bool,
    h_perm: bool = False,
    chunked: bool = False,
) -> None:
    """h [B * block_m, I] (x's dtype) = clamped SwiGLU of the gate / up projections of every padded row. h_perm:
    store h in the column order the "grouped" down kernel reads (grouped gate/up configs only). chunked: weights
    and scales in the chunked layout (`moe.fp4_layout`), else the checkpoint's."""  # fmt: skip
    _check_chunked(cfg, chunked)
    if cfg.variant.startswith("grouped"):
        fp4_grouped.launch_gate_up(
            x, w1, w3, s1, s3, pairs, bexp, h, topk, limit, block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
            cfg.num_stages, _decode(cfg, dot_f32), h_perm, chunked, cfg.max_regs,
        )  # fmt: skip
        return
    if h_perm:
        raise ValueError(f"launch_gate_up: h_perm needs a grouped config, found variant {cfg.variant!r}")
    p = x.shape[0] * topk
    inter, d = w1.shape[1], x.shape[1]
    pack, u1, u3 = _packed(cfg, w1, w3)
    b1, sse, ssn, ssq = _tile_scales(s1, chunked)
    b3, *strides3 = _tile_scales(s3, chunked)
    if strides3 != [sse, ssn, ssq]:
        raise ValueError(f"launch_gate_up: s1 and s3 strides differ: {(sse, ssn, ssq)} vs {tuple(strides3)}")
    _gate_up_kernel[(bexp.shape[0], cdiv(inter, cfg.block_n))](
        x, u1, u3, b1, b3, pairs, bexp, h,
        p, inter, d, x.stride(0), u1.stride(0), u1.stride(1), sse, ssn, ssq, h.stride(0),
        float(limit),
        TOPK=topk, CLAMP=limit > 0, DOT_F32=dot_f32, VARIANT=cfg.variant, PACK=pack,
        EVEN=inter % cfg.block_n == 0 and d % cfg.block_k == 0, CHUNKED=chunked, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, **cfg.launch_options(),
    )  # fmt: skip


def launch_down(
    h: Tensor,
    w2: Tensor,
    s2: Tensor,
    pairs: Tensor,
    bexp: Tensor,
    rw: Tensor,
    rows: Tensor,
    block_m: int,
    cfg: GemmConfig,
    dot_f32: bool,
    chunked: bool = False,
) -> None:
    """rows [P, d] fp32 = routing weight * (h @ w2^T) per pair. A "grouped" config reads h in the permuted column
    order (`launch_gate_up(h_perm=True)`). chunked: as in `launch_gate_up`."""  # fmt: skip
    _check_chunked(cfg, chunked)
    if cfg.variant.startswith("grouped"):
        fp4_grouped.launch_down(
            h, w2, s2, pairs, bexp, rw, rows, block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
            _decode(cfg, dot_f32), chunked, cfg.max_regs,
        )  # fmt: skip
        return
    p, d = rows.shape
    inter = h.shape[1]
    pack, u2 = _packed(cfg, w2)
    b2, sse, ssn, ssq = _tile_scales(s2, chunked)
    _down_kernel[(bexp.shape[0], cdiv(d, cfg.block_n))](
        h, u2, b2, pairs, bexp, rw, rows,
        p, d, inter, h.stride(0), u2.stride(0), u2.stride(1), sse, ssn, ssq, rows.stride(0),
        DOT_F32=dot_f32, VARIANT=cfg.variant, PACK=pack, EVEN=d % cfg.block_n == 0 and inter % cfg.block_k == 0,
        CHUNKED=chunked, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options(),
    )  # fmt: skip


@triton.jit  # d and the strides specialize: multiples of 16 give vector loads
def _combine_kernel(rows_ptr, shared_ptr, out_ptr, D, stride_s, stride_o, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < D
    base = rows_ptr + t * K * D + offs
    acc = tl.load(base, mask=m, other=0.0)
    for j in tl.static_range(1, K):
        acc += tl.load(base + j * D, mask=m, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_s + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


_COMBINE_BLOCK = 512  # d 5120 -> 10 programs a token: enough to spread a B = 1 step over a few SMs


def combine_rows(rows: Tensor, topk: int, shared: Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> Tensor:
    """rows [T * k, d] fp32 contiguous (token-major pairs) -> [T, d] out_dtype (None: fp32): Σ_j rows[t * k + j]
    in slot order, + shared [T, d] (bf16 / fp16 / fp32, unit column stride) upcast to fp32 when given, then one
    rounding to out_dtype (`reference.combine_rows`, up to the order of the k-sum)."""
    p, d = rows.shape
    t = p // topk
    out = torch.empty((t, d), dtype=out_dtype or torch.float32, device=rows.device)
    if t == 0 or d == 0:
        return out
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    check_launchable("combine_rows", _combine_kernel, rows, *(() if shared is None else (shared,)))
    _combine_kernel[(t, cdiv(d, _COMBINE_BLOCK))](
        rows, rows if shared is None else shared, out, d, 0 if shared is None else shared.stride(0), out.stride(0),
        K=topk, HAS_SHARED=shared is not None, BLOCK=_COMBINE_BLOCK, num_warps=4,
    )  # fmt: skip
    return out


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
    configs: tuple[int, GemmConfig, GemmConfig] | None = None,
    *,
    chunked: bool = False,
    shared: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    shared_ready: torch.cuda.Event | None = None,
) -> Tensor:
    """x [T, d]; weights [T, k] fp32; ids [T, k] int64; w1 / w3 [E, I, d/2] int8, w2 [E, d, I/2] int8; scales
    [E, I, d/32] / [E, d, I/32] e8m0 -> [T, d] out_dtype (None: fp32) = Σ_k weight * expert(x) (+ shared [T, d],
    added in fp32 before the one rounding, when given). Validated by the dispatcher.
    configs: (BLOCK_M, gate/up, down) instead of `default_configs` (tests, sweeps); grouped configs need d and I
    multiples of 128 and fall back to the default tiles otherwise. chunked: weights and scales in the chunked
    layout (`moe.fp4_layout`; d and I multiples of 128), else the checkpoint's. shared_ready: as `moe_experts`."""
    t, d = x.shape
    k = ids.shape[1]
    e_count, inter = w1.shape[0], w1.shape[1]
    p = t * k
    if p == 0:
        wait_shared(shared_ready)
        return add_shared(torch.zeros((t, d), dtype=torch.float32, device=x.device), shared, out_dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    interp = check_launchable("moe_experts", _gate_up_kernel, x, w1, w3, w2)
    dot_f32 = interp or x.dtype == torch.float32
    block_m, cfg_up, cfg_down = configs or default_configs(p, interp, dot_f32, chunked=chunked)
    if "gemv" in cfg_up.variant + cfg_down.variant:
        if cfg_up.variant != cfg_down.variant:
            raise ValueError(
                f"moe_experts_fp4: gemv variants {cfg_up.variant!r} / {cfg_down.variant!r}; expected the same variant "
                "for both GEMMs (they share the slots of h)"
            )
        if fp4_gemv.supports(d, inter, w1, w3, w2, s1, s3, s2):
            return _gemv_experts(x, weights, ids, (w1, w3, w2, s1, s3, s2), limit, block_m, cfg_up, cfg_down,
                                 not interp, chunked, shared, out_dtype, shared_ready)  # fmt: skip
        block_m, cfg_up, cfg_down = default_configs(p, interp, dot_f32, chunked=chunked, gemv=False)
    grouped = "grouped" in cfg_up.variant + cfg_down.variant
    if grouped and not fp4_grouped.supports(d, inter, w1, w3, w2, s1, s3, s2):
        block_m, cfg_up, cfg_down = default_configs(p, interp, dot_f32, grouped=False, chunked=chunked)
    pairs, bexp = align_pairs(ids, e_count, block_m)
    h = torch.empty((bexp.shape[0] * block_m, inter), dtype=x.dtype, device=x.device)
    h_perm = cfg_down.variant.startswith("grouped")
    launch_gate_up(x, w1, w3, s1, s3, pairs, bexp, h, k, limit, block_m, cfg_up, dot_f32, h_perm, chunked)
    rows = torch.empty((p, d), dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    launch_down(h, w2, s2, pairs, bexp, rw, rows, block_m, cfg_down, dot_f32, chunked)
    wait_shared(shared_ready)
    return combine_rows(rows, k, shared, out_dtype)


def _gemv_experts(
    x: Tensor, weights: Tensor, ids: Tensor, packed: tuple[Tensor, ...], limit: float, block_m: int,
    cfg_up: GemmConfig, cfg_down: GemmConfig, asm: bool, chunked: bool, shared: Tensor | None,
    out_dtype: torch.dtype | None, shared_ready: torch.cuda.Event | None = None,
) -> Tensor:  # fmt: skip
    """`moe_experts_fp4` on the CUDA-core kernels (`fp4_gemv`): "gemv" one program per pair, the expert read from
    ids (no permutation); "gemv_expert" one per row block of `align_pairs` with block_m slots."""
    w1, w3, w2, s1, s3, s2 = packed
    t, d = x.shape
    k = ids.shape[1]
    if not fp4_gemv.aligned_rows(x):
        x = x.clone()
    if cfg_up.variant == "gemv":
        exp, pairs, block_t = ids.reshape(-1), None, 1
    else:
        block_t = block_m
        pairs, exp = align_pairs(ids, w1.shape[0], block_t)
    h = torch.empty((exp.shape[0] * block_t, w1.shape[1]), dtype=x.dtype, device=x.device)
    fp4_gemv.launch_gate_up(x, w1, w3, s1, s3, exp, pairs, h, k, limit, block_t, cfg_up.block_n, cfg_up.block_k,
                            cfg_up.num_warps, cfg_up.num_stages > 1, asm, chunked)  # fmt: skip
    rows = torch.empty((t * k, d), dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    fp4_gemv.launch_down(h, w2, s2, exp, pairs, rw, rows, block_t, cfg_down.block_n, cfg_down.block_k,
                         cfg_down.num_warps, cfg_down.num_stages > 1, asm, chunked)  # fmt: skip
    wait_shared(shared_ready)
    return combine_rows(rows, k, shared, out_dtype)
