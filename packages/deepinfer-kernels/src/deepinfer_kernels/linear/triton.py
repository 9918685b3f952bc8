"""Triton backend of `linear`: one tiled GEMM kernel for decode and prefill sizes whose weight tiles are decoded
in registers (FP8 e4m3 with per-block UE8M0 / fp32 scales, or a plain bf16 / fp16 weight for the LM head), with the
optional FP8 activation quantization.

Activation quantization (the deployed numerics): for bf16 / fp32 activations one pass (`act_fake_quant`) writes
the fake-quantized values q * s over x first, and the GEMM reads them as plain activations. q * s (an e4m3 value
times a power of two) is exact in bf16 and fp32, so this gives the numbers of quantizing inside the GEMM; inside,
every output tile re-quantized the same activations (the M = 1 "gemv" kernel 16 rows at a time), which made the
deployed decode step's FP8 linears 4x slower on the H200 (docs/perf.md "Records decode step"). fp16 activations
keep the in-GEMM quantization (q * s can fall below fp16's range).

Why one kernel: at decode sizes (M <= 256) the step is bound by reading the weight once; the kernel streams each
weight byte once per M tile and multiplies with tensor-core dots in bf16 (fp32 accumulation).

Weight decode modes (`LinearConfig.mode`), all equal to the reference up to fp32 summation order:
- "weight": the e4m3 tile is converted to the dot dtype and multiplied by its block scales (exact in bf16 for
  UE8M0 scales; fp32 scales multiply in fp32 and round once, as the reference's decode does), then one
  BLOCK_K-wide dot. The measured default for bf16 / fp16 activations.
- "group": one dot per scale group of b1 columns over the raw codes, the scales applied to its fp32 result
  (``acc += dot(a_g, q_g) * s[n, g]``, one multiply per output element instead of per weight); with activation
  quantization the activation's power-of-two scale is factored out the same way. At b1 = 32 the narrow dots
  measured slower than "weight" on the H200 (docs/perf.md "FP8 linear at decode sizes").
- "fma": no MMA; products accumulated per K lane on the CUDA cores and summed once (any BLOCK_M). The default for
  fp32 activations at M <= 8, where exact fp32 MMA emulation is slow.
- "gemv" (FP8 weights, a separate kernel `_gemv_linear_kernel`): for a few rows. The codes are read as int32 words
  (16-byte vectors per thread), decoded to fp32 in registers (two codes per PTX conversion), multiplied on the CUDA
  cores and summed per 16-code vector in registers; the group's scale multiplies that sum. Nothing passes through shared
  memory inside the K loop, and the next K tile is prefetched into registers (`LinearConfig.prefetch`). Not a
  default until measured (benchmarks/sweep_linear_fp8.py sweeps it).
- "frag" (FP8 weights with UE8M0 scales, bf16 activations, a separate kernel in `linear.fp8_frag.triton`): the codes are
  decoded straight into the register operand of wgmma (weights as its A side, the activations permuted once per
  call into the matching K order), so the decoded tile never passes through shared memory; the default at
  FRAG_MIN_ROWS..FRAG_MAX_ROWS tokens (docs/linear_fp8_frag.md).
- "dense" (FP8 weights, prefill sizes): `dequant_fp8` writes the whole weight decoded to the activation dtype (the
  reference's decode, exact for UE8M0 scales) and cuBLAS multiplies, so the result is the torch reference's own
  computation. From DENSE_MIN_ROWS rows the decode pass (3 bytes per weight) is small beside the GEMM, and
  cuBLAS runs near the tensor cores' rate where the register-decode tiles above, tuned for decode, reached about a
  tenth of it (docs/perf.md "Records decode step").

Split-K: when N x M tiles alone cannot fill the GPU, K is split over S programs per output tile. Each writes its
fp32 partial tile to a workspace and increments the tile's arrival counter (acq_rel atomic); the program that
arrives last adds the S partials in the fixed order 0..S-1, so the result does not depend on which program
finished when (bit-identical across runs), writes y in the output dtype and resets the counter to 0. So a counter
buffer that starts at zero is left at zero by every launch: a caller that owns one (`deepinfer_kernels.linear.split_k_counters`, reused by
the launches of one stream) pays one launch per call; without one, each call allocates zeroed counters (one
fill launch more). CUDA-graph capturable either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2, target_programs
from deepinfer_kernels._pdl import launch_kwargs, use_pdl
from deepinfer_kernels.linear.fp8_frag import triton as fp8_frag
from deepinfer_kernels.linear.split_k.triton import write_tile

__all__ = [
    "LinearConfig",
    "DENSE_MIN_ROWS",
    "act_fake_quant",
    "default_config",
    "dequant_fp8",
    "fp8_linear",
    "fp8_linear_grouped",
    "launch",
    "linear_f32_out",
]

# dot operand precision: bf16 tensor cores, or exact fp32 (fp32 activations, and always under the interpreter,
# whose bf16 dot is wrong)
_DOT_BF16, _DOT_F16, _DOT_F32 = 0, 1, 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# weight decode / product modes (the `mode` of LinearConfig, the kernel's MODE)
_MODES = {"group": 0, "weight": 1, "fma": 2, "gemv": 3, "dense": 4, "frag": 5}
# from this many rows the FP8 linears decode the weight once and run cuBLAS ("dense")
DENSE_MIN_ROWS = 512
# where a PDL "gemv" program lets the next kernel launch (`LinearConfig.pdl_trigger`, the kernel's PDL_TRIGGER)
_PDL_TRIGGERS = {"wait": 0, "loop": 1, "none": 2}
# split-K partials per output tile: the cap of an explicit split or a programs target
MAX_SPLIT = 64

# token counts whose bf16 FP8 linears take the "frag" kernel by default, and from 8 tokens the weights of at least
# FRAG_SMALL_M_WEIGHT elements (H200 sweep, docs/perf.md "The frag FP8 linear")
FRAG_MIN_ROWS, FRAG_MAX_ROWS = 17, 256
FRAG_SMALL_M_WEIGHT = 32 * 2**20
# 2^-127: UE8M0 byte 0 (a float32 subnormal; no real checkpoint scale uses it)
_E8M0_ZERO = tl.constexpr(5.877471754111438e-39)


@dataclass(frozen=True)
class LinearConfig:
    """Launch config of `_linear_kernel`. ``split``: programs per output tile along K (0: the occupancy policy of
    `default_config`; the last split may get fewer K tiles, and S is cut so that none gets zero; at most
    MAX_SPLIT). ``swap_ab``: compute yᵀ = W xᵀ, so a weight tile is the MMA's A operand (Hopper's wgmma needs 64
    rows there; at decode the tokens are fewer). ``programs``: with split 0, a target for the programs of the launch
    instead of the occupancy policy: S = ceil(programs / output tiles), at most MAX_SPLIT and the K tiles (0: the
    policy). ``mode`` "gemv" (FP8 weights only): `_gemv_linear_kernel`, CUDA-core FMAs on weights decoded in registers,
    for few rows (any block_m; block_k a multiple of the scale block); ``prefetch`` its register prefetch of the
    next K tile: 0 none, 1 weight codes and scales, 2 the activations too (other modes ignore it). ``mode``
    "dense" (FP8 weights only): `dequant_fp8` in block_n x block_k tiles, then cuBLAS. ``mode`` "frag" (FP8 weights
    with UE8M0 scales, bf16 activations): `linear.fp8_frag.triton`, codes decoded into the wgmma register operand (always
    weight-as-A, so no swap_ab; block_n >= 64 rows, block_k a multiple of 128); ``exact_decode`` its two-multiply
    decode instead of the fast one with the exact redo of a tile whose scales need it.
    Only for a "gemv" launch with PDL on (docs/pdl.md): ``pdl_trigger`` where each program lets the next kernel
    launch: "wait" right after its grid-dependency wait, "loop" after its K loop, "none" never (the next kernel
    then launches when this one ends); ``pdl_l2_tiles``: K tiles after the first whose weight lines each program
    also prefetches into L2 before the wait (0: none)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split: int = 0
    swap_ab: bool = False
    mode: str = "group"
    programs: int = 0
    prefetch: int = 2
    pdl_trigger: str = "wait"
    pdl_l2_tiles: int = 0
    exact_decode: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v != next_pow2(v):
                raise ValueError(f"LinearConfig.{name}: found {v}; expected a power of two")
        if self.mode not in _MODES:
            raise ValueError(f"LinearConfig.mode: found {self.mode!r}; expected one of {tuple(_MODES)}")
        small = self.block_n < 16 or self.block_k < 16 or (self.block_m < 16 and self.mode not in ("fma", "gemv"))
        if small:
            raise ValueError(
                f"LinearConfig: tiles {self} below 16 (tensor-core dot minimum; fma / gemv: block_m any)"
            )
        if self.mode == "frag" and (self.block_n < 64 or self.block_k % 128):
            raise ValueError(f"LinearConfig: mode 'frag' needs block_n >= 64 and block_k a multiple of 128; found "
                             f"{self.block_n} / {self.block_k}")
        if self.swap_ab and self.mode in ("fma", "gemv", "dense", "frag"):
            raise ValueError(f"LinearConfig: swap_ab is an MMA operand order; mode {self.mode!r} has none")
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"LinearConfig.prefetch: found {self.prefetch}; expected 0, 1 or 2")
        if self.pdl_trigger not in _PDL_TRIGGERS or self.pdl_l2_tiles < 0:
            raise ValueError(f"LinearConfig: pdl_trigger {self.pdl_trigger!r} / pdl_l2_tiles {self.pdl_l2_tiles}; "
                             f"expected one of {tuple(_PDL_TRIGGERS)} / >= 0")
        if self.num_stages < 1 or not 0 <= self.split <= MAX_SPLIT or self.programs < 0:
            raise ValueError(
                f"LinearConfig: num_stages {self.num_stages} / split {self.split} / programs {self.programs}; "
                f"expected >= 1 / 0..{MAX_SPLIT} / >= 0"
            )


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
    """[BLOCK_M, BLOCK_K] fp32 -> the fake-quantized values q * s per 1 x GROUP (`_act_quant_group`), fp32."""
    q, s = _act_quant_group(tl.reshape(a, [BLOCK_M * (BLOCK_K // GROUP), GROUP]))
    return tl.reshape(q * s[:, None], [BLOCK_M, BLOCK_K])


@triton.jit
def _scaled_weight(w, s_rows, k, K, n_mask, B1: tl.constexpr, SCALE_E8M0: tl.constexpr, OUT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """e4m3 tile [BLOCK_N, BLOCK_K] at column k times its block scales, in OUT (bf16 / fp16 / fp32). Equal to the
    reference's fp32 decode rounded to OUT: with UE8M0 scales a bf16 product of the exact bf16 code and the
    power-of-two scale is exact; fp32 scales (and fp16) multiply in fp32 and round once, as the reference does."""
    g = k // B1 + tl.arange(0, BLOCK_K // B1)
    sc = tl.load(s_rows[:, None] + g[None, :], mask=n_mask[:, None] & (g[None, :] * B1 < K), other=0)
    if SCALE_E8M0:
        sc = _e8m0_decode(sc)
    if SCALE_E8M0 and OUT == tl.bfloat16:
        w3 = tl.reshape(w.to(tl.bfloat16), [BLOCK_N, BLOCK_K // B1, B1]) * sc.to(tl.bfloat16)[:, :, None]
    else:
        w3 = (tl.reshape(w.to(tl.float32), [BLOCK_N, BLOCK_K // B1, B1]) * sc[:, :, None]).to(OUT)
    return tl.reshape(w3, [BLOCK_N, BLOCK_K])


@triton.jit
def _act_quant_group(a):
    """One activation group [BLOCK_M, GROUP] fp32 -> (e4m3 values as fp32, [BLOCK_M] power-of-two scales) with
    s = 2^ceil(log2(fp32(max(amax, 1e-4) * (1/448)))) and q = e4m3(clamp(a / s)): q * s is bit-exact with
    deepinfer_kernels.quant.act_quant_fp8."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    return _round_e4m3(tl.clamp(a / s[:, None], -448.0, 448.0)), s


@triton.jit
def _dequant_fp8_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_yn, B0: tl.constexpr,
                        B1: tl.constexpr, SCALE_E8M0: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] tile of the decoded weight (`_scaled_weight`, the reference's decode in OUT)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K
    offs_k = k + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    s_rows = s_ptr + (offs_n // B0).to(tl.int64) * stride_sn
    tile = _scaled_weight(w, s_rows, k, K, n_mask, B1, SCALE_E8M0, OUT, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + offs_n[:, None].to(tl.int64) * stride_yn + offs_k[None, :], tile, mask=mask)


def dequant_fp8(weight: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype, *, block_n: int = 64,
                block_k: int = 128) -> Tensor:  # fmt: skip
    """weight [N, K] float8_e4m3fn, scale [ceil(N/b0), ceil(K/b1)] e8m0 | f32 -> [N, K] dtype (bf16 / fp16 /
    fp32): `deepinfer_kernels.quant.dequant_fp8_block(weight, scale, block).to(dtype)`, bit for bit (UE8M0 products
    are exact in bf16; fp32 scales multiply in fp32 and round once). block_k: a multiple of b1."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"dequant_fp8: dtype {dtype}, expected bfloat16, float16 or float32")
    b0, b1 = block
    block_k = max(block_k, b1)
    if block_k % b1:
        raise ValueError(f"dequant_fp8: block_k {block_k} is not a multiple of the scale block {b1}")
    interp = check_launchable("dequant_fp8", _dequant_fp8_kernel, weight, scale)
    n, k = weight.shape
    # the interpreter's bf16 / fp16 arithmetic is not the GPU's: decode in fp32 there and round once (the same
    # numbers as the reference, whose decode is fp32 then rounded)
    out = torch.float32 if interp else dtype
    y = torch.empty((n, k), dtype=out, device=weight.device)
    if y.numel() == 0:
        return y.to(dtype)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    s_arg = scale.view(torch.uint8) if e8m0 else scale
    _dequant_fp8_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
        weight, s_arg, y, n, k, weight.stride(0), s_arg.stride(0), y.stride(0), B0=b0, B1=b1, SCALE_E8M0=e8m0,
        OUT=_TL_DTYPES[out], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return y.to(dtype)


@triton.jit
def _act_fake_quant_kernel(x_ptr, y_ptr, K, stride_xm, stride_ym, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                           PDL: tl.constexpr = False):  # fmt: skip
    """GROUPS scale groups of one row per program: y = q * s per 1 x GROUP (`_act_quant_group`); a partial last
    group takes its own amax (masked columns load 0, as the reference's zero padding). PDL: it reads only x, which
    the previous kernel writes, so the wait comes first; the trigger right after lets the GEMM that reads y start
    its weight loads while this pass runs (docs/pdl.md)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * (GROUPS * GROUP) + tl.arange(0, GROUPS * GROUP)
    mask = cols < K
    a = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, sc = _act_quant_group(tl.reshape(a, [GROUPS, GROUP]))
    y = tl.reshape(q * sc[:, None], [GROUPS * GROUP])
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def act_fake_quant(x: Tensor, group: int, *, pdl: bool = False) -> Tensor:
    """x [..., K] bf16 / fp32 -> the same shape and dtype holding q * s, q = e4m3(x / s) with one power-of-two s per
    1 x group channels (`deepinfer_kernels.quant.fake_quant_act_fp8`, bit for bit: q * s is exact in both dtypes).
    group: a power of two >= 16. pdl: launch as a programmatic dependent launch where
    `deepinfer_kernels._pdl.use_pdl` allows."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"act_fake_quant: x {x.dtype}, expected bfloat16 or float32 (q * s exact)")
    if group < 16 or group & (group - 1):
        raise ValueError(f"act_fake_quant: group {group}, expected a power of two >= 16")
    on = use_pdl(pdl, x.device, interpreted=check_launchable("act_fake_quant", _act_fake_quant_kernel, x))
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], k), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y.view(x.shape)
    groups = max(1, min(next_pow2(cdiv(k, group)), 4096 // group))
    _act_fake_quant_kernel[(x2.shape[0], cdiv(k, groups * group))](
        x2, y, k, x2.stride(0), y.stride(0), GROUP=group, GROUPS=groups, PDL=on, num_warps=4, **launch_kwargs(on)
    )
    return y.view(x.shape)


# the loop count and the scale row stride gain nothing from Triton's ==1 / %16 specialisation: not specialised, so
# one compiled kernel serves every split count and every K of a tile config. The group stride of x must stay
# specialised: with its divisibility unknown the activation tile's alignment is unknown, and Triton loads it two
# bytes at a time, synchronously, inside the K loop (285 instead of 142 SASS instructions per iteration for the LM
# head's 64 x 64 tile; tests/test_linear_moe_sm90_compile.py)
@triton.jit(do_not_specialize=["stride_sn", "k_tiles_per_split", "group_n"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_split,
    k_tiles_per_split,
    group_n,
    stride_xg,
    B0: tl.constexpr,
    B1: tl.constexpr,
    W_FP8: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    ACT_QUANT: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # K group with one weight scale (and one activation scale): the scale block b1 for FP8 weights
    KG: tl.constexpr = B1 if W_FP8 else BLOCK_K
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # block-diagonal (grouped) weights: output rows [g * group_n, (g + 1) * group_n) read x's group g (a tile never
    # straddles two groups); one group: stride_xg = 0
    x_rows = x_ptr + ((pid_n * BLOCK_N) // group_n).to(tl.int64) * stride_xg + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // B0).to(tl.int64) * stride_sn
    k_tiles = tl.cdiv(K, BLOCK_K)
    t0 = pid_s * k_tiles_per_split
    n_tiles = tl.minimum(k_tiles_per_split, k_tiles - t0)
    if DOT == 2:
        OPER: tl.constexpr = tl.float32
    elif DOT == 1:
        OPER: tl.constexpr = tl.float16
    else:
        OPER: tl.constexpr = tl.bfloat16
    if SWAP_AB:  # acc holds yᵀ: the weight rows fill the MMA's M side, the few tokens its N side
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if (
        MODE == 0
    ):  # "group": one dot per scale group over the raw codes, the scales applied to its fp32 result
        for t in range(0, n_tiles):
            for g in tl.static_range(BLOCK_K // KG):
                k = (t0 + t) * BLOCK_K + g * KG
                offs_k = k + tl.arange(0, KG)
                if EVEN_K:
                    a_mask = m_mask[:, None]
                    w_mask = n_mask[:, None]
                else:
                    a_mask = m_mask[:, None] & (offs_k[None, :] < K)
                    w_mask = n_mask[:, None] & (offs_k[None, :] < K)
                a = tl.load(x_rows + offs_k[None, :], mask=a_mask, other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
                if ACT_QUANT:
                    a, sa = _act_quant_group(a.to(tl.float32))
                a, w = a.to(OPER), w.to(OPER)
                if SWAP_AB:
                    part = tl.dot(w, tl.trans(a), input_precision="ieee" if DOT == 2 else None)
                    if ACT_QUANT:
                        part = part * sa[None, :]
                else:
                    part = tl.dot(a, tl.trans(w), input_precision="ieee" if DOT == 2 else None)
                    if ACT_QUANT:
                        part = part * sa[:, None]
                if W_FP8:
                    if EVEN_K:
                        sw = tl.load(s_rows + k // B1, mask=n_mask, other=0)
                    else:
                        sw = tl.load(s_rows + k // B1, mask=n_mask & ((offs_n * 0 + k) < K), other=0)
                    if SCALE_E8M0:
                        sw = _e8m0_decode(sw)
                    if SWAP_AB:
                        acc += part * sw[:, None]
                    else:
                        acc += part * sw[None, :]
                else:
                    acc += part
    else:  # "weight" (1): scaled weight tile, one BLOCK_K-wide dot; "fma" (2): CUDA-core FMAs, no MMA
        if MODE == 2:  # products kept per K lane, summed once after the loop
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for t in range(0, n_tiles):
            k = (t0 + t) * BLOCK_K
            offs_k = k + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a_mask = m_mask[:, None]
                w_mask = n_mask[:, None]
            else:
                a_mask = m_mask[:, None] & (offs_k[None, :] < K)
                w_mask = n_mask[:, None] & (offs_k[None, :] < K)
            a = tl.load(x_rows + offs_k[None, :], mask=a_mask, other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
            if ACT_QUANT:
                a = _act_fake_quant(a.to(tl.float32), BLOCK_M, BLOCK_K, B1)
            if MODE == 2:
                if W_FP8:
                    w = _scaled_weight(w, s_rows, k, K, n_mask, B1, SCALE_E8M0, tl.float32, BLOCK_N, BLOCK_K)
                acc3 += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            else:
                if W_FP8:
                    w = _scaled_weight(w, s_rows, k, K, n_mask, B1, SCALE_E8M0, OPER, BLOCK_N, BLOCK_K)
                if SWAP_AB:
                    acc += tl.dot(
                        w.to(OPER), tl.trans(a.to(OPER)), input_precision="ieee" if DOT == 2 else None
                    )
                else:
                    acc += tl.dot(
                        a.to(OPER), tl.trans(w.to(OPER)), input_precision="ieee" if DOT == 2 else None
                    )
        if MODE == 2:
            acc = tl.sum(acc3, axis=2)
    if SWAP_AB:
        acc = tl.trans(acc)
    write_tile(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym, stride_split, pid_s,
                SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip


# e4m3 word (4 codes; byte i is column 4j + i, little-endian) -> its 4 values in fp32: Hopper converts two codes
# to f16 per instruction (exact: every e4m3 value, subnormals included, is an f16 normal), then f16 -> f32 (exact)
_E4M3_WORD_F32 = tl.constexpr(
    """
{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 p, q;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {h0, h1}, p;
mov.b32 {h2, h3}, q;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}
"""
)


@triton.jit
def _e4m3_byte_f32(w, i: tl.constexpr):
    """Byte i of int32 words of e4m3 codes -> the codes' values in fp32, by integer arithmetic (exact; the
    interpreter runs no PTX). Normal codes: the exponent rebiased by 127 - 7 = 120; subnormals: m * 2^-9. The NaN
    codes (0x7F / 0xFF, absent from checkpoints) decode to +-480 here and to NaN in the PTX path."""
    b = (w >> (8 * i)) & 0xFF
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _e4m3_words_f32(w, ASM: tl.constexpr):
    """int32 words of 4 e4m3 codes -> 4 fp32 tensors of w's shape (byte 0..3)."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _E4M3_WORD_F32, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4, is_pure=True, pack=1
        )
    else:
        f0 = _e4m3_byte_f32(w, 0)
        f1 = _e4m3_byte_f32(w, 1)
        f2 = _e4m3_byte_f32(w, 2)
        f3 = _e4m3_byte_f32(w, 3)
    return f0, f1, f2, f3


# One x word under a weight word -> its 4 activations in fp32, loaded in inline PTX (predicated by $5, zero when
# off). Triton would give a tl.load of x its own coalesced register layout and convert the decoded weight tile to
# it through shared memory every iteration; an asm op has no layout of its own, so it takes the weight's.
_X_LOAD_2B = tl.constexpr(
    """
{
.reg .pred p;
setp.ne.b32 p, $3, 0;
mov.b32 $0, 0;
mov.b32 $1, 0;
@p ld.global.v2.b32 {$0, $1}, [$2];
}
"""
)
_X_LOAD_F32 = tl.constexpr(
    """
{
.reg .pred p;
setp.ne.b32 p, $5, 0;
mov.b32 $0, 0;
mov.b32 $1, 0;
mov.b32 $2, 0;
mov.b32 $3, 0;
@p ld.global.v4.b32 {$0, $1, $2, $3}, [$4];
}
"""
)


@triton.jit
def _act_load(p, mask, X_KIND: tl.constexpr, ASM: tl.constexpr):
    """The activations under a weight word (4 columns), raw, 0 where masked off: X_KIND 0 / 1 (bf16 / fp16, p an
    int64 word of 4 values) -> (low, high 32 bits, 0, 0); 2 (fp32, p 16-byte aligned) -> the 4 values.

    ASM: one predicated PTX load per word. Triton gives a tl.load its own coalesced register layout and would
    convert the decoded weight tile to it through shared memory every iteration; an asm op has no layout of its
    own, so it takes the weight's. Else (the interpreter) tl.load."""
    if ASM:
        pm = tl.broadcast_to(mask.to(tl.int32), p.shape)
        if X_KIND == 2:
            r0, r1, r2, r3 = tl.inline_asm_elementwise(
                _X_LOAD_F32, "=r,=r,=r,=r,l,r", [p, pm], dtype=(tl.float32,) * 4, is_pure=True, pack=1
            )
        else:
            r0, r1 = tl.inline_asm_elementwise(
                _X_LOAD_2B, "=r,=r,l,r", [p, pm], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
            )
            r2 = 0
            r3 = 0
    elif X_KIND == 2:
        r0 = tl.load(p, mask=mask, other=0.0)
        r1 = tl.load(p + 1, mask=mask, other=0.0)
        r2 = tl.load(p + 2, mask=mask, other=0.0)
        r3 = tl.load(p + 3, mask=mask, other=0.0)
    else:
        v = tl.load(p, mask=mask, other=0)
        r0 = v.to(tl.int32)
        r1 = (v >> 32).to(tl.int32)
        r2 = 0
        r3 = 0
    return r0, r1, r2, r3


@triton.jit
def _act_planes(r0, r1, r2, r3, X_KIND: tl.constexpr):
    """`_act_load`'s raw words -> 4 fp32 planes: plane i holds column 4j + i of word j (bf16 -> fp32 is a shift)."""
    if X_KIND == 2:
        a0, a1, a2, a3 = r0, r1, r2, r3
    elif X_KIND == 0:
        a0 = (r0 << 16).to(tl.float32, bitcast=True)
        a1 = (r0 & -65536).to(tl.float32, bitcast=True)
        a2 = (r1 << 16).to(tl.float32, bitcast=True)
        a3 = (r1 & -65536).to(tl.float32, bitcast=True)
    else:
        a0 = r0.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        a1 = (r0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        a2 = r1.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        a3 = (r1 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return a0, a1, a2, a3


_S_LOAD_U8 = tl.constexpr(
    """
{
.reg .pred p;
.reg .b16 c;
setp.ne.b32 p, $2, 0;
mov.b16 c, 0;
@p ld.global.u8 c, [$1];
cvt.u32.u16 $0, c;
}
"""
)
_S_LOAD_B32 = tl.constexpr(
    """
{
.reg .pred p;
setp.ne.b32 p, $2, 0;
mov.b32 $0, 0;
@p ld.global.b32 $0, [$1];
}
"""
)


@triton.jit
def _weight_scales(p, mask, SCALE_E8M0: tl.constexpr, ASM: tl.constexpr):
    """Block scales at pointers p (UE8M0 bytes or fp32) -> fp32, 0 where masked off. ASM: PTX loads, for the same
    reason as the activations' (_X_LOAD_HEAD): the scales take the layout of the products they multiply."""
    if ASM:
        pm = tl.broadcast_to(mask.to(tl.int32), p.shape)
        if SCALE_E8M0:
            sc = tl.inline_asm_elementwise(_S_LOAD_U8, "=r,l,r", [p, pm], dtype=tl.int32, is_pure=True, pack=1)
        else:
            sc = tl.inline_asm_elementwise(_S_LOAD_B32, "=r,l,r", [p, pm], dtype=tl.float32, is_pure=True, pack=1)
    else:
        sc = tl.load(p, mask=mask, other=0)
    if SCALE_E8M0:
        sc = _e8m0_decode(sc)
    return sc


@triton.jit
def _act_quant_planes(a0, a1, a2, a3):
    """Activation planes [BLOCK_M, 1, G, V, 4] (one scale group = one (m, g)) -> their fake-quantized values q * s,
    the same numbers as `_act_quant_group` on the group's B1 contiguous columns."""
    amax = tl.maximum(tl.maximum(tl.abs(a0), tl.abs(a1)), tl.maximum(tl.abs(a2), tl.abs(a3)))
    amax = tl.maximum(tl.max(tl.max(amax, axis=4, keep_dims=True), axis=3, keep_dims=True), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    a0 = _round_e4m3(tl.clamp(a0 / s, -448.0, 448.0)) * s
    a1 = _round_e4m3(tl.clamp(a1 / s, -448.0, 448.0)) * s
    a2 = _round_e4m3(tl.clamp(a2 / s, -448.0, 448.0)) * s
    a3 = _round_e4m3(tl.clamp(a3 / s, -448.0, 448.0)) * s
    return a0, a1, a2, a3


@triton.jit
def _gemv_weight_tile(w_ptrs, s_ptrs, wm, kq, gs, kt, on, words, K, B1: tl.constexpr, SCALE_E8M0: tl.constexpr,
                      ASM: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """The int32 code words and the fp32 scales of the K tile starting at word kt (`on`: false past the split; kq:
    the word index that decides the K tail, see _gemv_linear_kernel)."""
    if EVEN_K:
        wmask = wm & on
        smask = wm & on
    else:
        wmask = wm & (kt + kq < words) & on
        smask = wm & (kt * 4 + gs * B1 < K) & on
    w = tl.load(w_ptrs + kt, mask=wmask, other=0)
    return w, _weight_scales(s_ptrs + kt // (B1 // 4), smask, SCALE_E8M0, ASM)


@triton.jit
def _gemv_act_tile(x_rows, xm, kw, kq, kt, on, words, XW: tl.constexpr, X_KIND: tl.constexpr, ASM: tl.constexpr,
                   EVEN_K: tl.constexpr):  # fmt: skip
    """`_act_load` of the activations under the K tile starting at word kt."""
    if EVEN_K:
        mask = xm & on
    else:
        mask = xm & (kt + kq < words) & on
    return _act_load(x_rows + (kt + kw) * XW, mask, X_KIND, ASM)


_L2_PREFETCH = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


@triton.jit
def _l2_prefetch_tiles(w_ptr, offs_n, stride_wn, kt, words, N, tiles, WPT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefetch into L2 the weight lines (128 bytes = 32 words) of `tiles` K tiles starting at word kt of the
    program's BLOCK_N rows (lines past K or N point at the row's first word instead: a harmless repeat)."""
    LINES: tl.constexpr = (WPT + 31) // 32
    line = tl.arange(0, LINES)[None, :] * 32
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for t in range(0, tiles):
        word = kt + t * WPT + line
        ok = (offs_n[:, None] < N) & (word < words)
        p = rows + tl.where(ok, word, 0)
        tl.inline_asm_elementwise(_L2_PREFETCH, "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


# same launch-invariant arguments as _linear_kernel: one compiled kernel per tile config and split / no split
@triton.jit(do_not_specialize=["stride_sn", "k_tiles_per_split", "group_n", "stride_xg"])
def _gemv_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_split,
    k_tiles_per_split,
    group_n,
    stride_xg,
    B0: tl.constexpr,
    B1: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    ACT_QUANT: tl.constexpr,
    X_KIND: tl.constexpr,
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,
    VEC_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = 0,
    L2_TILES: tl.constexpr = 0,
):
    """FP8 block-scaled GEMV for few rows ("gemv" mode): no MMA and no shared memory in the loop.

    w_ptr: the e4m3 weight as int32 words [N, K / 4] (stride_wn in words); x_ptr: x as int64 words of 4 values
    (X_KIND 0 / 1, strides in words) or fp32 (X_KIND 2, strides in elements). A K tile of BLOCK_K columns is
    [BLOCK_N, G scale groups, V vectors of 16 codes, 4 words]: each thread reads whole 16-byte vectors, decodes
    them in registers, multiplies by the matching activations on the CUDA cores (fp32 products, exact for bf16 /
    fp16 / e4m3 operands) and sums each vector's 16 products in registers; the group's weight scale multiplies
    that sum (a power of two for UE8M0: exact) into acc [BLOCK_M, BLOCK_N, G, V], reduced across threads once
    after the loop. PREFETCH 1: the next K tile's words and scales are loaded before this tile is computed
    (loop-carried registers), so DRAM latency overlaps the decode and the FMAs; 2: its activations too (more
    registers per row); 0: none.

    PDL (launched as a programmatic dependent launch, docs/pdl.md): the first K tile's weight words and scales
    (PREFETCH >= 1) are requested before the grid-dependency wait, and the weight lines of the next L2_TILES tiles
    are prefetched into L2, so their DRAM latency overlaps the previous kernel's tail; x is read and y, the
    workspace and the counters are written only after it. PDL_TRIGGER: launch_dependents after the wait (0),
    after the K loop (1) or never (2)."""
    G: tl.constexpr = BLOCK_K // B1
    V: tl.constexpr = B1 // 16
    WPT: tl.constexpr = BLOCK_K // 4  # words per K tile
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # every tensor of the loop is 5-D [BLOCK_M | 1, BLOCK_N | 1, G, V, 4] from its pointers on, so the weight's
    # coalesced load layout is the layout of the products too (broadcasting a 4-D tensor to 5-D would convert
    # layouts through shared memory every iteration)
    kw = (
        tl.arange(0, G)[None, None, :, None, None] * (B1 // 4)
        + tl.arange(0, V)[None, None, None, :, None] * 4
        + tl.arange(0, 4)[None, None, None, None, :]
    )  # [1, 1, G, V, 4] word of the K tile
    if VEC_K:  # K % 16 == 0: a 16-code vector is wholly in K or wholly past it, so the K-tail mask is constant
        # along it and the vector stays one 16-byte load
        kq = tl.arange(0, G)[None, None, :, None, None] * (B1 // 4) + tl.arange(0, V)[None, None, None, :, None] * 4
    else:
        kq = kw
    n5 = offs_n[None, :, None, None, None]
    w_ptrs = w_ptr + n5.to(tl.int64) * stride_wn + kw
    gs = tl.arange(0, G)[None, None, :, None, None]
    s_ptrs = s_ptr + (n5 // B0).to(tl.int64) * stride_sn + gs  # [1, BLOCK_N, G, 1, 1]
    x_rows = (
        x_ptr
        + ((pid_n * BLOCK_N) // group_n).to(tl.int64) * stride_xg
        + offs_m[:, None, None, None, None].to(tl.int64) * stride_xm
    )
    XW: tl.constexpr = 4 if X_KIND == 2 else 1  # x elements per x_ptr step in one word
    words = K // 4
    k_tiles = tl.cdiv(K, BLOCK_K)
    t0 = pid_s * k_tiles_per_split
    n_tiles = tl.minimum(k_tiles_per_split, k_tiles - t0)
    wm = n5 < N
    xm = m_mask[:, None, None, None, None]
    # every split has >= 1 tile; `on`: [1]-shaped predicates (the interpreter rejects a 0-d mask)
    one = tl.zeros([1, 1, 1, 1, 1], dtype=tl.int32)
    if PREFETCH >= 1:
        w_nxt, s_nxt = _gemv_weight_tile(w_ptrs, s_ptrs, wm, kq, gs, t0 * WPT, one == 0, words, K, B1, SCALE_E8M0,
                                         ASM, EVEN_K)  # fmt: skip
    if PDL:  # weights are constants; x may be the previous kernel's output
        if L2_TILES > 0 and ASM:  # PTX prefetch: none on the interpreter
            _l2_prefetch_tiles(w_ptr, offs_n, stride_wn, t0 * WPT + WPT, words, N,
                               tl.minimum(n_tiles - 1, L2_TILES), WPT, BLOCK_N)  # fmt: skip
        gdc_wait()
        if PDL_TRIGGER == 0:
            gdc_launch_dependents()
    if PREFETCH == 2:
        r0n, r1n, r2n, r3n = _gemv_act_tile(x_rows, xm, kw, kq, t0 * WPT, one == 0, words, XW, X_KIND, ASM, EVEN_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N, G, V, 1], dtype=tl.float32)
    for t in range(0, n_tiles):
        kt = (t0 + t) * WPT
        more = one + t + 1 < n_tiles
        # PREFETCH: tile t + 1 is loaded (predicated off past the split's last tile) before tile t is computed
        if PREFETCH >= 1:
            w_cur, s_cur = w_nxt, s_nxt
            w_nxt, s_nxt = _gemv_weight_tile(w_ptrs, s_ptrs, wm, kq, gs, kt + WPT, more, words, K, B1, SCALE_E8M0,
                                             ASM, EVEN_K)  # fmt: skip
        else:
            w_cur, s_cur = _gemv_weight_tile(w_ptrs, s_ptrs, wm, kq, gs, kt, one == 0, words, K, B1, SCALE_E8M0,
                                             ASM, EVEN_K)  # fmt: skip
        if PREFETCH == 2:
            r0, r1, r2, r3 = r0n, r1n, r2n, r3n
            r0n, r1n, r2n, r3n = _gemv_act_tile(x_rows, xm, kw, kq, kt + WPT, more, words, XW, X_KIND, ASM, EVEN_K)
        else:
            r0, r1, r2, r3 = _gemv_act_tile(x_rows, xm, kw, kq, kt, one == 0, words, XW, X_KIND, ASM, EVEN_K)
        a0, a1, a2, a3 = _act_planes(r0, r1, r2, r3, X_KIND)
        if ACT_QUANT:
            a0, a1, a2, a3 = _act_quant_planes(a0, a1, a2, a3)
        f0, f1, f2, f3 = _e4m3_words_f32(w_cur, ASM)
        p = a0 * f0 + a1 * f1 + a2 * f2 + a3 * f3  # [BLOCK_M, BLOCK_N, G, V, 4]
        acc += tl.sum(p, axis=4, keep_dims=True) * s_cur
    if PDL and PDL_TRIGGER == 1:
        gdc_launch_dependents()
    out = tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)
    write_tile(out, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym, stride_split, pid_s,
                SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip


def _dot_kind(x: Tensor, w_dtype: torch.dtype, interp: bool) -> int:
    if interp or x.dtype == torch.float32 or w_dtype == torch.float32:
        return _DOT_F32
    return _DOT_F16 if x.dtype == torch.float16 or w_dtype == torch.float16 else _DOT_BF16


def default_config(m: int, n: int, k: int, b1: int, dtype: torch.dtype, interp: bool = False) -> LinearConfig:
    """The launch config for x ``[M, K]`` (dtype) times an ``[N, K]`` weight (b1: the K scale group of an FP8
    weight; 1 for a plain weight). FP8 choices are the H200 sweep's at the V4.1 shapes
    (benchmarks/sweep_linear_fp8.py, docs/perf.md "FP8 linear at decode sizes"): the "gemv" kernel at M = 1 (any
    activation dtype); above that "weight" decode for bf16 / fp16 activations and CUDA-core "fma" for fp32
    activations at M <= 8 (exact fp32 without the slow fp32 MMA emulation); split-K by the occupancy policy; from
    DENSE_MIN_ROWS rows the "dense" mode (decode once, cuBLAS)."""
    if interp:
        return LinearConfig(16, 16, max(32, b1), 4, 1, 1, False, "weight" if b1 > 1 else "group")
    block_k = max(128, b1)
    if b1 == 1:  # plain bf16 / fp16 weight (LM head): measured at the bytes bound with these tiles
        return LinearConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64, block_k, 4, 4)
    if m >= DENSE_MIN_ROWS:  # prefill sizes: decode once, cuBLAS (module docstring)
        return LinearConfig(16, 64, block_k, 4, 1, 0, False, "dense")
    if m == 1:  # one token: CUDA-core gemv beat every MMA tile on every V4.1 shape (H200 sweep, 02:57 UTC)
        return _gemv_config(n, k)
    if dtype == torch.float32:
        if m <= 8:
            return LinearConfig(next_pow2(m), 16, max(256 if m <= 2 else 128, b1), 4, 3, 0, False, "fma")
        return LinearConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64, block_k, 4, 4)
    big = n * k >= FRAG_SMALL_M_WEIGHT
    if (FRAG_MIN_ROWS <= m or (8 <= m and big)) and m <= FRAG_MAX_ROWS and dtype == torch.bfloat16:
        return _frag_config(m, n, k)
    return _weight_config(m, n, k, b1)


def _weight_config(m: int, n: int, k: int, b1: int) -> LinearConfig:
    """The "weight" decode tiles for bf16 / fp16 activations (H200 sweep, docs/perf.md "FP8 linear at decode
    sizes"); also what a "frag" default falls back to for operands that kernel does not take."""
    block_k = max(128, b1)
    if m <= 16:
        return LinearConfig(16, 32 if n <= 2048 else 64, block_k, 4, 4, 0, False, "weight")
    if m <= 64:
        if n * k >= 16 * 2**20:  # large weights: wide swapped tiles stream best
            return LinearConfig(64, 128, block_k, 4, 3, 0, True, "weight")
        return LinearConfig(32, 64, block_k, 4, 3, 0, False, "weight")
    return LinearConfig(128, 64, block_k, 4, 3, 0, True, "weight")


def _frag_config(m: int, n: int, k: int) -> LinearConfig:
    """"frag" tiles from the H200 sweep (docs/perf.md "The frag FP8 linear"): up to 64 tokens per tile, 128 columns
    per K step, 64 weight rows per program (one warpgroup's wgmma M), 128 for very tall weights (N >= 16K: attn.wq_b
    and engram.wkv, 9-12% faster at 64 tokens)."""
    bm = min(64, max(16, next_pow2(m)))
    return LinearConfig(bm, 128 if n >= 16384 and m <= 64 else 64, 128, 4, 3, 0, False, "frag")


def _gemv_config(n: int, k: int) -> LinearConfig:
    """M = 1 "gemv" tiles from the H200 sweep (docs/perf.md "FP8 linear: the gemv mode"): K up to 5120 in
    1024-wide steps over 8 warps; very tall weights (N >= 16K) in 256-wide steps; the rest in 512. The occupancy
    split policy was within 1 us of the best explicit split / programs target on every shape."""
    if k % 1024 == 0 and k <= 5120:
        bn, bk, warps = 16, 1024, 8
    elif n >= 16384:
        bn, bk, warps = (32 if k <= 2048 else 16), 256, 4
    else:
        bn, bk, warps = 16, 512, 4
    return LinearConfig(block_m=1, block_n=bn, block_k=bk, num_warps=warps, num_stages=1, mode="gemv", prefetch=2)


def _split_count(cfg: LinearConfig, grid_mn: int, k_tiles: int, device: torch.device) -> int:
    """Split-K programs per output tile: the config's split, or its programs target over the output tiles (at most
    MAX_SPLIT), or enough to fill the GPU about twice, keeping >= 4 K tiles per program and at most 16 partials."""
    if cfg.split:
        want = cfg.split
    elif cfg.programs:
        want = min(cdiv(cfg.programs, max(1, grid_mn)), MAX_SPLIT)
    else:
        want = max(1, min(target_programs(device) // max(1, grid_mn), k_tiles // 4, 16))
    per = cdiv(k_tiles, max(1, min(want, k_tiles)))
    return cdiv(k_tiles, per)


def launch(
    x: Tensor,
    w: Tensor,
    s: Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int],
    act_quant: bool,
    op: str,
    config: LinearConfig | None = None,
    groups: int = 1,
    counters: Tensor | None = None,
    pdl: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """y [M, N] out_dtype = x [M, K] @ decode(w [N, K], s)ᵀ. ``config``: None = `default_config`; a benchmark or a
    test passes its own. Validation of shapes and dtypes is the dispatcher's (`deepinfer_kernels.linear`).
    ``counters``: int32 zeros on x's device (`deepinfer_kernels.linear.split_k_counters`), used by a split-K launch instead of fresh
    zeroed ones when it has room for the launch's tiles (left zero on return). ``pdl``: launch the "gemv" kernel and the
    activation pass (`act_fake_quant`) as programmatic dependent launches where `deepinfer_kernels._pdl.use_pdl`
    allows (docs/pdl.md); the MMA kernel always launches plainly.

    groups G > 1: x [M, G, K], w [G * R, K] block-diagonal -> y [M, G * R] with y[:, g R:(g+1) R] = x[:, g] @ W_gᵀ,
    one launch (the caller checks that every tile size of the config divides R).

    out: a contiguous [M, N] out_dtype tensor that y is written into (not with mode "dense")."""
    if groups > 1:
        m, k = x.shape[0], x.shape[2]
    else:
        m, k = x.shape
    n = w.shape[0]
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"{op}: out {out.dtype} {tuple(out.shape)}; expected a contiguous {out_dtype} {(m, n)}")
    if m == 0 or n == 0:
        return out if out is not None else torch.empty((m, n), dtype=out_dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    interp = check_launchable(op, _linear_kernel, x, w)
    b0, b1 = block if s is not None else (1, 1)
    cfg = config if config is not None else default_config(m, n, k, b1, x.dtype, interp)
    if s is not None and cfg.block_k % b1:
        raise ValueError(f"{op}: config block_k {cfg.block_k} is not a multiple of the scale block {b1}")
    if cfg.mode == "frag" and (why := fp8_frag.unsupported(x, w, s, block, cfg.block_k)) is not None:
        if config is not None:
            raise ValueError(f"{op}: mode 'frag' {why}; use another mode")
        cfg = _weight_config(m, n, k, b1)
    if cfg.mode == "gemv" and (s is None or k % 4):
        raise ValueError(f"{op}: mode 'gemv' needs an FP8 weight and K a multiple of 4 (int32 words of codes); "
                         f"found {'a plain weight' if s is None else f'K = {k}'}; use another mode")
    if s is not None and b1 < 16:
        raise ValueError(f"{op}: scale block {b1} along K is below the 16-column dot minimum")
    if groups > 1 and (n // groups) % cfg.block_n:
        raise ValueError(f"{op}: {n // groups} rows per group is not a multiple of the config's block_n {cfg.block_n}")
    if act_quant and s is not None and x.dtype != torch.float16:  # one pass over x (module docstring)
        x, act_quant = act_fake_quant(x, b1, pdl=pdl), False
    if cfg.mode == "dense":
        if s is None:
            raise ValueError(f"{op}: mode 'dense' decodes an FP8 weight; found a plain weight; use another mode")
        y = _dense(x, w, s, block, out_dtype, act_quant, groups, cfg)
        return y if out is None else out.copy_(y)
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid_n, grid_m = cdiv(n, cfg.block_n), cdiv(m, cfg.block_m)
    k_tiles = cdiv(k, cfg.block_k)
    split = _split_count(cfg, grid_n * grid_m, k_tiles, x.device)
    per = cdiv(k_tiles, split)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        tiles = grid_n * grid_m
        if counters is None or counters.numel() < tiles:  # e.g. a test's forced split of many tiles
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    else:
        ws, counters = y, y
    if s is not None and s.dtype == torch.float8_e8m0fnu:
        s_arg, e8m0 = s.view(torch.uint8), True
    else:
        s_arg, e8m0 = (s if s is not None else w), False
    if cfg.mode == "frag":
        fp8_frag.launch(x, w, s, y, ws, counters, (grid_n, grid_m, split), b0=b0, b1=b1, per=per, groups=groups,
                        block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, exact=cfg.exact_decode, interp=interp)  # fmt: skip
        return y
    if cfg.mode == "gemv":
        _launch_gemv(x, w, s_arg, y, ws, counters, (grid_n, grid_m, split), cfg, op=op, b0=b0, b1=b1, e8m0=e8m0,
                     act_quant=act_quant, per=per, groups=groups, interp=interp, pdl=pdl)  # fmt: skip
        return y
    _linear_kernel[(grid_n, grid_m, split)](
        x,
        w,
        s_arg,
        y,
        ws,
        counters,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        s_arg.stride(0) if s is not None else 0,
        y.stride(0),
        m * n,
        per,
        n // groups,
        x.stride(1) if groups > 1 else 0,
        B0=b0,
        B1=b1,
        W_FP8=s is not None,
        SCALE_E8M0=e8m0,
        ACT_QUANT=act_quant,
        DOT=_dot_kind(x, w.dtype if s is None else x.dtype, interp),
        EVEN_K=k % cfg.block_k == 0,
        SPLIT_K=split > 1,
        SWAP_AB=cfg.swap_ab,
        MODE=_MODES[cfg.mode],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=1 if interp else cfg.num_stages,
    )
    return y


def _dense(x: Tensor, w: Tensor, s: Tensor, block: tuple[int, int], out_dtype: torch.dtype, act_quant: bool,
           groups: int, cfg: LinearConfig) -> Tensor:  # fmt: skip
    """Mode "dense": the reference's computation (fake-quantized x in its dtype, the weight decoded to that dtype,
    one matmul) with the weight decode as a Triton kernel; groups as one batched matmul. bf16 / fp32 x arrive
    quantized (`launch`); act_quant is left only for fp16 x, rounded as the reference rounds q * s into fp16."""
    if act_quant:
        from deepinfer_kernels.quant import fake_quant_act_fp8

        x = fake_quant_act_fp8(x, block[1]).to(x.dtype)
    wd = dequant_fp8(w, s, block, x.dtype, block_n=cfg.block_n, block_k=cfg.block_k)
    if groups == 1:
        return torch.nn.functional.linear(x, wd).to(out_dtype)
    m, g, k = x.shape
    y = torch.bmm(x.transpose(0, 1), wd.view(g, -1, k).transpose(1, 2))  # [G, M, R]
    return y.transpose(0, 1).reshape(m, -1).to(out_dtype)


def _launch_gemv(x: Tensor, w: Tensor, s_arg: Tensor, y: Tensor, ws: Tensor, counters: Tensor, grid: tuple[int, ...],
                 cfg: LinearConfig, *, op: str, b0: int, b1: int, e8m0: bool, act_quant: bool, per: int, groups: int,
                 interp: bool, pdl: bool = False) -> None:  # fmt: skip
    """`_gemv_linear_kernel` on the same operands as `_linear_kernel`: the weight as int32 words, bf16 / fp16 x as int64
    words of 4 values (fp32 x as is), strides in those units."""
    if w.stride(0) % 4 or w.storage_offset() % 4:
        w = w.contiguous()
    x_kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[x.dtype]
    # a word's 4 activations are one aligned vector load (8 bytes bf16 / fp16, 16 bytes fp32)
    if any(st % 4 for st in x.stride()[:-1]) or x.data_ptr() % (16 if x_kind == 2 else 8):
        x = x.contiguous()
    xv = x if x_kind == 2 else x.view(torch.int64)
    wv = w.view(torch.int32)
    on = use_pdl(pdl, x.device, interpreted=interp)
    _gemv_linear_kernel[grid](
        xv,
        wv,
        s_arg,
        y,
        ws,
        counters,
        x.shape[0],
        w.shape[0],
        w.shape[1],
        xv.stride(0),
        wv.stride(0),
        s_arg.stride(0),
        y.stride(0),
        y.shape[0] * y.shape[1],
        per,
        w.shape[0] // groups,
        xv.stride(1) if groups > 1 else 0,
        B0=b0,
        B1=b1,
        SCALE_E8M0=e8m0,
        ACT_QUANT=act_quant,
        X_KIND=x_kind,
        ASM=not interp,
        PREFETCH=cfg.prefetch,
        EVEN_K=w.shape[1] % cfg.block_k == 0,
        VEC_K=w.shape[1] % 16 == 0,
        SPLIT_K=grid[2] > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PDL=on,
        PDL_TRIGGER=_PDL_TRIGGERS[cfg.pdl_trigger],
        L2_TILES=cfg.pdl_l2_tiles,
        num_warps=cfg.num_warps,
        num_stages=1 if interp else cfg.num_stages,
        **launch_kwargs(on),
    )


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    *,
    act_quant: bool,
    config: LinearConfig | None = None,
    counters: Tensor | None = None,
    pdl: bool = False,
) -> Tensor:
    """x [M, K] (bf16 / fp16 / fp32), weight [N, K] e4m3, scale [ceil(N/b0), ceil(K/b1)] e8m0 | f32 -> [M, N]
    x's dtype. Validated by the package dispatcher. pdl: see `launch`."""
    return launch(x, weight, scale, x.dtype, block=block, act_quant=act_quant, op="fp8_linear", config=config,
                  counters=counters, pdl=pdl)


def fp8_linear_grouped(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    *,
    act_quant: bool,
    config: LinearConfig | None = None,
    counters: Tensor | None = None,
    pdl: bool = False,
) -> Tensor | None:
    """x [M, G, K], weight [G * R, K] e4m3 block-diagonal, scale [G * R / b0, ceil(K / b1)] -> [M, G * R] x's
    dtype in one launch; None when the default tiles do not divide R (the caller runs the groups one by one)."""
    m, g, k = x.shape
    n = weight.shape[0]
    interp = check_launchable("fp8_linear_grouped", _linear_kernel, x, weight)
    cfg = config if config is not None else default_config(m, n, k, block[1], x.dtype, interp)
    if (n // g) % cfg.block_n:
        return None
    return launch(x, weight, scale, x.dtype, block=block, act_quant=act_quant, op="fp8_linear_grouped",
                  config=cfg, groups=g, counters=counters, pdl=pdl)


def linear_f32_out(
    x: Tensor, weight: Tensor, *, config: LinearConfig | None = None, counters: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """x [M, K], weight [N, K] bf16 / fp16 -> [M, N] float32 (fp32 accumulation, W read in its own dtype), written
    into `out` (a contiguous [M, N] float32) when given."""
    return launch(x, weight, None, torch.float32, block=(1, 1), act_quant=False, op="linear_f32_out", config=config,
                  counters=counters, out=out)
