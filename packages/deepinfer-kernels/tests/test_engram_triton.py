"""Triton Engram injection vs the torch reference (engram.reference.engram_inject).

Tolerance: the gate's sums run in another order (fp32, ~1e-6 relative), so fp32 outputs agree to atol 1e-5 /
rtol 1e-5 and bf16 outputs to 1 ULP (rtol 2^-7; the interpreter truncates instead of rounding). Covered: d not
a multiple of the block (two passes of several blocks), image rows (gate 0: the streams unchanged, bit for
bit), a zero dot (copysign keeps +0 / -0), strided keys / value views of one projection output, empty batches.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.engram import engram_inject, reference
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-6, 2.0**-7)}


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.engram.triton") as (mod,):
        yield mod


def _inputs(t: int, n: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(t * 100 + d)
    r = torch.randn(t, n, d, generator=g).to(dtype)
    kv = torch.randn(t, n + 1, d, generator=g).to(dtype)  # one projection: keys of the n streams, then the value
    qw = (1 + 0.1 * torch.randn(n, d, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(n, d, generator=g)).to(dtype)
    mask = torch.zeros(t, dtype=torch.bool)
    mask[::3] = True
    return [x.to(device) for x in (r, kv[:, :n], kv[:, n], qw, kw, mask)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 64), (5, 4, 2500), (3, 2, 40), (4, 1, 16)], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["text", "image"])
def test_interpreter_matches_reference(interp, shape, dtype, masked):
    r, keys, val, qw, kw, mask = _inputs(*shape, dtype)
    m = mask if masked else None
    out = interp.engram_inject(r, keys, val, qw, kw, 1e-6, m)
    ref = reference.engram_inject(r, keys, val, qw, kw, 1e-6, m)
    atol, rtol = _TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    if masked:
        assert torch.equal(out[mask], r[mask])


def test_interpreter_zero_dot_sign_and_empty(interp):
    r = torch.tensor([[[1.0, -1.0, 0.0, 0.0]], [[-1.0, 1.0, 0.0, 0.0]]])  # dot 0 with +0 / -0 sums
    keys = torch.tensor([[[1.0, 1.0, 0.0, 0.0]], [[1.0, 1.0, 0.0, 0.0]]])
    val = torch.ones(2, 4)
    w = torch.ones(1, 4)
    out = interp.engram_inject(r, keys, val, w, w, 1e-20)
    torch.testing.assert_close(out, reference.engram_inject(r, keys, val, w, w, 1e-20), atol=1e-6, rtol=1e-6)
    z = torch.zeros(0, 4, 8)
    assert interp.engram_inject(z, z, torch.zeros(0, 8), torch.ones(4, 8), torch.ones(4, 8), 1e-6).shape == z.shape


def test_dispatcher(interp):
    r, keys, val, qw, kw, mask = _inputs(3, 4, 48, torch.float32)
    got = engram_inject(r, keys, val, qw, kw, 1e-6, mask, backend="triton")
    torch.testing.assert_close(got, reference.engram_inject(r, keys, val, qw, kw, 1e-6, mask), atol=1e-5, rtol=1e-5)
    r3, k3 = torch.randn(2, 3, 8), torch.randn(2, 3, 8)  # n = 3: no kernel, the reference
    w3 = torch.ones(3, 8)
    torch.testing.assert_close(engram_inject(r3, k3, torch.ones(2, 8), w3, w3, 1e-6),
                               reference.engram_inject(r3, k3, torch.ones(2, 8), w3, w3, 1e-6))
    with pytest.raises(ValueError, match="engram_inject: expected"):
        engram_inject(r, keys[:, :2], val, qw, kw, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference(t, dtype):
    r, keys, val, qw, kw, mask = _inputs(t, 4, 5120, dtype, "cuda")
    out = engram_inject(r, keys, val, qw, kw, 1e-6, mask, backend="triton")
    ref = reference.engram_inject(r, keys, val, qw, kw, 1e-6, mask)
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
