"""Triton inverse-CDF draws (`sampling/triton.py`) vs the torch references.

The kernels sum in chunks, the references with one row-wide cumsum, so a draw may differ where u * total lies
within rounding of a CDF step. Every draw is checked to be a valid inverse-CDF draw of the reference's CDF with a
relative slack of 1e-5 (the token's CDF interval contains u * total), never a zero-weight id, and equal to the
reference's draw for all but a few rows; the argmax and the one-hot rows are exact, the probabilities within 1e-6.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.sampling import (
    inverse_cdf_sample,
    logsumexp_rows,
    reference,
    residual_sample,
    softmax_sample,
)
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SLACK = 1e-5


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.sampling.triton") as (mod,):
        yield mod


def _assert_valid_draws(weights: torch.Tensor, u: torch.Tensor, got: torch.Tensor) -> None:
    """got[i] is the inverse-CDF draw of row i for some CDF within SLACK of the fp64 one, and has weight > 0 (or
    the row is all zero and got = V - 1)."""
    w = weights.double().cpu()
    cdf = torch.cumsum(w, -1)
    total = cdf[:, -1]
    x = u.double().cpu() * total
    got = got.cpu()
    rows = torch.arange(w.shape[0])
    lo = torch.where(got > 0, cdf[rows, (got - 1).clamp(min=0)], torch.zeros_like(total))
    hi = cdf[rows, got]
    empty = total == 0
    assert bool((got[empty] == w.shape[1] - 1).all())
    live = ~empty
    assert bool((w[rows, got][live] > 0).all()), "a zero-weight id was drawn"
    tol = SLACK * total
    assert bool(((lo <= x + tol) & (hi >= x - tol))[live].all()), (got, lo, hi, x)


def _weights(n: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, v, generator=g) ** 8  # skewed, like a softmax
    w[0] = 0.0
    w[0, v // 2] = 3.0  # one id only
    w[1, : v - 1] = 0.0  # only the last id
    w[2] = 0.0  # all zero: V - 1
    if v > 9:
        w[3, ::3] = 0.0  # zero weights interleaved
    return w


@pytest.mark.parametrize("v", [7, 4096, 4097, 129280])
def test_inverse_cdf_draws(interp, v):
    n = 12
    w = _weights(n, v, v)
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    u[4], u[5] = 0.0, 1.0 - 2.0**-24
    got = interp.inverse_cdf_sample(w, u)
    _assert_valid_draws(w, u, got)
    want = reference.inverse_cdf_sample(w, u)
    assert int((got != want).sum()) <= 1, (got, want)
    assert got[0] == v // 2 and got[1] == v - 1 and got[2] == v - 1


def _logits(n: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(n, v, generator=g)
    x[0, [3, v - 1]] = 40.0  # a tie: argmax 3
    return x


@pytest.mark.parametrize("v", [5, 4096, 4099, 129280])
def test_softmax_draws(interp, v):
    n = 10
    x = _logits(n, v, v)
    t = torch.tensor([1.0, 0.0, 0.7, 1.6, 0.0, 1.0, 2.5, 0.3, 1.0, 0.05])
    u = torch.rand(n, generator=torch.Generator().manual_seed(2))
    want_tok, want_best = reference.softmax_sample(x, t, u, probs_out=(want_p := torch.empty(n, v)))
    got_p = x.clone()
    got_tok, got_best = interp.softmax_sample(got_p, t, u, probs_out=got_p)  # in place, as the drafter does
    assert torch.equal(got_best, x.argmax(-1)) and torch.equal(got_best, want_best)
    assert got_best[0] == 3
    greedy = t == 0
    assert torch.equal(got_tok[greedy], want_best[greedy])
    assert torch.equal(got_p[greedy], want_p[greedy])  # one-hot at the argmax
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
    safe = torch.where(greedy, torch.ones_like(t), t)
    probs = torch.softmax(x.double() / safe.double()[:, None], -1)
    _assert_valid_draws(probs[~greedy], u[~greedy], got_tok[~greedy])
    assert int((got_tok != want_tok).sum()) <= 1, (got_tok, want_tok)


def test_softmax_greedy_only_and_strided(interp):
    x = _logits(6, 9000, 0)
    wide = torch.zeros(6, 2, 9000)
    wide[:, 1] = x  # rows with a stride of 2 * V, as a block position of [B, N, V]
    tok, best = interp.softmax_sample(wide[:, 1], None, None)
    assert torch.equal(tok, x.argmax(-1)) and torch.equal(best, tok)
    t = torch.ones(6)
    u = torch.full((6,), 0.5)
    tok, _ = interp.softmax_sample(wide[:, 1], t, u, probs_out=wide[:, 1])
    want_tok, _ = reference.softmax_sample(x, t, u)
    torch.testing.assert_close(wide[:, 1], torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert torch.equal(wide[:, 0], torch.zeros(6, 9000))  # the other position untouched
    assert int((tok != want_tok).sum()) <= 1


def test_dispatchers(interp):
    w = _weights(4, 300, 3)
    u = torch.full((4,), 0.25)
    _assert_valid_draws(w, u, inverse_cdf_sample(w, u, backend="triton"))
    assert torch.equal(inverse_cdf_sample(w, u), reference.inverse_cdf_sample(w, u))  # CPU auto: the reference
    x = _logits(3, 50, 1)
    t = torch.tensor([1.0, 0.0, 0.5])
    tok, best = softmax_sample(x, t, torch.full((3,), 0.3), backend="torch")
    assert torch.equal(best, x.argmax(-1))
    with pytest.raises(ValueError, match=r"softmax_sample: expected temperature and uniforms of shape \(3,\)"):
        softmax_sample(x, t, None)
    with pytest.raises(ValueError, match="probs_out must be"):
        softmax_sample(x, t, torch.zeros(3), probs_out=torch.zeros(3, 50, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"inverse_cdf_sample: expected weights \[N, V\]"):
        inverse_cdf_sample(w, u[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("v", [129280, 4096, 17])
@pytest.mark.parametrize("n", [1, 64, 256])
def test_gpu_draws(v, n):
    g = torch.Generator(device="cuda").manual_seed(n + v)
    x = 4 * torch.randn(n, v, device="cuda", generator=g)
    t = torch.rand(n, device="cuda", generator=g) * 2
    t[::5] = 0.0
    u = torch.rand(n, device="cuda", generator=g)
    want_p = torch.empty_like(x)
    want_tok, want_best = reference.softmax_sample(x, t, u, probs_out=want_p)
    got_p = torch.empty_like(x)
    got_tok, got_best = softmax_sample(x, t, u, probs_out=got_p, backend="triton")
    assert torch.equal(got_best, want_best)
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
    safe = torch.where(t > 0, t, torch.ones_like(t))
    probs = torch.softmax(x.double() / safe.double()[:, None], -1)
    live = t > 0
    _assert_valid_draws(probs[live], u[live], got_tok[live])
    assert torch.equal(got_tok[~live], want_best[~live])
    assert int((got_tok != want_tok).sum()) <= max(1, n // 64)
    w = torch.rand(n, v, device="cuda", generator=g) ** 8
    got = inverse_cdf_sample(w, u, backend="triton")
    _assert_valid_draws(w, u, got)
    assert int((got != reference.inverse_cdf_sample(w, u)).sum()) <= max(1, n // 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("v", [5, 4097, 129280])
def test_logsumexp_rows(interp, v, dtype):
    x = _logits(7, v, v).to(dtype)
    t = torch.tensor([1.0, 0.7, 0.05, 2.0, 1.0, 0.3, 1.0])
    got = interp.logsumexp_rows(x, t)
    want = reference.logsumexp_rows(x, t)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(logsumexp_rows(x, t), want)  # CPU auto: the reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_logsumexp_rows(dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (4 * torch.randn(1536, 129280, device="cuda", generator=g)).to(dtype)
    t = torch.rand(1536, device="cuda", generator=g) * 2 + 0.02
    torch.testing.assert_close(logsumexp_rows(x, t, backend="triton"), reference.logsumexp_rows(x, t),
                               rtol=1e-6, atol=1e-5)


def _residual_case(v: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, b: int = 6, seed: int = 3):
    """A verification's correction / bonus draws: target rows (bf16 logits), draft rows q, the positions, rejection
    flags and uniforms. q of request 0 is p restricted to the even ids (its residual lives on the odd ids); request 1
    has q = 2 p at alpha 1 (an all-zero residual: the draw falls back to p); request 2 is a bonus draw (nothing
    rejected)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r, n = 2 * b + 1, 3
    logits = (4 * torch.randn(r, v, device=device, generator=g)).to(dtype)
    t = torch.rand(r, device=device, generator=g) + 0.3
    rows = torch.randperm(r, device=device, generator=g)[:b]
    p = torch.softmax(logits[rows].float() / t[rows][:, None], -1)
    q = torch.softmax(4 * torch.randn(b, n, v, device=device, generator=g), -1)
    pos = torch.randint(0, n, (b,), device=device, generator=g)
    even = p.clone()
    even[0, 1::2] = 0
    q[0, pos[0]] = even[0] / even[0].sum()
    q[1, pos[1]] = 2 * p[1]
    rejected = torch.ones(b, dtype=torch.bool, device=device)
    rejected[2] = False
    u = torch.rand(b, device=device, generator=g)
    return logits, rows, t, logsumexp_rows(logits, t), q, pos, rejected, u


