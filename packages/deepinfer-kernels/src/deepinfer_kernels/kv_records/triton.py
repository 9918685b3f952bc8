"""Triton record encoder, decoder and fake quantizer: one launch per call, a program per R rows of the full width.

Bit-exact with the torch reference (`deepinfer_kernels.quant.kv_formats`): the quotient amax / qmax and the
reciprocal of a scale are correctly rounded (`div_rn`; Triton's `/` is an approximate division on the GPU), the
UE8M0 scale is built on the exponent bits, and e4m3 rounding (nearest, ties to even, subnormals included) and the
e2m1 midpoint search are integer / comparison arithmetic, so the interpreter on the CPU and the GPU compute the
same bytes as the reference.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable
from deepinfer_kernels.quant.kv_formats import FP4_E2M1_MAX, KVFormat

__all__ = ["decode", "encode", "fake_quant"]

_ELEMENTS_PER_PROGRAM = 2048  # rows per program = this / width: 16 values per thread at 4 warps
_INV6 = float(np.float32(1.0 / FP4_E2M1_MAX))  # the reference's float32 1/6


@triton.jit
def _e4m3_code(a):
    """Non-negative float32 a (<= 448) -> its e4m3 code (0..126), nearest with ties to even."""
    y = a * 512.0  # subnormal codes count steps of 2^-9 (exact: a power-of-two scaling)
    f = tl.floor(y)
    rem = y - f
    fi = f.to(tl.int32)
    sub = fi + ((rem > 0.5) | ((rem == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    bits = a.to(tl.int32, bitcast=True)
    keep = (bits >> 20) & 7
    low = bits & 0xFFFFF
    up = (low > 0x80000) | ((low == 0x80000) & ((keep & 1) == 1))
    norm = (((bits >> 23) - 120) << 3) + keep + up.to(tl.int32)  # a carry out of the mantissa bumps the exponent
    return tl.where(a < 0.015625, sub, norm)


@triton.jit
def _e4m3_value(code):
    """e4m3 code (0..126, no sign) -> its float32 value."""
    e = code >> 3
    m = code & 7
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, (m + 8).to(tl.float32) * pow2)


@triton.jit(do_not_specialize=["rows", "stride_x", "stride_o"])
def _records_kernel(x_ptr, out_ptr, rows, stride_x, stride_o, amax_floor, inv6, DIM: tl.constexpr,
                    BLOCK: tl.constexpr, E4M3: tl.constexpr, UE8M0: tl.constexpr, FAKE: tl.constexpr,
                    R: tl.constexpr):  # fmt: skip
    NB: tl.constexpr = DIM // BLOCK
    r = tl.program_id(0) * R + tl.arange(0, R)
    rok = r < rows
    r64 = r.to(tl.int64)
    c = tl.arange(0, DIM)
    x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=rok[:, None], other=0.0).to(tl.float32)
    xb = tl.reshape(x, (R, NB, BLOCK))
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), amax_floor)  # [R, NB]
    if UE8M0:
        qmax = 448.0 if E4M3 else 6.0
        q = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)).to(tl.int32, bitcast=True)
        e = (q >> 23) + ((q & 0x7FFFFF) != 0).to(tl.int32)  # the smallest power of two >= amax / qmax
        s = (e << 23).to(tl.float32, bitcast=True)
        sbyte = e & 0xFF
    else:  # NVFP4: an e4m3 scale
        sbyte = _e4m3_code(tl.minimum(amax * inv6, 448.0))
        s = _e4m3_value(sbyte)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    v = xb * inv[:, :, None]
    neg = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit: -0 keeps it, as the reference
    if E4M3:
        code = _e4m3_code(tl.minimum(tl.abs(v), 448.0))
        if FAKE:
            mag = _e4m3_value(code)
        else:
            code = code | (neg << 7)
    else:
        mag_v = tl.minimum(tl.abs(v), 6.0)
        lower = ((mag_v > 0.25).to(tl.int32) + (mag_v > 0.75).to(tl.int32) + (mag_v > 1.25).to(tl.int32)
                 + (mag_v > 1.75).to(tl.int32) + (mag_v > 2.5).to(tl.int32) + (mag_v > 3.5).to(tl.int32)
                 + (mag_v > 5.0).to(tl.int32))  # fmt: skip
        tie = ((mag_v == 0.25) | (mag_v == 0.75) | (mag_v == 1.25) | (mag_v == 1.75) | (mag_v == 2.5)
               | (mag_v == 3.5) | (mag_v == 5.0))  # fmt: skip
        code = lower + (tie & ((lower & 1) == 1)).to(tl.int32)  # a midpoint goes to the even code
        if FAKE:
            mag = tl.where(code < 4, code.to(tl.float32) * 0.5,
                           tl.where(code == 7, 6.0, (code - 2).to(tl.float32)))  # fmt: skip
        else:
            code = code | (neg << 3)
    o_row = out_ptr + r64[:, None] * stride_o
    if FAKE:
        val = mag * s[:, :, None]
        val = tl.where(neg == 1, -val, val)
        tl.store(o_row + c[None, :], tl.reshape(val, (R, DIM)).to(out_ptr.dtype.element_ty), mask=rok[:, None])
    else:
        if E4M3:
            tl.store(o_row + c[None, :], tl.reshape(code, (R, DIM)).to(tl.uint8), mask=rok[:, None])
            CB: tl.constexpr = DIM
        else:
            lo, hi = tl.split(tl.reshape(code, (R, DIM // 2, 2)))  # the even column in the low nibble
            c2 = tl.arange(0, DIM // 2)
            tl.store(o_row + c2[None, :], (lo | (hi << 4)).to(tl.uint8), mask=rok[:, None])
            CB: tl.constexpr = DIM // 2
        b = tl.arange(0, NB)
        tl.store(o_row + CB + b[None, :], sbyte.to(tl.uint8), mask=rok[:, None])


@triton.jit(do_not_specialize=["rows", "stride_r", "stride_o"])
def _decode_kernel(rec_ptr, out_ptr, rows, stride_r, stride_o, DIM: tl.constexpr, BLOCK: tl.constexpr,
                   E4M3: tl.constexpr, UE8M0: tl.constexpr, R: tl.constexpr):  # fmt: skip
    CB: tl.constexpr = DIM if E4M3 else DIM // 2
    r = tl.program_id(0) * R + tl.arange(0, R)
    rok = r < rows
    row = rec_ptr + r.to(tl.int64)[:, None] * stride_r
    c = tl.arange(0, DIM)
    sb = tl.load(row + CB + c[None, :] // BLOCK, mask=rok[:, None], other=0).to(tl.int32)  # each column's scale
    if UE8M0:
        s = (sb << 23).to(tl.float32, bitcast=True)
    else:
        s = _e4m3_value(sb)
    if E4M3:
        b = tl.load(row + c[None, :], mask=rok[:, None], other=0).to(tl.int32)
        mag = _e4m3_value(b & 0x7F)
        neg = b >> 7
    else:
        b = tl.load(row + c[None, :] // 2, mask=rok[:, None], other=0).to(tl.int32)
        code = (b >> ((c[None, :] & 1) * 4)) & 15  # the even column in the low nibble
        m = code & 7
        mag = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
        neg = code >> 3
    val = mag * s
    val = tl.where(neg == 1, -val, val)
    o = out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :]
    tl.store(o, val.to(out_ptr.dtype.element_ty), mask=rok[:, None])


def _launch(x2: Tensor, out: Tensor, fmt: KVFormat, fake: bool) -> None:
    rows, dim = x2.shape
    if rows == 0:
        return
    check_launchable("kv_records", _records_kernel, x2, out)
    r = max(1, _ELEMENTS_PER_PROGRAM // dim)
    _records_kernel[(cdiv(rows, r),)](
        x2, out, rows, x2.stride(0), out.stride(0), float(fmt.amax_floor), _INV6, DIM=dim, BLOCK=fmt.block,
        E4M3=fmt.element == "e4m3", UE8M0=fmt.scale == "ue8m0", FAKE=fake, R=r, num_warps=4,
    )  # fmt: skip


def _rows(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def encode(x: Tensor, fmt: KVFormat) -> Tensor:
    """x [rows, dim] (dim a power of two, a multiple of fmt.block) -> [rows, record_bytes] uint8 (reference.encode)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], fmt.record_bytes(x2.shape[1]), dtype=torch.uint8, device=x.device)
    _launch(x2, out, fmt, fake=False)
    return out


def decode(rec: Tensor, fmt: KVFormat, dtype: torch.dtype) -> Tensor:
    """rec [..., record_bytes] uint8 -> [..., dim] dtype (reference.decode)."""
    dim = fmt.record_dim(rec.shape[-1])
    r2 = _rows(rec)
    out = torch.empty(r2.shape[0], dim, dtype=dtype, device=rec.device)
    if r2.shape[0]:
        check_launchable("kv_records.decode", _decode_kernel, r2, out)
        r = max(1, _ELEMENTS_PER_PROGRAM // dim)
        _decode_kernel[(cdiv(r2.shape[0], r),)](r2, out, r2.shape[0], r2.stride(0), out.stride(0), DIM=dim,
                                                 BLOCK=fmt.block, E4M3=fmt.element == "e4m3",
                                                 UE8M0=fmt.scale == "ue8m0", R=r, num_warps=4)  # fmt: skip
    return out.reshape(*rec.shape[:-1], dim)


def fake_quant(x: Tensor, fmt: KVFormat) -> Tensor:
    """x [..., dim] -> [..., dim] in x.dtype (reference.fake_quant)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, out, fmt, fake=True)
    return out.reshape(x.shape)


