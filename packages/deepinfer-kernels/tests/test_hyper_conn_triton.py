"""Triton hc_mix (mix logits + RMS scale + pre/post/comb split + Sinkhorn) vs the torch reference.

Tolerances (|triton - reference| <= atol + rtol * |reference|): pre, post, comb are fp32 outputs; the kernel
reads r in its own dtype (bf16 upcast exactly) and uses exact fp32 dots, so only summation order differs:
atol 2e-5, rtol 1e-4 on CPU (interpreter) and GPU alike. The Sinkhorn output is also checked to be doubly
stochastic, which the reference satisfies by construction.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.hyper_conn import hc_mix, reference
from deepinfer_kernels.testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.hyper_conn.triton") as (mod,):
        yield mod


def _case(t, n, d, dtype, device="cpu", seed=0, logit_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    r = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn(m, n * d, generator=g) * (logit_scale / (n * d) ** 0.5)
    base = torch.randn(m, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return [x.to(device) for x in (r, fn, base, scale)]


def _check(out, ref):
    for name, a, b in zip(("pre", "post", "comb"), out, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")


# (T, n, d): T not a multiple of BLOCK_T=16, n*d not a multiple of BLOCK_K=128, n = 2 and 4.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 40), (17, 4, 72), (5, 2, 24)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_matches_reference(interp, shape, dtype):
    r, fn, base, scale = _case(*shape, dtype)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    out = interp.hc_mix(r, fn, base, scale, **kw)
    _check(out, reference.hc_mix(r, fn, base, scale, **kw))
    comb = out[2]
    torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb[:, 0]), atol=1e-4, rtol=0)  # columns


@pytest.mark.parametrize("num_splits", [1, 2, 3, 1000])
@pytest.mark.parametrize("iters", [1, 3])
def test_interpreter_splits_and_iterations(interp, num_splits, iters):
    r, fn, base, scale = _case(3, 4, 100, torch.float32, seed=1)
    kw = dict(sinkhorn_iters=iters, hc_eps=1e-6, rms_eps=1e-6)
    _check(
        interp.hc_mix(r, fn, base, scale, num_splits=num_splits, **kw),
        reference.hc_mix(r, fn, base, scale, **kw),
    )


def test_interpreter_large_logits_and_tiny_eps(interp):
    """Saturated sigmoids and a peaked comb softmax (max subtraction); V4.1's rms eps 1e-20; a zero token row."""
    r, fn, base, scale = _case(4, 4, 64, torch.float32, seed=2, logit_scale=40.0)
    r[2] = 0.0  # sum of squares 0: rsqrt(eps) * 0 logits -> base only
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    out = interp.hc_mix(r, fn, base, scale, **kw)
    ref = reference.hc_mix(r, fn, base, scale, **kw)
    _check(out, ref)
    assert torch.isfinite(out[2]).all()


def test_dispatcher_routes_to_interpreter(interp):
    r, fn, base, scale = _case(2, 4, 32, torch.bfloat16, seed=3)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    _check(hc_mix(r, fn, base, scale, backend="triton", **kw), reference.hc_mix(r, fn, base, scale, **kw))
    empty = hc_mix(r[:0], fn, base, scale, backend="triton", **kw)
    assert [tuple(x.shape) for x in empty] == [(0, 4), (0, 4), (0, 4, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference_v41_shape(t, dtype):
    r, fn, base, scale = _case(t, 4, 5120, dtype, device="cuda", seed=4)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    _check(hc_mix(r, fn, base, scale, backend="triton", **kw), reference.hc_mix(r, fn, base, scale, **kw))
