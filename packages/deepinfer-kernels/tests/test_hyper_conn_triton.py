"""Triton hc_mix (mix logits + RMS scale + pre/post/comb split + Sinkhorn) vs the torch reference.

Tolerances (|triton - reference| <= atol + rtol * |reference|): pre, post, comb are fp32 outputs; the kernel
reads r in its own dtype (bf16 upcast exactly) and uses exact fp32 dots, so only summation order differs:
atol 2e-5, rtol 1e-4 on CPU (interpreter) and GPU alike. The Sinkhorn output is also checked to be doubly
stochastic, which the reference satisfies by construction. The one-launch (fused) kernel and the two-launch path
are held to the same tolerance; the fused one must also be bit-identical across calls (fixed split order) and leave
its arrival counters zero.

hc_pre / hc_post (fp32 math, output in r's dtype): fp32 atol 1e-6, rtol 1e-5; bf16 1 ULP (rtol 2^-7, atol 1e-6;
the interpreter truncates f32 -> bf16). hc_post_pre: R' within hc_post's tolerance (on the interpreter equal to
hc_post's kernel), x within the same tolerance of the reference collapse of that R' (it reads the streams as stored).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.hyper_conn import hc_mix, hc_post, hc_post_pre, hc_pre, reference
from kernels_testing import triton_interpreter

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


# (T, n, d): T not a multiple of BLOCK_T=16, n*d not a multiple of BLOCK_K=128, n = 2 and 4; T <= 8 takes the
# one-token-per-program first stage (ROWS_MAX_T), T = 17 the tl.dot one.
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


_FUSED_KNOBS = {
    "default": {},  # CUDA-core products, one token per program up to PRODUCTS_MAX_T; then bf16x3 dots (bf16 streams)
    "products": {"mode": "products"},  # one token per program up to PRODUCTS_MAX_T
    "dot": {"mode": "dot"},  # 16-token exact-fp32 tl.dot tiles
    "bf16x3": {"mode": "bf16x3"},  # tensor-core dots, fn in three bf16 terms
    "tok4": {"mode": "products", "block_t": 4},
    # more splits than one finish step reads (SC = 8192 / (64 tokens * 32) = 4): the finish loops over split chunks
    "dot-many-splits": {"mode": "dot", "block_t": 64, "block_k": 16, "num_splits": 18},
    "unsplit": {"mode": "products", "block_t": 16, "num_splits": 1},
    "two-launch": {"fused": False},
}


# "products" equals the default plan at these T (<= PRODUCTS_MAX_T); "tok4" is checked past ROWS_MAX_T only
_FUSED_CASES = [(t, k) for t in (1, 3, 9, 20) for k in _FUSED_KNOBS if k != "products" and (t > 8 or k != "tok4")]


@pytest.mark.parametrize(("t", "name"), _FUSED_CASES, ids=[f"{t}-{k}" for t, k in _FUSED_CASES])
def test_interpreter_fused_deterministic_and_counters_zero(interp, t, name):
    """T = 1, 3 (one token per program), 9, 20 (token groups, a partial last group) against the reference; a
    caller's counters (larger than needed) are left zero and a repeated call is bit-identical."""
    knobs = _FUSED_KNOBS[name]
    r, fn, base, scale = _case(t, 4, 72, torch.bfloat16, seed=10 + t)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    counters = torch.zeros(64, dtype=torch.int32)
    out = interp.hc_mix(r, fn, base, scale, counters=counters, **knobs, **kw)
    _check(out, reference.hc_mix(r, fn, base, scale, **kw))
    assert not counters.any()
    again = interp.hc_mix(r, fn, base, scale, counters=counters, **knobs, **kw)
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert not counters.any()


