"""FP8 block-scaled linear for a few dozen tokens, the e4m3 codes decoded straight into the tensor-core operand
registers (mode "frag" of `deepinfer_kernels.linear.triton`; docs/linear_fp8_frag.md).

The "weight" mode converts an e4m3 tile to bf16 in one layout and Triton moves it into the wgmma operand layout
through shared memory (stores, a barrier, reads) every K step. Here the kernel computes ``yᵀ = W xᵀ`` with the
decoded weights as wgmma's A operand, which Hopper reads from registers, and picks the K order inside each dot so
that the decoded registers already are that operand:

* in the A fragment of one K = 16 step, lane q of a quad holds dot positions ``2q, 2q+1, 2q+8, 2q+9`` of its rows,
  each pair one bf16x2 register;
* dot step s of a 128-column chunk covers columns ``16s .. 16s+15``: 4 int32 words of 4 codes per row, word q
  (columns ``16s+4q .. 16s+4q+3``) to lane q, its bytes 0, 1 at positions ``2q, 2q+1`` and bytes 2, 3 at
  ``2q+8, 2q+9``. A step is one contiguous [rows, 4] word tile (the FP4 kernels' tile), whose natural layout
  Triton keeps as the fragment's: no conversion. A step lies inside one 32-column scale group, so its weights of a
  row share one scale;
* the activations must be in the same order: `permute_columns` copies x once per call so that position
  ``16s + 8h + 2q + j`` holds column ``16s + 4q + 2h + j``. Reading them permuted inside the kernel (pairs of
  columns) would stop Triton from copying the activation tile asynchronously into the swizzled layout wgmma reads.

Decode of one code pair (PTX): a byte permute puts the two codes at bits 8..15 of each 16-bit lane; the magnitude
shifted to bits 4..10 and the sign kept at bit 15 make a bf16 of ``value * 2^-120`` (codes with exponent 0 land on
bf16 subnormals, which bf16 fma keeps). One bf16x2 multiply by ``2^(b - 7)`` then applies the UE8M0 scale
``2^(b - 127)`` and the ``2^120`` in one rounding, exact for scale codes b <= 134 (weights of magnitude up to
448 * 2^7). "exact" decode: two multiplies, by ``2^(min(b, 134) - 7)`` and ``2^(max(b, 134) - 134)``, exact for
every code. The fast decode turns b >= 135 into an infinite multiplier, so every output of a tile holding such a
group is infinite or NaN; the kernel then redoes that tile with the exact decode (the FP4 expert kernels' guard,
docs/moe_fp4_kernel.md). Either way each weight is the reference's decode rounded to bf16 (exact: a 4-bit
significand times a power of two), so the result equals the "weight" mode's up to fp32 summation order.

The portable decode ("bits", the CPU interpreter) runs the same tiling and order with an integer decode to fp32 and
fp32 dots, so the interpreter tests the permutation the GPU relies on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels.linear.split_k.triton import write_tile
from deepinfer_kernels.wgmma_frag.triton import any_nan, cat_k, dot_order

__all__ = ["launch", "permute_columns", "unsupported"]

_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)  # 2^-127, UE8M0 code 0
_TWO_120 = tl.constexpr(1.329227995784916e36)  # 2^120


def unsupported(x: Tensor, w: Tensor, s: Tensor | None, block: tuple[int, int], block_k: int) -> str | None:
    """Why the "frag" kernel cannot take these operands (None: it can). It reads codes as int32 words and a row's
    scales as int32 words of 4 UE8M0 bytes, and its K order needs whole 128-column chunks."""
    b1 = block[1]
    if s is None or s.dtype != torch.float8_e8m0fnu:
        return f"needs UE8M0 (float8_e8m0fnu) scales, found {None if s is None else s.dtype}"
    # the PTX decode multiplies in bf16: fp32 activations would be rounded silently. The interpreter's portable
    # decode (CPU tensors) computes in fp32 and takes them.
    if x.dtype != torch.bfloat16 and not (x.dtype == torch.float32 and x.device.type == "cpu"):
        return f"needs bf16 activations (fp32 only under the CPU interpreter), found {x.dtype} on {x.device.type}"
    k = w.shape[1]
    if block_k % 128 or k % block_k:
        return f"needs K ({k}) a multiple of the config's block_k ({block_k}), itself a multiple of 128"
    if b1 not in (32, 64, 128):
        return f"needs a K scale block of 32, 64 or 128, found {b1}"
    if s.shape[1] % 4 or s.stride(1) != 1 or s.stride(0) % 4 or s.storage_offset() % 4:
        return f"needs scale rows of whole int32 words, found shape {tuple(s.shape)} strides {tuple(s.stride())}"
    return None


def permute_columns(x: Tensor) -> Tensor:
    """x [..., K] (K % 16 == 0) -> a contiguous copy in dot order: position 16s + 8h + 2q + j holds column
    16s + 4q + 2h + j."""
    *lead, k = x.shape
    return x.reshape(*lead, k // 16, 4, 2, 2).transpose(-3, -2).reshape(*lead, k)


# One int32 word of 4 e4m3 codes -> 4 bf16 (bytes 0..3), scaled: $4 the word, $5 (and $6 for the exact form) the
# bf16x2 multipliers. Pair (byte 0, byte 1), then (byte 2, byte 3): the permute puts the codes at bits 8..15 of the
# two lanes, the shift moves the magnitude to 4..10 (bf16 exponent low bits + 3 mantissa bits), the sign stays at 15.
def _word_ptx(exact: bool) -> str:
    lines = ["{", ".reg .b32 q, a, t, z;", "mov.b32 z, 0x80008000;"]
    for sel, outs in (("0x1404", "$0, $1"), ("0x3424", "$2, $3")):
        lines += [
            f"prmt.b32 q, $4, 0, {sel};",
            "shr.b32 a, q, 4;",
            "lop3.b32 t, a, 0x07F007F0, 0, 0xC0;",
            "lop3.b32 t, q, 0x80008000, t, 0xEA;",
            "fma.rn.bf16x2 t, t, $5, z;",
        ]
        if exact:
            lines.append("fma.rn.bf16x2 t, t, $6, z;")
        lines.append(f"mov.b32 {{{outs}}}, t;")
    return "\n".join(["", *lines, "}", ""])


_WORD_FAST = tl.constexpr(_word_ptx(False))
_WORD_EXACT = tl.constexpr(_word_ptx(True))


@triton.jit
def _byte_f32(w, i: tl.constexpr):
    """Byte i of every word (an e4m3 code) -> value * 2^-120 in fp32 (exponent 0 on fp32 subnormals)."""
    c = (w >> (8 * i)) & 255
    return (((c & 0x7F) << 20) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _step(w, b, DECODE: tl.constexpr, FAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """One dot step: w [BLOCK_N, 4] words (lane q's), b [BLOCK_N] scale codes -> [BLOCK_N, 16] weights in dot
    order (bf16 for "asm", fp32 for "bits")."""
    if DECODE == "asm":
        if FAST:
            m = (tl.minimum(b, 135) + 120) << 7
            m = m | (m << 16)
            n0, n1, n2, n3 = tl.inline_asm_elementwise(
                _WORD_FAST, "=h,=h,=h,=h,r,r", [w, m[:, None]], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1
            )
        else:
            m1 = (tl.minimum(b, 134) + 120) << 7
            m2 = (tl.maximum(b, 134) - 7) << 7
            n0, n1, n2, n3 = tl.inline_asm_elementwise(
                _WORD_EXACT, "=h,=h,=h,=h,r,r,r", [w, (m1 | (m1 << 16))[:, None], (m2 | (m2 << 16))[:, None]],
                dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1,
            )  # fmt: skip
    else:
        s = tl.where(b == 0, _E8M0_ZERO, (b << 23).to(tl.float32, bitcast=True))[:, None]
        # times 2^120 first (exact: the decoded codes are normal then), the scale second (one rounding at most)
        n0 = _byte_f32(w, 0) * _TWO_120 * s
        n1 = _byte_f32(w, 1) * _TWO_120 * s
        n2 = _byte_f32(w, 2) * _TWO_120 * s
        n3 = _byte_f32(w, 3) * _TWO_120 * s
    return dot_order(n0, n1, n2, n3, BLOCK_N)


@triton.jit
def _group(w_rows, kw, sw, shift, c8, DECODE: tl.constexpr, FAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """One 32-column scale group from word kw of every row (two dot steps of 4 words), its scale byte at `shift`
    of the scale word sw -> [BLOCK_N, 32] weights in dot order. The group is one [BLOCK_N, 8] load split in
    registers: Triton then reads it from shared memory straight in the fragment layout (two [BLOCK_N, 4] loads
    per group came out in another layout and cost a register shuffle of the decoded tile before every dot)."""
    b = (sw >> shift) & 255
    w0, w1 = tl.split(tl.permute(tl.reshape(tl.load(w_rows + (kw + c8)[None, :]), [BLOCK_N, 2, 4]), (0, 2, 1)))
    s0 = _step(w0, b, DECODE, FAST, BLOCK_N)
    s1 = _step(w1, b, DECODE, FAST, BLOCK_N)
    return cat_k(s0, s1, BLOCK_N, 16)


@triton.jit
def _k_loop(
    x_rows, w_rows, s_rows, t0, n_tiles,
    B1: tl.constexpr, DECODE: tl.constexpr, FAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # n_tiles > 0 drops the zero-trip path: placed after the loop, its zeroing of the accumulator makes ptxas
    # serialise every wgmma of the kernel (C7515)
    tl.assume(n_tiles > 0)
    c8 = tl.arange(0, 8)
    cols = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(0, n_tiles):
        for c in tl.static_range(BLOCK_K // 128):
            kc = (t0 + t) * BLOCK_K + c * 128
            x = tl.load(x_rows + (kc + cols)[None, :])
            # the scale bytes of the chunk's four groups lie in one int32 word of the row (B1 = 32: bytes 0..3)
            sw = tl.load(s_rows + (kc // B1) // 4)
            a0 = _group(w_rows, kc // 4, sw, 8 * ((kc // B1) % 4), c8, DECODE, FAST, BLOCK_N)
            a1 = _group(w_rows, kc // 4 + 8, sw, 8 * (((kc + 32) // B1) % 4), c8, DECODE, FAST, BLOCK_N)
            a2 = _group(w_rows, kc // 4 + 16, sw, 8 * (((kc + 64) // B1) % 4), c8, DECODE, FAST, BLOCK_N)
            a3 = _group(w_rows, kc // 4 + 24, sw, 8 * (((kc + 96) // B1) % 4), c8, DECODE, FAST, BLOCK_N)
            a = cat_k(cat_k(a0, a1, BLOCK_N, 32), cat_k(a2, a3, BLOCK_N, 32), BLOCK_N, 64)
            if DECODE == "asm":
                acc = tl.dot(a, tl.trans(x.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(a, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return acc


# stride_xg stays specialised: its divisibility by 16 is what lets the activation tile be copied asynchronously
# (16-byte aligned rows); the loop count and the group height gain nothing from specialisation
@triton.jit(do_not_specialize=["k_tiles_per_split", "group_n"])
def _frag_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, stride_split, k_tiles_per_split, group_n, stride_xg,
    B0: tl.constexpr, B1: tl.constexpr, DECODE: tl.constexpr, FAST: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y [M, N] = x [M, K] @ decode(w)ᵀ: x in dot order (`permute_columns`), w [N, K / 4] int32 words of e4m3 codes, s int32 words of UE8M0 scale bytes
    (row n // B0 at (n // B0) * stride_sn), grid (N tiles, M tiles, K splits); group_n / stride_xg: block-diagonal
    weights as in `_linear_kernel`. K % BLOCK_K == 0."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # rows past the end read the last row: no predicates in the loop, the stores are masked
    xrow = tl.minimum(offs_m, M - 1).to(tl.int64)
    wrow = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = x_ptr + ((pid_n * BLOCK_N) // group_n).to(tl.int64) * stride_xg + xrow[:, None] * stride_xm
    w_rows = w_ptr + wrow[:, None] * stride_wn
    s_rows = s_ptr + (wrow // B0) * stride_sn
    t0 = pid_s * k_tiles_per_split
    n_tiles = tl.minimum(k_tiles_per_split, K // BLOCK_K - t0)
    acc = _k_loop(x_rows, w_rows, s_rows, t0, n_tiles, B1, DECODE, FAST, BLOCK_M, BLOCK_N, BLOCK_K)
    if FAST:  # a scale code >= 135 made its rows infinite or NaN (module docstring): redo the tile exactly
        if any_nan(acc * 0.0):
            acc = _k_loop(x_rows, w_rows, s_rows, t0, n_tiles, B1, DECODE, False, BLOCK_M, BLOCK_N, BLOCK_K)
    write_tile(tl.trans(acc), y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym, stride_split,
               pid_s, SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip


def launch(
    x: Tensor, w: Tensor, s: Tensor, y: Tensor, ws: Tensor, counters: Tensor, grid: tuple[int, int, int], *,
    b0: int, b1: int, per: int, groups: int, block_m: int, block_n: int, block_k: int, num_warps: int,
    num_stages: int, exact: bool, interp: bool,
) -> None:  # fmt: skip
    """`_frag_linear_kernel` over x [M, K] (groups > 1: [M, G, K]), w [N, K] e4m3, s UE8M0 (checked by
    `unsupported`; copied once into dot order), into y [M, N] (ws / counters: the split-K workspace and arrival counters when grid[2] > 1)."""
    if w.stride(1) != 1 or w.stride(0) % 4 or w.storage_offset() % 4:
        w = w.contiguous()
    x = permute_columns(x)
    wv = w.view(torch.int32)
    sv = s.view(torch.uint8).view(torch.int32)
    _frag_linear_kernel[grid](
        x, wv, sv, y, ws, counters,
        x.shape[0], w.shape[0], w.shape[1], x.stride(0), wv.stride(0), sv.stride(0), y.stride(0),
        y.shape[0] * y.shape[1], per, w.shape[0] // groups, x.stride(1) if groups > 1 else 0,
        B0=b0, B1=b1, DECODE="bits" if interp else "asm", FAST=not exact, SPLIT_K=grid[2] > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=1 if interp else num_stages,
    )  # fmt: skip
