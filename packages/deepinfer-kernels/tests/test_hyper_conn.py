"""mHC references against hand-derived values (docs/model.md §A.3)."""

from __future__ import annotations

import math

import torch
from deepinfer_kernels.hyper_conn import hc_head, hc_mix, hc_post, hc_pre, sinkhorn


def test_sinkhorn_one_iteration_hand_case() -> None:
    c0 = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    # row softmax: [[1/4, 3/4], [1/2, 1/2]] (+eps 0); column normalise: col sums 3/4, 5/4
    out = sinkhorn(c0, 1, 0.0)
    want = torch.tensor([[(1 / 4) / (3 / 4), (3 / 4) / (5 / 4)], [(1 / 2) / (3 / 4), (1 / 2) / (5 / 4)]])
    assert torch.allclose(out, want, atol=1e-6)


def test_sinkhorn_doubly_stochastic_after_20() -> None:
    c0 = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0))
    c = sinkhorn(c0, 20, 1e-6)
    assert torch.allclose(c.sum(-2), torch.ones(5, 4), atol=1e-5)  # columns exact after the last step
    assert torch.allclose(c.sum(-1), torch.ones(5, 4), atol=1e-2)  # rows: nearly (20 iterations)
    assert not torch.allclose(c, c.transpose(-1, -2), atol=1e-3)  # not symmetric: transpose direction matters


def test_hc_post_contracts_first_index() -> None:
    r = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # streams R_0 = e0, R_1 = e1   [T=1, n=2, d=2]
    comb = torch.tensor([[[0.9, 0.1], [0.3, 0.7]]])
    post = torch.tensor([[2.0, 0.0]])
    y = torch.tensor([[5.0, 5.0]])
    out = hc_post(y, r, post, comb)
    # R'_0 = 2*y + C[0,0] R_0 + C[1,0] R_1 = (10.9, 10.3); R'_1 = C[0,1] R_0 + C[1,1] R_1 = (0.1, 0.7)
    assert torch.allclose(out, torch.tensor([[[10.9, 10.3], [0.1, 0.7]]]), atol=1e-6)


def test_hc_mix_pre_post_formulas() -> None:
    n, d = 2, 3
    g = torch.Generator().manual_seed(1)
    r = torch.randn(1, n, d, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g)
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.tensor([0.5, 2.0, 1.5])
    pre, post, comb = hc_mix(r, fn, base, scale, sinkhorn_iters=1, hc_eps=0.01, rms_eps=1e-6)
    f = r.reshape(-1)
    rms = math.sqrt(float((f * f).mean()) + 1e-6)
    m = [float(fn[k] @ f) / rms for k in range(fn.shape[0])]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    for i in range(n):
        assert math.isclose(float(pre[0, i]), sig(m[i] * 0.5 + float(base[i])) + 0.01, rel_tol=1e-5)
        assert math.isclose(float(post[0, i]), 2 * sig(m[n + i] * 2.0 + float(base[n + i])), rel_tol=1e-5)
    # comb element (i, j) comes from logit 2n + n*i + j, row softmax then column normalise
    c0 = torch.tensor([[m[2 * n + n * i + j] * 1.5 + float(base[2 * n + n * i + j]) for j in range(n)] for i in range(n)])
    assert torch.allclose(comb[0], sinkhorn(c0, 1, 0.01), atol=1e-5)


def test_hc_pre_and_head() -> None:
    r = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    assert torch.allclose(hc_pre(r, torch.tensor([[0.5, 2.0]])), torch.tensor([[6.5, 9.0]]))
    # head with fn = 0: pre = sigmoid(base) + eps
    out = hc_head(r, torch.zeros(2, 4), torch.tensor([0.0, 0.0]), torch.ones(1), hc_eps=0.0, rms_eps=1e-6)
    assert torch.allclose(out, torch.tensor([[2.0, 3.0]]))
