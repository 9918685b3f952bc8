"""FP8 block / FP4 e2m1 / E8M0 references against hand-computed values, plus the inverse quantizers."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels.quant import (
    dequant_fp4,
    dequant_fp8_block,
    e2m1_lut,
    e8m0_to_float,
    float_to_e8m0,
    pack_fp4,
    quant_fp4,
    quant_fp8_block,
    unpack_fp4,
)


def _e8m0(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_all_256_codes() -> None:
    got = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    for b in range(255):
        assert got[b].item() == math.ldexp(1.0, b - 127), b  # includes b=0: 2^-127 (float32 subnormal)
    assert math.isnan(got[255].item())
    # same through the float8_e8m0fnu dtype
    got2 = e8m0_to_float(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert torch.equal(got[:255], got2[:255]) and math.isnan(got2[255].item())
    assert got[127].item() == 1.0 and got[128].item() == 2.0 and got[126].item() == 0.5


def test_float_to_e8m0_inverse_and_rejects_non_powers() -> None:
    s = torch.tensor([1.0, 2.0, 0.5, 2.0**-127, 2.0**127, 2.0**-20])
    assert float_to_e8m0(s).view(torch.uint8).tolist() == [127, 128, 126, 0, 254, 107]
    with pytest.raises(ValueError, match="power of two"):
        float_to_e8m0(torch.tensor([3.0]))


def test_e2m1_all_16_codes() -> None:
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert e2m1_lut().tolist() == expected
    # each code in the low and in the high nibble (other nibble 0)
    for code in range(16):
        lo = unpack_fp4(torch.tensor([[code]], dtype=torch.uint8).view(torch.int8))
        hi = unpack_fp4(torch.tensor([[code << 4]], dtype=torch.uint8).view(torch.int8))
        assert lo.tolist() == [[expected[code], 0.0]]
        assert hi.tolist() == [[0.0, expected[code]]]


def test_fp4_nibble_order_low_nibble_is_even_column() -> None:
    # 0x21: low nibble 1 (0.5) -> column 0, high nibble 2 (1.0) -> column 1; 0x7F: low 15 (-6), high 7 (6)
    packed = torch.tensor([[0x21, 0x7F]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -6.0, 6.0]]
    assert pack_fp4(torch.tensor([[1, 2, 15, 7]])).view(torch.uint8).tolist() == [[0x21, 0x7F]]


def test_dequant_fp4_scales_per_1x32_block() -> None:
    # logical [2, 64]: row 0 all code 2 (1.0), row 1 all code 13 (-3.0); scales [2, 2]
    codes = torch.tensor([[2] * 64, [13] * 64])
    w = pack_fp4(codes)
    assert w.shape == (2, 32) and w.dtype == torch.int8
    scale = _e8m0([[128, 125], [127, 130]])  # 2, 1/4, 1, 8
    out = dequant_fp4(w, scale)
    assert out[0, :32].unique().tolist() == [2.0] and out[0, 32:].unique().tolist() == [0.25]
    assert out[1, :32].unique().tolist() == [-3.0] and out[1, 32:].unique().tolist() == [-24.0]
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequant_fp4(w, _e8m0([[127], [127]]))


def test_dequant_fp8_block_with_partial_edge_blocks() -> None:
    # weight [3, 5] with 2x2 blocks -> scale [2, 3]; edge blocks are 1 row / 1 column wide.
    vals = torch.tensor(
        [[1.0, -0.75, 2.0, 3.5, 448.0], [0.5, 1.0, -1.0, 0.125, -2.0], [6.0, 7.0, 8.0, 9.0, 10.0]]
    )
    w = vals.to(torch.float8_e4m3fn)
    assert torch.equal(w.float(), vals)  # all exactly representable in e4m3
    scale = _e8m0([[127, 128, 126], [129, 120, 131]])  # 1, 2, .5 / 4, 2^-7, 16
    out = dequant_fp8_block(w, scale, block=2)
    expected = torch.tensor(
        [
            [1.0, -0.75, 4.0, 7.0, 224.0],
            [0.5, 1.0, -2.0, 0.25, -1.0],
            [24.0, 28.0, 8.0 / 128, 9.0 / 128, 160.0],
        ]
    )
    assert torch.equal(out, expected)
    # float32 scales (V4-Flash-Base style) give the same
    out32 = dequant_fp8_block(w, e8m0_to_float(scale), block=(2, 2))
    assert torch.equal(out32, expected)
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequant_fp8_block(w, _e8m0([[127, 127]]), block=2)


def test_dequant_fp8_block_nan_scale_propagates() -> None:
    w = torch.ones(2, 2).to(torch.float8_e4m3fn)
    out = dequant_fp8_block(w, _e8m0([[255]]), block=2)
    assert torch.isnan(out).all()


def test_quant_fp8_block_picks_power_of_two_scale_and_round_trips() -> None:
    torch.manual_seed(0)
    w = torch.randn(70, 45) * 0.05
    w[0, 0] = 896.0  # block (0,0) amax 896 -> scale 2 exactly (896/2 = 448)
    w[64:, 32:] = 0.0  # all-zero edge block (2, 1) -> scale 1
    q, s = quant_fp8_block(w, block=32)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    sf = e8m0_to_float(s)
    assert sf[0, 0].item() == 2.0 and sf[2, 1].item() == 1.0
    back = dequant_fp8_block(q, s, block=32)
    assert back[0, 0].item() == 896.0
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 -> abs error <= s * 2^-10
    s_full = sf.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :45]
    assert ((back - w).abs() <= w.abs() * 2**-4 + s_full * 2**-10).all()
    # every block's max |q| fits 448 and uses the top binade (scale is the smallest power of two that fits)
    qa = q.float().abs()
    assert qa.max().item() <= 448.0
    assert qa[32:64, 0:32].max().item() > 224.0
    _, s32 = quant_fp8_block(w, block=32, scale_fmt=None)
    assert s32.dtype == torch.float32 and torch.equal(s32, sf)


def test_quant_fp4_round_trip_and_nearest_code() -> None:
    # one row, one block: amax 12 -> scale 2; x/2 = [0.26 -> 0.5, 0.74 -> 0.5, 2.6 -> 3, -6, 1.25 -> 1 (tie), 0]
    row = torch.tensor([0.52, 1.48, 5.2, -12.0, 2.5, 0.0] + [0.0] * 26)
    packed, s = quant_fp4(row[None, :])
    assert e8m0_to_float(s).tolist() == [[2.0]]
    back = dequant_fp4(packed, s)
    assert back[0, :6].tolist() == [1.0, 1.0, 6.0, -12.0, 2.0, 0.0]
    torch.manual_seed(1)
    w = torch.randn(8, 96)
    p2, s2 = quant_fp4(w)
    assert p2.shape == (8, 48) and s2.shape == (8, 3)
    err = (dequant_fp4(p2, s2) - w).abs()
    scale = e8m0_to_float(s2).repeat_interleave(32, dim=1)
    assert (err <= scale * 1.0).all()  # half of the widest e2m1 gap (4 -> 6) times the block scale
    amax = w.abs().view(8, 3, 32).amax(-1)
    assert (amax / e8m0_to_float(s2) <= 6).all() and (amax / e8m0_to_float(s2) > 3).all()  # smallest 2^k
