"""`linear` references and dispatch: FP8 block-scaled linear = float matmul with the exactly decoded weight
(bit-equal in fp32), activation quantization = the e4m3 / power-of-two-scale rule, fp32-output head GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deepinfer_kernels.linear import fp8_linear, linear_f32_out
from deepinfer_kernels.quant import (
    act_quant_fp8,
    dequant_fp8_block,
    fake_quant_act_fp8,
    pow2_ceil_scale,
    quant_fp8_block,
)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_fp8_linear_reference_equals_load_time_dequant(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 200, generator=g) / 14
    q, s = quant_fp8_block(w, block)
    x = torch.randn(5, 200, generator=g)
    got = fp8_linear(x, q, s, block, backend="torch")
    assert torch.equal(got, F.linear(x, dequant_fp8_block(q, s, block)))  # fp32: bit-equal
    xb = x.bfloat16()
    assert torch.equal(
        fp8_linear(xb, q, s, block, backend="torch"), F.linear(xb, dequant_fp8_block(q, s, block).bfloat16())
    )
    # leading dims are kept
    assert fp8_linear(x.view(5, 1, 200), q, s, block, backend="torch").shape == (5, 1, 70)


def test_fp8_linear_rejects_bad_scale_and_dtype():
    q, s = quant_fp8_block(torch.randn(64, 64), 32)
    with pytest.raises(ValueError, match=r"scale shape \(2, 2\).*expected \(1, 1\)"):
        fp8_linear(torch.randn(1, 64), q, s, (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.randn(1, 64), q.float(), s, (32, 32))


def test_pow2_scale_rule_and_edges():
    amax = torch.tensor([448.0, 449.0, 0.0, 1e-9, 1.0, 896.0, 3e38])
    s = pow2_ceil_scale(amax)
    # exact powers of two, smallest with amax * fp32(1/448) <= s, amax clamped to 1e-4
    assert torch.equal(s[:6], torch.tensor([1.0, 2.0, 2.0**-22, 2.0**-22, 2.0**-8, 2.0]))
    m, _ = torch.frexp(s)
    assert bool((m == 0.5).all())


def test_act_quant_fp8_values():
    x = torch.tensor([[0.0] * 32 + [448.0, -1.0, 3e-3, 2.0**-12] + [0.0] * 28])
    q, s = act_quant_fp8(x, 32)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 2)
    assert s[0, 0].item() == 2.0**-22  # all-zero group: amax clamped to 1e-4
    assert bool((q[0, :32].float() == 0).all())
    assert s[0, 1].item() == 1.0 and q[0, 32].item() == 448.0 and q[0, 33].item() == -1.0
    assert (
        q[0, 34].float().item() == torch.tensor(3e-3).to(torch.float8_e4m3fn).float().item()
    )  # subnormal kept
    # saturating: a value whose scaled magnitude rounds above 448 is clamped, never NaN
    x2 = torch.full((1, 32), 447.99)
    assert torch.isfinite(fake_quant_act_fp8(x2, 32)).all()
    # every e4m3 code value survives unchanged at scale 1 (group amax = 448)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[torch.isfinite(codes)]
    vals = vals[vals.abs() <= 448]
    row = torch.cat([vals, torch.tensor([448.0])])[: (len(vals) // 32) * 32].view(-1, 32)
    row[:, 0] = 448.0
    assert torch.equal(fake_quant_act_fp8(row, 32), row)


def test_fp8_linear_act_quant_reference_is_fake_quant_then_matmul():
    g = torch.Generator().manual_seed(1)
    q, s = quant_fp8_block(torch.randn(40, 96, generator=g) / 10, (32, 32))
    x = torch.randn(3, 96, generator=g)
    want = F.linear(fake_quant_act_fp8(x, 32), dequant_fp8_block(q, s, (32, 32)))
    assert torch.equal(fp8_linear(x, q, s, (32, 32), act_quant=True, backend="torch"), want)
    assert not torch.equal(want, fp8_linear(x, q, s, (32, 32), backend="torch"))


def test_linear_f32_out_reference():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 64, generator=g).bfloat16()
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    y = linear_f32_out(x, w, backend="torch")
    assert y.dtype == torch.float32 and y.shape == (2, 3, 50)
    assert torch.equal(y, F.linear(x.float(), w.float()))
    w32 = w.float()
    assert torch.equal(linear_f32_out(x.float(), w32), F.linear(x.float(), w32))


def test_linear_f32_out_writes_into_out():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 64, generator=g).bfloat16()
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    buf = torch.full((8, 50), float("nan"))
    out = buf[:6].view(2, 3, 50)  # the leading rows of a larger buffer, as CUDA graphs share one
    y = linear_f32_out(x, w, backend="torch", out=out)
    assert y.data_ptr() == buf.data_ptr() and torch.equal(y, F.linear(x.float(), w.float()))
    assert torch.isnan(buf[6:]).all()  # nothing past the rows asked for
    for bad, why in ((torch.empty(2, 3, 49), r"\(2, 3, 50\)"), (torch.empty(2, 3, 50, dtype=torch.bfloat16), "float32"),
                     (torch.empty(50, 3, 2).transpose(0, 2), "contiguous")):
        with pytest.raises(ValueError, match=why):
            linear_f32_out(x, w, backend="torch", out=bad)


def test_e8m0_dtype_conversion_used_by_the_decoders_matches_the_bit_decoder():
    from deepinfer_kernels.quant import e8m0_to_float

    codes = torch.arange(256, dtype=torch.uint8)
    ones = torch.ones(256, 1).to(torch.float8_e4m3fn)
    got = dequant_fp8_block(ones, codes.view(torch.float8_e8m0fnu).view(256, 1), (1, 1))[:, 0]
    want = e8m0_to_float(codes)
    assert torch.equal(got[:255], want[:255]) and bool(torch.isnan(got[255]))
