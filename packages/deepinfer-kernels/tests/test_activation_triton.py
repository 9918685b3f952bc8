"""Triton clamped SwiGLU vs the torch reference (activation.reference.swiglu).

Tolerance: the kernel's exp may differ from torch's silu by an fp32 ULP; fp32 outputs agree to atol 1e-6 /
rtol 1e-6, bf16 outputs to 1 ULP (rtol 2^-7; the interpreter truncates instead of rounding). Values reach past
the clamp limit on both sides; limit 0 = no clamp.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.activation import reference, swiglu
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-6, 2.0**-7)}


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.activation.triton") as (mod,):
        yield mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 1000), (2, 3, 40), (0, 8)], ids=str)
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_interpreter_matches_reference(interp, shape, dtype, limit):
    g = torch.Generator().manual_seed(sum(shape))
    a = (torch.randn(*shape, generator=g) * 8).to(dtype)
    b = (torch.randn(*shape, generator=g) * 8).to(dtype)
    out = interp.swiglu(a, b, limit, dtype)
    ref = reference.swiglu(a, b, limit, dtype)
    atol, rtol = _TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_interpreter_reads_row_strided_halves_in_place(interp, dtype):
    # the gate / up halves of one fused [T, 2I] GEMM output: same values as from contiguous copies, exactly
    gu = (torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3)) * 8).to(dtype)
    g, u = gu[:, :48], gu[:, 48:]
    assert not g.is_contiguous()
    out = interp.swiglu(g, u, 10.0, dtype)
    assert out.is_contiguous()
    assert torch.equal(out, interp.swiglu(g.contiguous(), u.contiguous(), 10.0, dtype))


def test_dispatcher(interp):
    a, b = torch.randn(4, 64), torch.randn(4, 64)
    torch.testing.assert_close(swiglu(a, b, 1.0, torch.float32, backend="triton"),
                               reference.swiglu(a, b, 1.0, torch.float32), atol=1e-6, rtol=1e-6)
    a64 = a.double()  # no kernel for float64: the reference
    torch.testing.assert_close(swiglu(a64, a64, 1.0, torch.float64), reference.swiglu(a64, a64, 1.0, torch.float64))
    with pytest.raises(ValueError, match="one shape"):
        swiglu(a, b[:, :3], 1.0, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference(dtype):
    a = (torch.randn(8, 2048, device="cuda") * 8).to(dtype)
    b = (torch.randn(8, 2048, device="cuda") * 8).to(dtype)
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(swiglu(a, b, 10.0, torch.bfloat16, backend="triton").float(),
                               reference.swiglu(a, b, 10.0, torch.bfloat16).float(), atol=atol, rtol=2.0**-7)
