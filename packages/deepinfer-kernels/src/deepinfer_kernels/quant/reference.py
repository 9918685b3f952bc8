"""Exact torch references for the checkpoint number formats (docs/checkpoint.md §6.2) and their inverse quantizers.

- E8M0 (UE8M0) scale byte b -> 2^(b-127); b = 255 is NaN (torch ``float8_e8m0fnu``). b = 0 is 2^-127, a float32
  subnormal, represented exactly.
- FP8 e4m3 weights with block scales: ``W[i, j] = fp8(Wq[i, j]) * S[i // b0, j // b1]``; shapes that are not a
  multiple of the block use a partial last block.
- FP4 e2m1 experts: two codes per byte, LOW nibble = even column 2k, HIGH nibble = column 2k+1; code -> value
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), bit 3 = sign; ``W[i, j] = v * S[i, j // 32]`` with E8M0 scales.

Pure torch, CPU-runnable, float32 results. No import-time work.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "act_quant_fp8",
    "dequant_fp4",
    "dequant_fp8_block",
    "e2m1_lut",
    "e2m1_values",
    "e8m0_to_float",
    "fake_quant_act_fp8",
    "float_to_e8m0",
    "pack_fp4",
    "pow2_ceil_scale",
    "quant_fp4",
    "quant_fp8_block",
    "unpack_fp4",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# e2m1 magnitude of codes 0..7 (sign in bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_lut(device: torch.device | str | None = None) -> torch.Tensor:
    """``[16] float32``: value of every e2m1 code (codes 8..15 are the negatives of 0..7; code 8 is -0.0)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.uint8,):
        return t
    if t.dtype in (torch.int8, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    raise TypeError(f"expected a uint8 / int8 / float8_e8m0fnu tensor, found dtype {t.dtype}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (``float8_e8m0fnu`` or ``uint8``, any shape) -> ``float32`` 2^(b-127); 255 -> NaN."""
    b = _as_uint8(scale).to(torch.int32)
    # float32 bit pattern of 2^(b-127): exponent field b for b >= 1; b = 0 is the subnormal 2^-127 = 0x00400000.
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> ``float8_e8m0fnu`` bytes (exact; raises on a value that is not 2^k)."""
    s = scale.to(torch.float32)
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    if not bool(torch.all((mant == 0.5) & torch.isfinite(s))):
        raise ValueError("float_to_e8m0: every scale must be a finite power of two")
    e = exp.to(torch.int32) - 1 + 127
    if bool(torch.any((e < 0) | (e > 254))):
        raise ValueError("float_to_e8m0: scale exponent outside [-127, 127]")
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        # torch's own conversion: exact, 255 -> NaN (tests compare it with e8m0_to_float on all 256 codes)
        return scale.to(torch.float32)
    if scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    if scale.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return scale.to(torch.float32)
    raise TypeError(f"scale dtype {scale.dtype}: expected float8_e8m0fnu (UE8M0) or float32")


def _expand_blocks(s: torch.Tensor, rows: int, cols: int, b0: int, b1: int) -> torch.Tensor:
    return s.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]


def _apply_blocks(w: torch.Tensor, s: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """w [rows, cols] float32 times the block scales s [ceil(rows/b0), ceil(cols/b1)] (one broadcast multiply when
    the blocks tile w exactly: this runs on every reference GEMM call)."""
    rows, cols = w.shape
    if rows % b0 == 0 and cols % b1 == 0:
        return (w.view(rows // b0, b0, cols // b1, b1) * s[:, None, :, None]).view(rows, cols)
    return w * _expand_blocks(s, rows, cols, b0, b1)


def dequant_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | int = 128
) -> torch.Tensor:
    """``weight [out, in] float8_e4m3fn`` x ``scale [ceil(out/b0), ceil(in/b1)] e8m0 | f32`` -> ``[out, in] f32``.

    Also used for the V4.1 Engram tables (``block=(1, 32)``: scale ``[N, 256/32]``).
    """
    b0, b1 = (block, block) if isinstance(block, int) else block
    if weight.dim() != 2:
        raise ValueError(
            f"dequant_fp8_block: weight must be 2-D [out, in], found shape {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    want = (-(-rows // b0), -(-cols // b1))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"dequant_fp8_block: scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {(b0, b1)}; expected {want}"
        )
    return _apply_blocks(weight.to(torch.float32), _scale_to_float(scale), b0, b1)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., in/2] int8`` (two e2m1 codes per byte, low nibble first) -> ``[..., in] float32`` code values."""
    u = _as_uint8(packed)
    codes = torch.stack([u & 0x0F, u >> 4], dim=-1).to(torch.int32)  # [..., in/2, 2]: low nibble first
    return e2m1_values(codes).flatten(-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Integer e2m1 codes 0..15 -> float32 values (the `e2m1_lut` values, -0.0 for code 8), by arithmetic on
    the bits: no lookup table, so no host-to-device copy inside a CUDA graph capture (decode steps read records)."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where(c >= 8, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., in]`` integer e2m1 codes 0..15 (in even) -> ``[..., in/2] int8``, low nibble = even column."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dimension must be even, found {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``weight [out, in/2] int8`` (packed e2m1) x ``scale [out, in/block] e8m0`` -> ``[out, in] float32``."""
    if weight.dim() != 2:
        raise ValueError(f"dequant_fp4: weight must be 2-D [out, in/2], found shape {tuple(weight.shape)}")
    rows, half = weight.shape
    cols = 2 * half
    want = (rows, -(-cols // block))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"dequant_fp4: scale shape {tuple(scale.shape)} does not match packed weight {tuple(weight.shape)} "
            f"(logical [{rows}, {cols}]) with 1x{block} blocks; expected {want}"
        )
    return _apply_blocks(unpack_fp4(weight), _scale_to_float(scale), 1, block)


# ------------------------------------------------------------------------------------------------
# dynamic activation quantization (FP8 e4m3, one power-of-two scale per 1 x group channels)

# Smallest group amax used for a scale: an all-zero group gets a tiny finite scale instead of 0 (DeepSeek's rule).
ACT_AMAX_MIN = 1e-4


def pow2_ceil_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(fp32(amax * fp32(1/448))))`` as float32 (amax clamped to >= 1e-4).

    Bit-exact definition shared with the Triton kernels: the product is rounded to fp32 first, then the
    power of two is read off its exponent field (+1 when any mantissa bit is set), so every backend gets the
    same scale. Because of that rounding, max |x| / s may exceed 448 by a rounding step; quantizers clamp.
    """
    x = amax.to(torch.float32).clamp(min=ACT_AMAX_MIN) * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def act_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` float -> (``[..., K] float8_e4m3fn``, scales ``[..., ceil(K/group)] float32`` powers of two).

    Per 1 x group channels: s = pow2_ceil_scale(max |x|), q = e4m3(clamp(x / s, -448, 448)) (round to nearest
    even). A partial last group uses its own amax.
    """
    k = x.shape[-1]
    ng = -(-k // group)
    xf = x.to(torch.float32)
    pad = torch.zeros(*x.shape[:-1], ng * group, dtype=torch.float32, device=x.device)
    pad[..., :k] = xf
    amax = pad.abs().view(*x.shape[:-1], ng, group).amax(dim=-1)
    s = pow2_ceil_scale(amax)
    sx = s.repeat_interleave(group, dim=-1)[..., :k]
    q = (xf / sx).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def fake_quant_act_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """``act_quant_fp8`` then back: ``[..., K] float32`` values q * s (exactly representable in bf16 too)."""
    q, s = act_quant_fp8(x, group)
    return q.to(torch.float32) * s.repeat_interleave(group, dim=-1)[..., : x.shape[-1]]


# ------------------------------------------------------------------------------------------------
# inverse quantizers (used by the random-checkpoint writer)


def _pow2_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= fmt_max (s = 1 for an all-zero block), clamped to E8M0 range."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / fmt_max))
    s = torch.exp2(e.clamp(-127, 127))
    # log2 rounding can land one step low; fix it so the block max is representable.
    s = torch.where(safe / s > fmt_max, s * 2, s)
    return torch.where(amax > 0, s, torch.ones_like(s))


def _block_amax(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.abs()
    return padded.view(nr, b0, nc, b1).amax(dim=(1, 3))


def quant_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] | int = 128, scale_fmt: str | None = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float -> (``[out, in] float8_e4m3fn``, ``[ceil(out/b0), ceil(in/b1)]`` scale).

    Scales are powers of two (so UE8M0 represents them exactly) chosen per block so that max |w| / s <= 448;
    ``scale_fmt="ue8m0"`` returns ``float8_e8m0fnu`` scales, ``None`` float32 scales.
    """
    b0, b1 = (block, block) if isinstance(block, int) else block
    w = weight.to(torch.float32)
    rows, cols = w.shape
    s = _pow2_scale(_block_amax(w, b0, b1), FP8_E4M3_MAX)
    q = (w / _expand_blocks(s, rows, cols, b0, b1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (float_to_e8m0(s) if scale_fmt == "ue8m0" else s)


def quant_fp4(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float (in a multiple of 2) -> (packed ``[out, in/2] int8``, ``[out, ceil(in/block)] e8m0``).

    Per 1 x block power-of-two scale with max |w| / s <= 6; each value rounds to the nearest e2m1 magnitude
    (ties to the smaller magnitude).
    """
    w = weight.to(torch.float32)
    rows, cols = w.shape
    s = _pow2_scale(_block_amax(w, 1, block), FP4_E2M1_MAX)
    x = w / _expand_blocks(s, rows, cols, 1, block)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    code = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)  # argmin keeps the first (smaller) on ties
    code = code + 8 * (x < 0).long()
    code = torch.where(code == 8, torch.zeros_like(code), code)  # write +0 rather than -0
    return pack_fp4(code), float_to_e8m0(s)
