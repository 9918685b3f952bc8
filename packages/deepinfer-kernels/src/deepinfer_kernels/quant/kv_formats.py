"""Deployed KV-cache record formats of DeepSeek-V4.1 (torch references; docs/fidelity.md states the rules).

Three block formats, each quantizing rows of ``[rows, dim]`` along ``dim`` in blocks of ``block`` channels:

- ``MXFP8_E4M3``  — FP8 e4m3 codes, one UE8M0 (power-of-two) scale per 32 channels (sliding-window K/V).
- ``NVFP4_E2M1``  — FP4 e2m1 codes, two per byte, one FP8 e4m3 scale per 16 channels (compressed main KV).
- ``MXFP4_E2M1``  — FP4 e2m1 codes, two per byte, one UE8M0 scale per 32 channels (indexer keys / queries).

Rules (all arithmetic in float32 on the float32 value of the input):

- ``amax`` = max |x| over the block, raised to a floor (``amax_floor``) so an all-zero block gets a finite scale.
- UE8M0 scale: ``s = 2^ceil(log2(amax / qmax))`` (the smallest power of two with amax / s <= qmax, computed
  from the float32 quotient ``amax / qmax``); the byte is ``log2(s) + 127``.
- e4m3 scale (NVFP4): ``s = e4m3(min(amax * float32(1/6), 448))`` rounded to nearest even.
- Codes: ``x * (1 / s)`` (float32 reciprocal, exact for powers of two) rounded to nearest, ties to even, into the
  element format; FP4 saturates at +-6; FP8 values never exceed 448 by the choice of scale except through an
  e4m3 scale clamp, so they are clamped to +-448 before the cast. The sign is kept for values that round to
  zero (code 8 = -0 in e2m1, 0x80 in e4m3), as the hardware conversions do.
- Dequantization: ``value(code) * s`` in float32, then cast to the requested dtype.

FP4 packing matches the checkpoint expert decoder (``deepinfer_kernels.quant.unpack_fp4``): the LOW nibble holds
the even column 2k, the HIGH nibble column 2k+1; code bit 3 is the sign.

Inputs must be finite. Pure torch, CPU-runnable, no import-time work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer_kernels.quant.reference import E2M1_VALUES, FP4_E2M1_MAX, FP8_E4M3_MAX, pack_fp4, unpack_fp4

__all__ = [
    "KV_FORMATS",
    "MXFP4_E2M1",
    "MXFP8_E4M3",
    "NVFP4_E2M1",
    "KVFormat",
    "decode_records",
    "dequantize",
    "fake_quant",
    "quantize",
]


@dataclass(frozen=True)
class KVFormat:
    """One block-scaled record format: element type, channels per scale, scale type, amax floor."""

    name: str
    element: Literal["e4m3", "e2m1"]
    block: int
    scale: Literal["ue8m0", "e4m3"]
    amax_floor: float

    @property
    def qmax(self) -> float:
        return FP8_E4M3_MAX if self.element == "e4m3" else FP4_E2M1_MAX

    def code_bytes(self, dim: int) -> int:
        """Bytes of element codes for one row of ``dim`` channels."""
        return dim if self.element == "e4m3" else dim // 2

    def record_bytes(self, dim: int) -> int:
        """Bytes of one row record: codes followed by one byte per scale."""
        return self.code_bytes(dim) + dim // self.block

    def record_dim(self, nbytes: int) -> int:
        """Channels of a record of `nbytes` bytes (the inverse of record_bytes); ValueError if none fits."""
        per_block = self.code_bytes(self.block) + 1
        if nbytes % per_block:
            raise ValueError(f"{self.name}: {nbytes} bytes is not a whole number of {per_block}-byte blocks")
        return nbytes // per_block * self.block


# amax floors keep an all-zero block's scale finite and normal: 1e-4 for FP8, 6 * 2^-126 (scale 2^-126)
# for MXFP4, 6 * 2^-9 (scale = the smallest e4m3 subnormal, 2^-9) for NVFP4.
MXFP8_E4M3 = KVFormat("mxfp8_e4m3", "e4m3", 32, "ue8m0", 1e-4)
NVFP4_E2M1 = KVFormat("nvfp4_e2m1", "e2m1", 16, "e4m3", FP4_E2M1_MAX * 2.0**-9)
MXFP4_E2M1 = KVFormat("mxfp4_e2m1", "e2m1", 32, "ue8m0", FP4_E2M1_MAX * 2.0**-126)
KV_FORMATS = {f.name: f for f in (MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1)}

# Tie points between neighbouring e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:], strict=True))


def _check_rows(x: torch.Tensor, fmt: KVFormat) -> None:
    if x.dim() != 2:
        raise ValueError(f"{fmt.name}: expected a 2-D [rows, dim] tensor, found shape {tuple(x.shape)}")
    if x.shape[1] % fmt.block:
        raise ValueError(
            f"{fmt.name}: dim {x.shape[1]} is not a multiple of the {fmt.block}-channel block; "
            f"pad the channel dimension to a multiple of {fmt.block}"
        )


def _pow2_ceil(q: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= q for positive normal float32 q (exact: works on the exponent field)."""
    bits = q.view(torch.int32)
    # a positive float is a power of two iff its mantissa field is zero; otherwise bump the exponent by one.
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _block_scales(xb: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``xb [rows, nblocks, block] f32`` -> (float32 scale ``[rows, nblocks]``, scale bytes ``uint8``)."""
    amax = xb.abs().amax(dim=-1).clamp_min(fmt.amax_floor)
    if fmt.scale == "ue8m0":
        s = _pow2_ceil(amax / fmt.qmax)
        byte = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        return s, byte
    inv6 = torch.tensor(1.0 / FP4_E2M1_MAX, dtype=torch.float32)
    s8 = (amax * inv6).clamp_max(FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return s8.to(torch.float32), s8.view(torch.uint8)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by the scale) -> e2m1 codes 0..15, nearest with ties to the even code."""
    mag = v.abs().clamp_max(FP4_E2M1_MAX)
    # comparisons with Python floats, not a device tensor of midpoints: building one is a host-to-device copy,
    # which a CUDA graph capture (the engine's decode steps write records) does not allow
    lower = torch.zeros(mag.shape, dtype=torch.long, device=mag.device)
    on_tie = torch.zeros(mag.shape, dtype=torch.bool, device=mag.device)
    for m in _E2M1_MIDPOINTS:
        lower += mag > m  # the lower neighbour's code: a value equal to a midpoint lands below it
        on_tie |= mag == m
    code = lower + (on_tie & (lower % 2 == 1)).long()
    return (code + 8 * torch.signbit(v).long()).to(torch.uint8)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, dim]`` float -> (codes ``uint8``, scales ``uint8 [rows, dim / block]``).

    Codes are ``[rows, dim]`` e4m3 bit patterns for FP8 and ``[rows, dim / 2]`` packed nibbles for FP4. Scale
    bytes are UE8M0 exponents (value ``2^(b - 127)``) or e4m3 bit patterns.
    """
    _check_rows(x, fmt)
    rows, dim = x.shape
    xb = x.to(torch.float32).reshape(rows, dim // fmt.block, fmt.block)
    s, scale_bytes = _block_scales(xb, fmt)
    v = xb * torch.reciprocal(s).unsqueeze(-1)
    if fmt.element == "e4m3":
        codes = v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return codes.reshape(rows, dim), scale_bytes
    return pack_fp4(_e2m1_codes(v).reshape(rows, dim)).view(torch.uint8), scale_bytes


def _scale_values(scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    if fmt.scale == "ue8m0":
        return (scales.to(torch.int32) << 23).view(torch.float32)
    return scales.view(torch.float8_e4m3fn).to(torch.float32)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(codes, scales) from :func:`quantize` -> ``[rows, dim]`` values in ``dtype`` (product taken in float32)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{fmt.name}: codes and scales must be uint8, found {codes.dtype} / {scales.dtype}")
    rows = codes.shape[0]
    dim = codes.shape[1] if fmt.element == "e4m3" else 2 * codes.shape[1]
    if codes.dim() != 2 or tuple(scales.shape) != (rows, dim // fmt.block) or dim % fmt.block:
        raise ValueError(
            f"{fmt.name}: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not form a record set; "
            f"expected scales ({rows}, {dim // fmt.block}) for {dim} channels in blocks of {fmt.block}"
        )
    if fmt.element == "e4m3":
        vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        vals = unpack_fp4(codes)
    out = vals.reshape(rows, dim // fmt.block, fmt.block) * _scale_values(scales, fmt).unsqueeze(-1)
    return out.reshape(rows, dim).to(dtype)


def decode_records(rec: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Record rows ``[..., record_bytes] uint8`` (codes, then scale bytes: the caches' row layout) -> values
    ``[..., dim]`` in ``dtype``."""
    dim = fmt.record_dim(rec.shape[-1])
    flat = rec.reshape(-1, rec.shape[-1])
    cb = fmt.code_bytes(dim)
    return dequantize(flat[:, :cb], flat[:, cb:], fmt, dtype).reshape(*rec.shape[:-1], dim)


def fake_quant(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``dequantize(quantize(x))`` for ``x [..., dim]`` (leading dims flattened to rows), in ``x.dtype``."""
    flat = x.reshape(-1, x.shape[-1])
    codes, scales = quantize(flat, fmt)
    return dequantize(codes, scales, fmt, x.dtype).reshape(x.shape)