def test_interpreter_fused_counters_too_small_or_absent(interp):
    """A split launch of 3 token groups given 1 counter (or none) uses fresh zeros and leaves the buffer alone."""
    r, fn, base, scale = _case(20, 4, 72, torch.float32, seed=4)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    ref = reference.hc_mix(r, fn, base, scale, **kw)
    small = torch.zeros(1, dtype=torch.int32)
    _check(interp.hc_mix(r, fn, base, scale, counters=small, num_splits=2, **kw), ref)
    _check(interp.hc_mix(r, fn, base, scale, num_splits=2, **kw), ref)
    assert not small.any()


def test_dispatcher_passes_counters_and_rejects_bad_ones(interp):
    r, fn, base, scale = _case(3, 4, 32, torch.bfloat16, seed=5)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    counters = torch.zeros(8, dtype=torch.int32)
    ref = reference.hc_mix(r, fn, base, scale, **kw)
    _check(hc_mix(r, fn, base, scale, backend="triton", counters=counters, **kw), ref)
    _check(hc_mix(r, fn, base, scale, backend="triton", fused=False, **kw), ref)
    assert not counters.any()
    _check(hc_mix(r, fn, base, scale, backend="torch", counters=counters, **kw), ref)
    with pytest.raises(ValueError, match="hc_mix: counters"):
        hc_mix(r, fn, base, scale, backend="triton", counters=torch.zeros(8, dtype=torch.int64), **kw)
    with pytest.raises(ValueError, match="needs bf16 streams"):
        interp.hc_mix(r.float(), fn, base, scale, mode="bf16x3", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_interpreter_fused_other_stream_dtypes(interp, dtype):
    """Past PRODUCTS_MAX_T, streams that are not bf16 keep the products plan (bf16x3 would round them); bf16 ones
    switch to bf16x3."""
    r, fn, base, scale = _case(20, 4, 72, dtype, seed=6)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6)
    big = interp.PRODUCTS_MAX_T + 1
    assert interp._fused_plan(big, 24, 288, dtype, r.device, None, None, None, None)[0] == "products"
    assert interp._fused_plan(big, 24, 288, torch.bfloat16, r.device, None, None, None, None)[0] == "bf16x3"
    assert interp._fused_plan(interp.PRODUCTS_MAX_T, 24, 288, torch.bfloat16, r.device, None, None, None, None)[:2] == (
        "products", 1)
    _check(interp.hc_mix(r, fn, base, scale, **kw), reference.hc_mix(r, fn, base, scale, **kw))


_STREAM_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-6, 2.0**-7)}


