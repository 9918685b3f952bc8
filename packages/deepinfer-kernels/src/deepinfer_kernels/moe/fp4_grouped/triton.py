"""FP4 routed-expert GEMMs decoded per 32-column scale group, straight into the tensor-core operand registers.

Variant "grouped" of `deepinfer_kernels.moe.triton` (docs/moe_fp4_kernel.md). The older kernels decode a whole
[BLOCK_N, BLOCK_K] weight tile in K order and then let Triton convert it to the wgmma register-operand layout, which
it does through shared memory (stores, ldmatrix and a barrier per slice). Here the K order inside each dot is chosen
so that the decoded registers already are that layout:

* one 32-bit word of packed codes holds 8 consecutive weights ``8c .. 8c+7`` of a row (c = 0..3 inside a 32-column
  scale group); its PTX decode gives four bf16 pairs ``(8c+m, 8c+m+4)``, m = 0..3;
* the group's 32 columns become two K = 16 dots: "even" takes pairs m = 0, 2, "odd" pairs m = 1, 3. In dot order
  ``v = 2c + j + 8h`` (the wgmma A fragment: lane c of a quad holds v = 2c, 2c+1 and 2c+8, 2c+9) the weight column is
  ``8c + 4j + 2h + s`` (s = 0 even, 1 odd), so every pair sits in the register the fragment wants;
* the activations are fed in the same order: ``permute_columns`` lays out every 32 columns as ``16s + 8h + 2c + j``
  (one small copy of x per call; the gate/up kernel stores h in that order directly for the down kernel).

The scale of a (row, group) is one byte, read as part of a 32-bit word of four groups, so one scale load per row
and 128 columns, and the per-group multipliers are computed per row (a slice of the tile layout: no data movement).
The portable decode (DECODE "bits", the CPU interpreter) runs the same tiling with an integer decode and fp32 dots.

CHUNKED: the weights are in the chunked layout of `moe.fp4_layout` (word c of group g of a 128-column chunk at 4c + g,
scale words chunk-major). A lane then copies word c of all four groups as one 16-byte vector and a warp whole rows,
instead of 8-byte copies of half sectors; the chunk is loaded as one [BLOCK_N, 16] tile and split in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels.wgmma_frag.triton import any_nan, cat_k, dot_order

__all__ = ["launch_down", "launch_gate_up", "permute_columns", "scale_words", "supports"]

_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)


def permute_columns(x: Tensor) -> Tensor:
    """x [T, K] (K % 32 == 0) -> [T, K] with each 32 columns in dot order: position 16s + 8h + 2c + j holds column
    8c + 4j + 2h + s of the group (a copy)."""
    t, k = x.shape
    return x.reshape(t, k // 32, 4, 2, 2, 2).permute(0, 1, 5, 4, 2, 3).reshape(t, k)


@triton.jit
def permuted_column(n):
    """Column n of a row -> its position in the dot order of `permute_columns` (elementwise on int tensors)."""
    q = n % 32
    return n - q + (q & 1) * 16 + ((q >> 1) & 1) * 8 + (q >> 3) * 2 + ((q >> 2) & 1)


# One 32-bit word (8 codes, column 8c + m at bits 4m..4m+3) -> 4 bf16 pairs (m, m + 4), m = 0..3: magnitude bits
# to 6..8 and sign to 15 of each lane make value * 2^-126 (e = 0 lands on bf16 subnormals, which bf16 fma keeps).
# Exact form: two bf16x2 multiplies by 2^(min(b, 128) - 1) and 2^(max(b, 128) - 128) apply the UE8M0 scale
# 2^(b - 127) and the 2^126 for every code b (one multiplier alone overflows bf16 for b > 128). Fast form: one
# multiply by 2^(b - 1), exact for b <= 128 (|weight| <= 12; a larger code gives an infinite multiplier, and the
# kernels redo that tile with the exact form).
def _word_ptx(exact: bool) -> str:
    lines = ["{", ".reg .b32 a, b, t, z;", "mov.b32 z, 0x80008000;"]
    for m in range(4):
        mag, sign = 6 - 4 * m, 12 - 4 * m
        lines.append(f"shl.b32 a, $8, {mag};" if mag > 0 else f"shr.b32 a, $8, {-mag};")
        if sign:
            lines.append(f"shl.b32 b, $8, {sign};")
        lines += [
            "lop3.b32 t, a, 0x01C001C0, 0, 0xC0;",
            f"lop3.b32 t, {'b' if sign else '$8'}, 0x80008000, t, 0xEA;",
            "fma.rn.bf16x2 t, t, $9, z;",
        ]
        if exact:
            lines.append("fma.rn.bf16x2 t, t, $10, z;")
        lines.append(f"mov.b32 {{${2 * m}, ${2 * m + 1}}}, t;")
    return "\n".join(["", *lines, "}", ""])


_WORD_EXACT = tl.constexpr(_word_ptx(True))
_WORD_FAST = tl.constexpr(_word_ptx(False))

# Scale word (codes b0..b3 of 4 groups) -> the fast multiplier 2^(min(b_i, 129) - 1) of each group as a bf16x2
# word: the codes in 16-bit lanes, min 129, then (c + 126) << 7 is the bf16 of 2^(c - 1) (exact for c <= 128; c =
# 129 gives infinity, on purpose: see _non_finite) and one byte permute copies a lane to both lanes.
_FAST_MULTIPLIERS = tl.constexpr(
    """
{
.reg .b32 lo, hi, cap;
mov.b32 cap, 0x00810081;
and.b32 lo, $4, 0x00FF00FF;
shr.b32 hi, $4, 8;
and.b32 hi, hi, 0x00FF00FF;
min.u16x2 lo, lo, cap;
min.u16x2 hi, hi, cap;
mad.lo.u32 lo, lo, 128, 0x3F003F00;
mad.lo.u32 hi, hi, 128, 0x3F003F00;
prmt.b32 $0, lo, 0, 0x1010;
prmt.b32 $1, hi, 0, 0x1010;
prmt.b32 $2, lo, 0, 0x3232;
prmt.b32 $3, hi, 0, 0x3232;
}
"""
)


@triton.jit
def _exact_multipliers(sw, i: tl.constexpr):
    """Scale word [BLOCK_N] int32 (4 groups) -> the two bf16x2 multipliers of group i (both lanes), [BLOCK_N]."""
    b = (sw >> (8 * i)) & 255
    m1 = (tl.minimum(b, 128) + 126) << 7
    m2 = (tl.maximum(b, 128) - 1) << 7
    return m1 | (m1 << 16), m2 | (m2 << 16)


@triton.jit
def _e8m0_f32(sw, i: tl.constexpr):
    b = (sw >> (8 * i)) & 255
    return tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def _nibble_f32(w, m: tl.constexpr):
    """Code at bits 4m..4m+3 of every word -> its e2m1 value (fp32, exact): s e1 e0 m to fp16 bits 15 and 11..9
    is value * 2^-14 (fp16 subnormals for e = 0)."""
    c = w >> (4 * m)
    bits = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _group_tile(w, sw, m, i: tl.constexpr, DECODE: tl.constexpr, FAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """One scale group: w [BLOCK_N, 4] int32 codes, sw [BLOCK_N] int32 scale word (this group is byte i), m its
    fast multiplier [BLOCK_N] (FAST) -> [BLOCK_N, 32] weights in dot order (even dot, then odd dot): bf16 for
    "asm", fp32 for "bits"."""
    if DECODE == "asm":
        if FAST:
            n0, n4, n1, n5, n2, n6, n3, n7 = tl.inline_asm_elementwise(
                _WORD_FAST, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, m[:, None]], dtype=(tl.bfloat16,) * 8, is_pure=True,
                pack=1,
            )  # fmt: skip
        else:
            m1, m2 = _exact_multipliers(sw, i)
            n0, n4, n1, n5, n2, n6, n3, n7 = tl.inline_asm_elementwise(
                _WORD_EXACT, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, m1[:, None], m2[:, None]],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
            )  # fmt: skip
        ev = dot_order(n0, n4, n2, n6, BLOCK_N)
        od = dot_order(n1, n5, n3, n7, BLOCK_N)
    else:
        s = _e8m0_f32(sw, i)[:, None]
        ev = dot_order(_nibble_f32(w, 0), _nibble_f32(w, 4), _nibble_f32(w, 2), _nibble_f32(w, 6), BLOCK_N)
        od = dot_order(_nibble_f32(w, 1), _nibble_f32(w, 5), _nibble_f32(w, 3), _nibble_f32(w, 7), BLOCK_N)
        ev = ev * s
        od = od * s
    return cat_k(ev, od, BLOCK_N, 16)


@triton.jit
def _chunk_dot(
    acc, wp, sp, x, DECODE: tl.constexpr, FAST: tl.constexpr, CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr
):
    """acc [BLOCK_N, BLOCK_M] += 128 columns: wp pointers (int32) to the chunk's 16 words [BLOCK_N, 16] (CHUNKED:
    word c of group g at 4c + g) or to the first group's 4 words [BLOCK_N, 4] (checkpoint: word c of group g at
    4g + c), sp [BLOCK_N] pointers to the scale word, x [BLOCK_M, 128] activations in dot order."""
    sw = tl.load(sp)
    m0 = sw
    m1 = sw
    m2 = sw
    m3 = sw
    if DECODE == "asm" and FAST:
        m0, m1, m2, m3 = tl.inline_asm_elementwise(
            _FAST_MULTIPLIERS, "=r,=r,=r,=r,r", [sw], dtype=(tl.int32,) * 4, is_pure=True, pack=1
        )
    if CHUNKED:
        # one 16-byte vector per lane (word c of the four groups), split in registers: position 4c + 2 g1 + g0
        w02, w13 = tl.split(tl.reshape(tl.load(wp), [BLOCK_N, 4, 2, 2]))
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
    else:
        w0 = tl.load(wp)
        w1 = tl.load(wp + 4)
        w2 = tl.load(wp + 8)
        w3 = tl.load(wp + 12)
    t0 = _group_tile(w0, sw, m0, 0, DECODE, FAST, BLOCK_N)
    t1 = _group_tile(w1, sw, m1, 1, DECODE, FAST, BLOCK_N)
    t2 = _group_tile(w2, sw, m2, 2, DECODE, FAST, BLOCK_N)
    t3 = _group_tile(w3, sw, m3, 3, DECODE, FAST, BLOCK_N)
    a = cat_k(cat_k(t0, t1, BLOCK_N, 32), cat_k(t2, t3, BLOCK_N, 32), BLOCK_N, 64)
    if DECODE == "asm":
        acc = tl.dot(a, tl.trans(x.to(tl.bfloat16)), acc)
    else:
        acc = tl.dot(a, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _gate_up_loop(
    x_rows, w1_ptr, w3_ptr, s1_ptr, s3_ptr, w_off, s_off, K, stride_sq,
    DECODE: tl.constexpr, FAST: tl.constexpr, CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # K > 0 drops the zero-trip path: placed after the loop, its zeroing of the accumulators makes ptxas serialize
    # every wgmma of the kernel (C7515, "non wgmma instructions defining accumulator registers")
    tl.assume(K > 0)
    cw = tl.arange(0, 16 if CHUNKED else 4)
    c128 = tl.arange(0, 128)
    g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for q in tl.static_range(BLOCK_K // 128):
            kc = k0 + q * 128
            x = tl.load(x_rows + (kc + c128)[None, :])
            wp = w_off[:, None] + (kc // 8 + cw)[None, :]
            sp = s_off + (kc // 128) * stride_sq
            g = _chunk_dot(g, w1_ptr + wp, s1_ptr + sp, x, DECODE, FAST, CHUNKED, BLOCK_N)
            u = _chunk_dot(u, w3_ptr + wp, s3_ptr + sp, x, DECODE, FAST, CHUNKED, BLOCK_N)
    return g, u


@triton.jit
def _down_loop(
    h_rows, w2_ptr, s2_ptr, w_off, s_off, K, stride_sq,
    DECODE: tl.constexpr, FAST: tl.constexpr, CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # K > 0 drops the zero-trip path: placed after the loop, its zeroing of the accumulators makes ptxas serialize
    # every wgmma of the kernel (C7515, "non wgmma instructions defining accumulator registers")
    tl.assume(K > 0)
    cw = tl.arange(0, 16 if CHUNKED else 4)
    c128 = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for q in tl.static_range(BLOCK_K // 128):
            kc = k0 + q * 128
            x = tl.load(h_rows + (kc + c128)[None, :])
            wp = w_off[:, None] + (kc // 8 + cw)[None, :]
            sp = s_off + (kc // 128) * stride_sq
            acc = _chunk_dot(acc, w2_ptr + wp, s2_ptr + sp, x, DECODE, FAST, CHUNKED, BLOCK_N)
    return acc


@triton.jit
def _gate_up_grouped_kernel(
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, pairs_ptr, bexp_ptr, h_ptr,
    P, N, K, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_h, limit,
    TOPK: tl.constexpr, CLAMP: tl.constexpr, DECODE: tl.constexpr, FAST: tl.constexpr, H_PERM: tl.constexpr,
    CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x [T, K] in dot order (`permute_columns`); w1 / w3 [E, N, K/8] int32 words (CHUNKED: the chunked layout,
    `moe.fp4_layout`); s1 / s3 int32 scale words (4 groups each), word (n, q) of chunk q at n * stride_sn + q *
    stride_sq; h [B * BLOCK_M, N] (in dot order when H_PERM). K % BLOCK_K == 0, BLOCK_K % 128 == 0."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= 0:
        rows = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_mask = rows < P
        tok = tl.where(r_mask, rows // TOPK, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        wrow = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1: no per-element predicates
        w_off = e.to(tl.int64) * stride_we + wrow * stride_wn
        s_off = e.to(tl.int64) * stride_se + wrow * stride_sn
        x_rows = x_ptr + tok[:, None] * stride_x
        g, u = _gate_up_loop(x_rows, w1_ptr, w3_ptr, s1_ptr, s3_ptr, w_off, s_off, K, stride_sq, DECODE, FAST,
                             CHUNKED, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        # The fast decode turns every scale code > 128 into an infinite multiplier, so a group holding one makes its
        # rows infinite or NaN whatever the activations (x * 0 is NaN exactly then): redo such a tile exactly.
        # Activations that are not finite themselves also take the redo, with the same result.
        if FAST:
            if any_nan(g * 0.0 + u * 0.0):
                g, u = _gate_up_loop(x_rows, w1_ptr, w3_ptr, s1_ptr, s3_ptr, w_off, s_off, K, stride_sq, DECODE,
                                     False, CHUNKED, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        hrow = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        if H_PERM:
            hcol = permuted_column(offs_n)
        else:
            hcol = offs_n
        tl.store(
            h_ptr + hrow[None, :] * stride_h + hcol[:, None],
            h.to(h_ptr.dtype.element_ty),
            mask=n_mask[:, None],
        )


@triton.jit
def _down_grouped_kernel(
    h_ptr, w2_ptr, s2_ptr, pairs_ptr, bexp_ptr, rw_ptr, out_ptr,
    P, N, K, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_sq, stride_o,
    DECODE: tl.constexpr, FAST: tl.constexpr, CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h [B * BLOCK_M, K] in dot order; w2 [E, N, K/8] int32 and s2 int32 scale words as in the gate/up kernel;
    out [P, N] fp32 rows (routing weight applied)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= 0:
        rows = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        r_mask = rows < P
        hrow = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        wrow = tl.minimum(offs_n, N - 1).to(tl.int64)
        w_off = e.to(tl.int64) * stride_we + wrow * stride_wn
        s_off = e.to(tl.int64) * stride_se + wrow * stride_sn
        h_rows = h_ptr + hrow[:, None] * stride_h
        acc = _down_loop(h_rows, w2_ptr, s2_ptr, w_off, s_off, K, stride_sq, DECODE, FAST, CHUNKED, BLOCK_M,
                         BLOCK_N, BLOCK_K)  # fmt: skip
        if FAST:  # a scale code > 128 (see the gate/up kernel): redo the tile with the exact decode
            if any_nan(acc * 0.0):
                acc = _down_loop(h_rows, w2_ptr, s2_ptr, w_off, s_off, K, stride_sq, DECODE, False, CHUNKED,
                                 BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        wt = tl.load(rw_ptr + rows, mask=r_mask, other=0.0)
        op = out_ptr + tl.where(r_mask, rows, 0)[None, :].to(tl.int64) * stride_o + offs_n[:, None]
        tl.store(op, acc * wt[None, :], mask=r_mask[None, :] & n_mask[:, None])


def supports(d: int, inter: int, *packed: Tensor) -> bool:
    """The grouped kernels read codes and scales as 32-bit words (scales: 4 groups a word): both GEMM depths must be
    multiples of 128 and the packed tensors viewable as int32 (unit last stride, 4-byte aligned rows)."""
    return (
        d % 128 == 0
        and inter % 128 == 0
        and all(t.stride(-1) == 1 and t.storage_offset() % 4 == 0 for t in packed)
        and all(st % 4 == 0 for t in packed for st in t.stride()[:-1])
    )


_DECODE = {"fast": "asm", "exact": "asm", "bits": "bits"}


def _block_k(k: int, want: int) -> int:
    bk = max(128, want)
    while k % bk:
        bk //= 2
    return bk


def scale_words(s: Tensor, chunked: bool) -> tuple[Tensor, int, int, int]:
    """UE8M0 scales [E, N, K/32] (one byte each) -> (int32 words [E, N, K/128], stride of an expert, of a row and of
    a chunk, in words). Chunked layout (`moe.fp4_layout`): a matrix's words are stored chunk-major ([K/128, N]), so
    the row stride is 1 and the chunk stride N; the matrices must then be contiguous."""
    v = s.view(torch.uint8).view(torch.int32)
    if not chunked:
        return v, v.stride(0), v.stride(1), v.stride(2)
    n, q = v.shape[1], v.shape[2]
    if v.stride(2) != 1 or v.stride(1) != q:
        raise ValueError(
            f"fp4 chunked scales: strides {tuple(v.stride())} (words) of shape {tuple(v.shape)}; expected "
            "contiguous matrices (the chunked layout reorders the bytes inside each matrix)"
        )
    return v, v.stride(0), 1, n


def _options(num_warps: int, num_stages: int, max_regs: int | None) -> dict:
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if max_regs is not None:
        opts["maxnreg"] = max_regs
    return opts


def launch_gate_up(
    x: Tensor, w1: Tensor, w3: Tensor, s1: Tensor, s3: Tensor, pairs: Tensor, bexp: Tensor, h: Tensor, topk: int,
    limit: float, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, decode: str,
    h_perm: bool, chunked: bool = False, max_regs: int | None = None,
) -> None:  # fmt: skip
    """h [B * block_m, I] = clamped SwiGLU of gate / up per padded row; x [T, d] in natural column order (permuted
    here, one copy); h in dot order when h_perm (the grouped down kernel reads it so). decode: "fast" (PTX, one
    multiply per pair, a tile with a scale code > 128 redone exactly), "exact" (PTX, two multiplies) or "bits"
    (portable, fp32 dots). chunked: weights and scales in the chunked layout (`moe.fp4_layout`), else the
    checkpoint's. max_regs: ptxas's register cap per thread (None: ptxas decides)."""
    inter, d = w1.shape[1], x.shape[1]
    xp = permute_columns(x)
    u1, u3 = w1.view(torch.int32), w3.view(torch.int32)
    v1, sse, ssn, ssq = scale_words(s1, chunked)
    v3, *strides3 = scale_words(s3, chunked)
    if strides3 != [sse, ssn, ssq]:
        raise ValueError(f"launch_gate_up: s1 and s3 strides differ: {(sse, ssn, ssq)} vs {tuple(strides3)}")
    bk = _block_k(d, block_k)
    _gate_up_grouped_kernel[(bexp.shape[0], -(-inter // block_n))](
        xp, u1, u3, v1, v3, pairs, bexp, h,
        x.shape[0] * topk, inter, d, xp.stride(0), u1.stride(0), u1.stride(1), sse, ssn, ssq, h.stride(0),
        float(limit),
        TOPK=topk, CLAMP=limit > 0, DECODE=_DECODE[decode], FAST=decode == "fast", H_PERM=h_perm, CHUNKED=chunked,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, **_options(num_warps, num_stages, max_regs),
    )  # fmt: skip


def launch_down(
    h: Tensor, w2: Tensor, s2: Tensor, pairs: Tensor, bexp: Tensor, rw: Tensor, rows: Tensor, block_m: int,
    block_n: int, block_k: int, num_warps: int, num_stages: int, decode: str, chunked: bool = False,
    max_regs: int | None = None,
) -> None:  # fmt: skip
    """rows [P, d] fp32 = routing weight * (h @ w2^T) per pair; h [B * block_m, I] in dot order. chunked, max_regs:
    as in `launch_gate_up`."""
    p, d = rows.shape
    inter = h.shape[1]
    u2 = w2.view(torch.int32)
    v2, sse, ssn, ssq = scale_words(s2, chunked)
    _down_grouped_kernel[(bexp.shape[0], -(-d // block_n))](
        h, u2, v2, pairs, bexp, rw, rows,
        p, d, inter, h.stride(0), u2.stride(0), u2.stride(1), sse, ssn, ssq, rows.stride(0),
        DECODE=_DECODE[decode], FAST=decode == "fast", CHUNKED=chunked, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_block_k(inter, block_k), **_options(num_warps, num_stages, max_regs),
    )  # fmt: skip
