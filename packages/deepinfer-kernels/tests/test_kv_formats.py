"""KV record formats (MXFP8 e4m3/UE8M0-32, NVFP4 e2m1/e4m3-16, MXFP4 e2m1/UE8M0-32) against a scalar reference.

The reference below is written independently of the module: it enumerates every representable value of the
element and scale formats and picks the nearest (ties to the even code) in plain Python / numpy float32.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from deepinfer_kernels.quant import unpack_fp4
from deepinfer_kernels.quant.kv_formats import (
    KV_FORMATS,
    MXFP4_E2M1,
    MXFP8_E4M3,
    NVFP4_E2M1,
    KVFormat,
    dequantize,
    fake_quant,
    quantize,
)

F32 = np.float32


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


E4M3_TABLE = [(_e4m3_value(c), c) for c in range(256) if not math.isnan(_e4m3_value(c))]
E2M1_TABLE = [
    (v, c) for c, v in enumerate([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
]


def _nearest(table: list[tuple[float, int]], v: float) -> int:
    """Nearest code with the sign of v (ties: even code), values beyond the largest saturate."""
    neg = math.copysign(1.0, v) < 0
    cands = [(val, c) for val, c in table if (math.copysign(1.0, val) < 0) == neg]
    best = min(abs(val - v) for val, _ in cands)
    ties = sorted(c for val, c in cands if abs(val - v) == best)
    even = [c for c in ties if c % 2 == 0]
    return (even or ties)[0]


def _ref_row(row: list[float], fmt: KVFormat) -> tuple[list[int], list[int], list[float]]:
    """One row -> (element codes, scale bytes, dequantized values), scalar reference."""
    qmax = 448.0 if fmt.element == "e4m3" else 6.0
    table = E4M3_TABLE if fmt.element == "e4m3" else E2M1_TABLE
    codes, sbytes, deq = [], [], []
    for b in range(0, len(row), fmt.block):
        blk = [F32(v) for v in row[b : b + fmt.block]]
        amax = max(F32(max(abs(v) for v in blk)), F32(fmt.amax_floor))
        if fmt.scale == "ue8m0":
            q = float(F32(amax) / F32(qmax))
            mant, exp = math.frexp(q)  # q = mant * 2^exp, mant in [0.5, 1)
            k = exp - 1 if mant == 0.5 else exp
            s = 2.0**k
            sbytes.append(k + 127)
        else:
            t = min(float(F32(amax) * F32(1.0 / 6.0)), 448.0)
            sc = _nearest(E4M3_TABLE, t)
            s = _e4m3_value(sc)
            sbytes.append(sc)
        inv = F32(1.0) / F32(s)
        for v in blk:
            scaled = float(F32(v) * inv)
            c = _nearest(table, max(-qmax, min(qmax, scaled)))
            codes.append(c)
            deq.append(dict((cc, vv) for vv, cc in table)[c] * s)
    return codes, sbytes, deq


def _check_against_reference(x: torch.Tensor, fmt: KVFormat) -> None:
    codes, scales = quantize(x, fmt)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert scales.shape == (x.shape[0], x.shape[1] // fmt.block)
    elem = codes if fmt.element == "e4m3" else _unpack_codes(codes)
    back = dequantize(codes, scales, fmt, torch.float32)
    for r in range(x.shape[0]):
        rc, rs, rd = _ref_row(x[r].tolist(), fmt)
        assert elem[r].tolist() == rc, (fmt.name, r)
        assert scales[r].tolist() == rs, (fmt.name, r)
        got = back[r].tolist()
        assert all((a == b) and (math.copysign(1, a) == math.copysign(1, b)) for a, b in zip(got, rd)), (
            fmt.name,
            r,
        )


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


ALL = [MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1]


def test_formats_and_record_bytes() -> None:
    assert set(KV_FORMATS) == {"mxfp8_e4m3", "nvfp4_e2m1", "mxfp4_e2m1"}
    # V4.1 records: SWA 512 fp8 + 16 scales; main KV 256 B + 32 scales; index keys 64 B + 4 scales.
    assert MXFP8_E4M3.record_bytes(512) == 528
    assert NVFP4_E2M1.record_bytes(512) == 288
    assert MXFP4_E2M1.record_bytes(128) == 68
    assert 3 * (288 + 68) / 2 + (288 + 68) == 890


@pytest.mark.parametrize("fmt", [NVFP4_E2M1, MXFP4_E2M1], ids=lambda f: f.name)
def test_all_16_e2m1_codes_round_trip_exactly(fmt: KVFormat) -> None:
    # a block whose amax is 6 with a unit scale: every e2m1 value is representable and must come back exactly.
    values = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # amax 6 -> UE8M0 scale 2^0, NVFP4 scale e4m3(6 / 6) = 1
    row = torch.tensor(values * (fmt.block // 16) * 2, dtype=torch.float32)[None, :]
    codes, scales = quantize(row, fmt)
    assert _unpack_codes(codes)[0, :16].tolist() == list(range(16))
    if fmt.scale == "ue8m0":
        assert scales.unique().tolist() == [127]
    else:
        assert scales.view(torch.float8_e4m3fn).float().unique().tolist() == [1.0]
    back = dequantize(codes, scales, fmt)
    assert torch.equal(back, row) and torch.equal(torch.signbit(back), torch.signbit(row))
    # nibble order is the checkpoint decoder's: its unpack gives the same values
    assert torch.equal(unpack_fp4(codes), row)
    _check_against_reference(row, fmt)


def test_e2m1_rounding_ties_to_even_and_saturation() -> None:
    # unit scale (amax pinned to 6 by the last entry); the midpoints go to the even code
    probes = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 5.1, 2.9, -0.25, -0.75, -5.0, -0.1]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 6.0, 3.0, -0.0, -1.0, -4.0, -0.0]
    row = torch.tensor(probes + [0.0] * (31 - len(probes)) + [6.0])[None, :]
    back = fake_quant(row, MXFP4_E2M1)[0, : len(probes)]
    assert back.tolist() == expect
    assert torch.signbit(back[-1]) and torch.signbit(back[11])  # -0 keeps its sign (code 8)
    # NVFP4 with a scale clamped at 448: amax 6 * 448 * 4 saturates to 6 * 448
    big = torch.full((1, 16), 6.0 * 448 * 4)
    codes, scales = quantize(big, NVFP4_E2M1)
    assert scales.view(torch.float8_e4m3fn).float().tolist() == [[448.0]]
    assert dequantize(codes, scales, NVFP4_E2M1).unique().tolist() == [6.0 * 448]
    _check_against_reference(big, NVFP4_E2M1)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_zero_blocks_use_the_amax_floor(fmt: KVFormat) -> None:
    x = torch.zeros(2, 64)
    x[1, :] = -0.0
    codes, scales = quantize(x, fmt)
    if fmt is MXFP8_E4M3:
        # 1e-4 / 448 -> 2^-22: byte 105
        assert scales.unique().tolist() == [127 - 22]
    elif fmt is MXFP4_E2M1:
        assert scales.unique().tolist() == [1]  # 2^-126
    else:
        assert scales.view(torch.float8_e4m3fn).float().unique().tolist() == [2.0**-9]  # smallest e4m3
    back = dequantize(codes, scales, fmt)
    assert (back == 0).all()
    assert torch.equal(torch.signbit(back), torch.signbit(x))
    _check_against_reference(x, fmt)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_scale_edges_exact_powers_and_tiny_and_huge_blocks(fmt: KVFormat) -> None:
    qmax = fmt.qmax
    rows = []
    for amax in [
        qmax,
        qmax * 2.0**-30,
        qmax * 2**20,
        qmax * 1.0000001,
        qmax * 0.9999999,
        1e-30,
        1e37,
        448.0 * 6,
    ]:
        r = torch.linspace(-1, 1, 64) * 0.37
        r[5] = amax
        rows.append(r)
    x = torch.stack(rows)
    _check_against_reference(x, fmt)
    codes, scales = quantize(x, fmt)
    if fmt.scale == "ue8m0":
        s = (scales.to(torch.int32) << 23).view(torch.float32)
        # exact power: amax / qmax = 1 -> scale 1; just above -> 2; just below -> 1
        assert s[0, 0].item() == 1.0 and s[3, 0].item() == 2.0 and s[4, 0].item() == 1.0
        assert s[2, 0].item() == 2.0**20


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_subnormal_inputs(fmt: KVFormat) -> None:
    # float32 subnormals and values that land in the element format's subnormal range after scaling
    x = torch.zeros(3, 64)
    x[0] = torch.arange(64) * 1e-42  # float32 subnormals (below every amax floor)
    x[1] = torch.linspace(-1, 1, 64) * 2.0**-8  # e4m3 subnormal territory under a 1e-4 floor
    x[2, 0] = 448.0
    x[2, 1:] = torch.linspace(-1, 1, 63) * 2.0**-6  # a large block max pushes the rest into subnormals
    _check_against_reference(x, fmt)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_random_rows_match_reference_and_error_bound(fmt: KVFormat) -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(torch.bfloat16).float()
    _check_against_reference(x, fmt)
    codes, scales = quantize(x, fmt)
    back = dequantize(codes, scales, fmt).reshape(6, -1, fmt.block)
    xb = x.reshape(6, -1, fmt.block)
    s_blk = (
        (scales.to(torch.int32) << 23).view(torch.float32)
        if fmt.scale == "ue8m0"
        else scales.view(torch.float8_e4m3fn).float()
    ).unsqueeze(-1)
    # half the widest element spacing (e4m3: 32 in [256, 448]; e2m1: 2 in [4, 6]) plus any saturation
    half_gap = 16.0 if fmt.element == "e4m3" else 1.0
    bound = s_blk * half_gap + (xb.abs() - fmt.qmax * s_blk).clamp_min(0)
    assert ((back - xb).abs() <= bound).all()
    # and the fp8 path is relative for normals: at most half an ulp of a 3-bit mantissa
    if fmt.element == "e4m3":
        normal = xb.abs() >= s_blk * 2.0**-6
        assert ((back - xb).abs() <= xb.abs() * 2.0**-4)[normal].all()


def test_fake_quant_keeps_shape_and_dtype_and_is_idempotent() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    for fmt in ALL:
        y = fake_quant(x, fmt)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        assert torch.equal(fake_quant(y, fmt), y)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="multiple of the 32-channel block"):
        quantize(torch.zeros(2, 48), MXFP8_E4M3)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(64), MXFP4_E2M1)
    codes, scales = quantize(torch.zeros(2, 64), NVFP4_E2M1)
    with pytest.raises(ValueError, match="expected scales"):
        dequantize(codes, scales[:, :2], NVFP4_E2M1)
    with pytest.raises(TypeError, match="uint8"):
        dequantize(codes.view(torch.int8), scales, NVFP4_E2M1)
