"""sparse_attn reference vs a naive per-query loop (architecture.md §A.4: sink only in the denominator)."""

from __future__ import annotations

import math

import torch
from deepinfer_kernels.sparse_attn import sparse_attn


def test_matches_naive_loop_with_sink() -> None:
    g = torch.Generator().manual_seed(0)
    T, H, D, S = 3, 2, 4, 5
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g)
    idx = torch.tensor([[0, 2, -1], [1, 3, 4], [-1, -1, 2]])
    sink = torch.tensor([0.3, -1.0])
    out = sparse_attn(q, kv, idx, sink, 0.5)
    for t in range(T):
        for h in range(H):
            rows = [int(j) for j in idx[t] if j >= 0]
            a = [float(q[t, h] @ kv[j]) * 0.5 for j in rows]
            den = sum(math.exp(v) for v in a) + math.exp(float(sink[h]))
            want = sum(math.exp(v) / den * kv[j] for v, j in zip(a, rows))
            assert torch.allclose(out[t, h], want, atol=1e-5)


def test_all_invalid_row_gives_zero() -> None:
    out = sparse_attn(torch.ones(1, 1, 2), torch.ones(3, 2), torch.full((1, 2), -1), torch.zeros(1), 1.0)
    assert torch.equal(out, torch.zeros(1, 1, 2))