def _residual_weights(logits, rows, t, q, pos, rejected) -> torch.Tensor:
    """fp64 weights of the draws (the reference's rule)."""
    p = torch.softmax(logits[rows].double() / t[rows].double()[:, None], -1)
    res = (p - q[torch.arange(rows.shape[0], device=rows.device), pos].double()).clamp(min=0)
    res = torch.where(res.sum(-1, keepdim=True) <= 0, p, res)
    return torch.where(rejected[:, None], res, p)


@pytest.mark.parametrize("v", [7, 4097, 129280])
def test_residual_sample(interp, v):
    logits, rows, t, lse, q, pos, rejected, u = _residual_case(v)
    got = interp.residual_sample(logits, rows, t, lse, q, pos, rejected, u)
    w = _residual_weights(logits, rows, t, q, pos, rejected)
    _assert_valid_draws(w, u, got)
    if v > 7:
        assert int(got[0]) % 2 == 1  # the residual of request 0 lives on the odd ids
    want = reference.residual_sample(logits, rows, t, lse, q, pos, rejected, u)
    assert int((got != want).sum()) <= 1, (got, want)
    assert torch.equal(residual_sample(logits, rows, t, lse, q, pos, rejected, u), want)  # CPU auto: the reference
    # without draft rows every draw is from p
    p_only = interp.residual_sample(logits, rows, t, lse, None, None, rejected, u)
    _assert_valid_draws(torch.softmax(logits[rows].double() / t[rows].double()[:, None], -1), u, p_only)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 256])
def test_gpu_residual_sample(b):
    logits, rows, t, lse, q, pos, rejected, u = _residual_case(129280, "cuda", b=max(b, 3))
    got = residual_sample(logits, rows, t, lse, q, pos, rejected, u, backend="triton")
    _assert_valid_draws(_residual_weights(logits, rows, t, q, pos, rejected), u, got)
    want = reference.residual_sample(logits, rows, t, lse, q, pos, rejected, u)
    assert int((got != want).sum()) <= max(1, got.shape[0] // 64), (got, want)
