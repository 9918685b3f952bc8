"""Triton fused routing (sqrtsoftplus + bias + top-k + renormalise x scale) vs the torch reference.

Ids must match exactly (random fp32 inputs have no ties); weights: atol 1e-6, rtol 1e-5 (fp32 math; the kernel's
softplus uses max(x,0) + log1p(exp(-|x|)) instead of torch's formula). Exact ties: lower expert id first
(checked against the rule, not against torch.topk, whose tie order is unspecified).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.routing import reference, route_logits, select_experts
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.routing.triton") as (mod,):
        yield mod


def _ref(logits, k, bias, scale, renorm=True):
    return reference.select_experts(
        torch.sqrt(torch.nn.functional.softplus(logits)), k, bias=bias, route_scale=scale, renormalize=renorm
    )


def _check(got, want):
    (w, i), (wr, ir) = got, want
    assert i.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(i, ir)
    torch.testing.assert_close(w, wr, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(4, 384, 6), (3, 37, 4)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_alt_bias_rows_match_reference(interp, shape):
    # V4.1 bias_vl: rows flagged as image positions select with the alternative bias, picked in the kernel; the
    # reference is the former caller's where() over [T, E]
    t, e, k = shape
    g = torch.Generator().manual_seed(t + e)
    logits = torch.randn(t, e, generator=g) * 4
    bias, alt = torch.randn(e, generator=g), torch.randn(e, generator=g) * 3
    rows = torch.tensor([True, False, True, False][:t])
    want = _ref(logits, k, torch.where(rows[:, None], alt[None], bias[None]), 2.5)
    _check(interp.route_topk(logits, bias, k, route_scale=2.5, bias_alt=alt, alt_rows=rows), want)
    _check(route_logits(logits, k, bias=bias, route_scale=2.5, bias_alt=alt, alt_rows=rows, backend="torch"), want)
    assert not torch.equal(want[1], _ref(logits, k, bias, 2.5)[1])  # the case distinguishes the two biases
    with pytest.raises(ValueError, match="go together"):
        route_logits(logits, k, bias=bias, bias_alt=alt)


# (T, E, k): V4.1-like 384 experts top-6 (E not a power of two), a small odd E, k = E.
@pytest.mark.parametrize("shape", [(3, 384, 6), (5, 37, 4), (2, 8, 8)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias_kind", ["none", "shared", "per_token"])
def test_interpreter_matches_reference(interp, shape, bias_kind):
    t, e, k = shape
    g = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=g) * 4  # covers softplus' tiny (x << 0) and linear (x > 20) ranges
    logits[0, :3] = torch.tensor([-30.0, 25.0, 0.0])
    bias = {
        "none": None,
        "shared": torch.randn(e, generator=g) * 0.3,
        "per_token": torch.randn(t, e, generator=g),
    }[bias_kind]
    _check(interp.route_topk(logits, bias, k, route_scale=2.5), _ref(logits, k, bias, 2.5))
    scores = torch.rand(t, e, generator=g)
    _check(
        interp.route_topk(scores, bias, k, sqrtsoftplus=False, renormalize=False),
        reference.select_experts(scores, k, bias=bias, renormalize=False),
    )


def test_interpreter_ties_go_to_lower_id(interp):
    scores = torch.tensor([[0.5, 0.7, 0.5, 0.7, 0.1, 0.5]])
    w, ids = interp.route_topk(scores, None, 4, sqrtsoftplus=False, renormalize=False)
    assert ids.tolist() == [[1, 3, 0, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.7, 0.7, 0.5, 0.5]]))


def test_dispatchers_route_to_interpreter(interp):
    g = torch.Generator().manual_seed(9)
    logits, bias = torch.randn(4, 64, generator=g), torch.randn(64, generator=g) * 0.2
    _check(route_logits(logits, 6, bias=bias, route_scale=1.5, backend="triton"), _ref(logits, 6, bias, 1.5))
    _check(route_logits(logits, 6, bias=bias, route_scale=1.5), _ref(logits, 6, bias, 1.5))  # auto: reference
    scores = torch.rand(4, 64, generator=g)
    _check(
        select_experts(scores, 3, bias=bias, backend="triton"), reference.select_experts(scores, 3, bias=bias)
    )
    hash_ids = torch.randint(0, 64, (4, 3), generator=g)
    with pytest.raises(ValueError, match="select_experts: backend='triton' has no kernel"):
        select_experts(scores, 3, hash_ids=hash_ids, backend="triton")
    w, _ = route_logits(logits, 6, score_func="sigmoid")
    assert w.shape == (4, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_gpu_matches_reference(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, 384, device="cuda", generator=g) * 3
    bias = torch.randn(384, device="cuda", generator=g) * 0.1
    _check(route_logits(logits, 6, bias=bias, route_scale=2.5, backend="triton"), _ref(logits, 6, bias, 2.5))
    img = torch.rand(t, device="cuda", generator=g) < 0.5
    alt = torch.randn(384, device="cuda", generator=g) * 0.1
    _check(route_logits(logits, 6, bias=bias, route_scale=2.5, bias_alt=alt, alt_rows=img, backend="triton"),
           _ref(logits, 6, torch.where(img[:, None], alt[None], bias[None]), 2.5))