def _streams_case(t, n, d, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(t, n, d, generator=g).to(dtype)
    y = torch.randn(t, d, generator=g).to(dtype)
    pre = torch.rand(t, n, generator=g) + 0.1
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.softmax(torch.randn(t, n, n, generator=g), -1)
    return [x.to(device) for x in (r, y, pre, post, comb)]


def _check_streams(out, ref):
    atol, rtol = _STREAM_TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# d not a multiple of BLOCK_D (1024) and smaller than it; one token; n = 2 and 4.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 1100), (6, 4, 40), (3, 2, 24)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_pre_post_match_reference(interp, shape, dtype):
    r, y, pre, post, comb = _streams_case(*shape, dtype)
    _check_streams(interp.hc_pre(r, pre), reference.hc_pre(r, pre))
    _check_streams(interp.hc_post(y, r, post, comb), reference.hc_post(y, r, post, comb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 1100), (6, 4, 40), (3, 2, 24)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_post_pre_fused(interp, shape, dtype):
    r, y, pre, post, comb = _streams_case(*shape, dtype, seed=3)
    out, x = interp.hc_post_pre(y, r, post, comb, pre)
    assert torch.equal(out, interp.hc_post(y, r, post, comb))
    _check_streams(out, reference.hc_post(y, r, post, comb))
    _check_streams(x, reference.hc_pre(out, pre))
    ref_out, ref_x = hc_post_pre(y, r, post, comb, pre, backend="torch")
    assert torch.equal(ref_x, reference.hc_pre(ref_out, pre))
    o2, x2 = hc_post_pre(y, r, post, comb, pre, backend="triton")
    assert torch.equal(o2, out) and torch.equal(x2, x)
    with pytest.raises(ValueError, match="hc_post_pre: pre shape"):
        hc_post_pre(y, r, post, comb, pre[:, :1])


def test_interpreter_post_contracts_first_index_and_mixed_dtypes(interp):
    """A non-symmetric comb catches a transposed contraction; fp32 y on bf16 streams; strided r is copied."""
    r, y, pre, post, comb = _streams_case(2, 4, 48, torch.bfloat16, seed=5)
    comb = torch.zeros(2, 4, 4)
    comb[:, 0, 3] = 1.0  # R'_3 = R_0, the other streams get only post * y
    out = interp.hc_post(y.float(), r, post, comb)
    _check_streams(out, reference.hc_post(y.float(), r, post, comb))
    torch.testing.assert_close(
        out[:, 3].float(),
        (post[:, 3:4] * y.float() + r[:, 0].float()).to(torch.bfloat16).float(),
        atol=1e-6,
        rtol=2.0**-7,
    )
    wide = torch.randn(2, 4, 96).to(torch.bfloat16)
    rs = wide[..., :48]
    _check_streams(interp.hc_pre(rs, pre), reference.hc_pre(rs, pre))


def test_dispatchers_pre_post(interp):
    r, y, pre, post, comb = _streams_case(3, 4, 40, torch.bfloat16, seed=6)
    _check_streams(hc_pre(r, pre, backend="triton"), reference.hc_pre(r, pre))
    _check_streams(hc_post(y, r, post, comb, backend="triton"), reference.hc_post(y, r, post, comb))
    with pytest.raises(ValueError, match="hc_post: comb shape"):
        hc_post(y, r, post, comb[:, :2])
    r3 = torch.randn(2, 3, 8)  # n = 3: the reference handles it, the kernel does not
    torch.testing.assert_close(hc_pre(r3, torch.ones(2, 3)), r3.sum(1))
    with pytest.raises(ValueError, match="hc_pre: backend='triton' has no kernel"):
        hc_pre(r3, torch.ones(2, 3), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_pre_post_v41_shape(t, dtype):
    r, y, pre, post, comb = _streams_case(t, 4, 5120, dtype, device="cuda", seed=7)
    _check_streams(hc_pre(r, pre, backend="triton"), reference.hc_pre(r, pre))
    _check_streams(hc_post(y, r, post, comb, backend="triton"), reference.hc_post(y, r, post, comb))
    out, x = hc_post_pre(y, r, post, comb, pre, backend="triton")
    # the compiler may contract post * y + mixed differently in the fused kernel: R' within hc_post's tolerance
    _check_streams(out, reference.hc_post(y, r, post, comb))
    _check_streams(x, reference.hc_pre(out, pre))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference_v41_shape(t, dtype):
    r, fn, base, scale = _case(t, 4, 5120, dtype, device="cuda", seed=4)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    _check(hc_mix(r, fn, base, scale, backend="triton", **kw), reference.hc_mix(r, fn, base, scale, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "knobs",
    [{}, {"mode": "products"}, {"mode": "dot"}, {"mode": "bf16x3"}, {"fused": False}],
    ids=["fused", "fused-products", "fused-dot", "fused-bf16x3", "two-launch"],
)
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_gpu_fused_v41_shape_graph_replay(t, knobs):
    """V4.1 widths: within tolerance of the reference; with caller counters, captured in a CUDA graph and replayed
    twice: bit-identical to the eager call and counters still zero."""
    r, fn, base, scale = _case(t, 4, 5120, torch.bfloat16, device="cuda", seed=8)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    from deepinfer_kernels.hyper_conn import triton as tb  # the knobs are the backend's (run with -m gpu)

    eager = tb.hc_mix(r, fn, base, scale, counters=counters, **knobs, **kw)
    _check(eager, reference.hc_mix(r, fn, base, scale, **kw))
    torch.cuda.synchronize()
    assert not counters.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.hc_mix(r, fn, base, scale, counters=counters, **knobs, **kw)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, eager))
        assert not counters.any()
