"""TileLang sparse decode attention (warp-specialised, sm_90a) vs the torch reference, at the V4.1 head shape.

GPU only: TileLang compiles CUDA kernels without a GPU but cannot run them (docs/kernels.md §7). Tolerance as the
Triton kernel's bf16 GPU tests: atol 1.5e-2, rtol 2e-2 (P is rounded to bf16 for the P@V tensor-core dot).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.sparse_attn import reference, sparse_attn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang not installed"),
]

H, D = 64, 512


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _rows(t, s, k, g, invalid_frac):
    idx = torch.randint(0, s, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < invalid_frac] = -1
    return idx


def _case(t, s1, k1, s2, k2, seed, invalid_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(s1, D, generator=g).to(torch.bfloat16).cuda()
    idx = _rows(t, s1, k1, g, invalid_frac).cuda()
    kv2 = torch.randn(s2, D, generator=g).to(torch.bfloat16).cuda() if k2 else None
    idx2 = _rows(t, s2, k2, g, invalid_frac).cuda() if k2 else None
    sink = (torch.randn(H, generator=g) * 2).cuda()
    return q, kv, idx, kv2, idx2, sink


def _check(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=1.5e-2, rtol=2e-2)


# (T, S1, K1, S2, K2): the decode form (window 128 + 512 compressed), one source, index counts that are not a
# multiple of the 128-row tile pair (a trailing all-invalid tile), one token, more tokens than SMs.
_SHAPES = [(4, 4 * 128, 128, 5000, 512), (3, 3000, 640, 1, 0), (2, 300, 100, 700, 37), (1, 64, 5, 1, 0),
           (200, 200 * 128, 128, 20000, 512)]  # fmt: skip


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape):
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    t, s1, k1, s2, k2 = shape
    q, kv, idx, kv2, idx2, sink = _case(t, s1, k1, s2, k2, seed=sum(shape))
    out = tl_sa.sparse_attn(q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2)
    _check(out, reference.sparse_attn(q, kv, idx, sink, D**-0.5, kv2, idx2))


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
def test_invalid_rows_and_out_of_range_indices():
    """All-invalid tokens give exactly 0 (the sink alone); indices past a source's rows act as -1."""
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    q, kv, idx, kv2, idx2, sink = _case(3, 256, 128, 512, 64, seed=5, invalid_frac=0.0)
    idx[0] = -1
    idx2[0] = -1
    idx[1, :10] = 256 + torch.arange(10, device="cuda")  # out of range of kv
    idx2[1, :5] = 10**9  # out of range of kv2
    out = tl_sa.sparse_attn(q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref_idx, ref_idx2 = idx.clone(), idx2.clone()
    ref_idx[ref_idx >= 256] = -1
    ref_idx2[ref_idx2 >= 512] = -1
    _check(out, reference.sparse_attn(q, kv, ref_idx, sink, D**-0.5, kv2, ref_idx2))


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
def test_dispatcher_picks_tilelang_and_replays_in_a_graph():
    """backend="tilelang" runs it; a CUDA graph capture of it replays with new inputs (the engine captures decode)."""
    q, kv, idx, kv2, idx2, sink = _case(160, 160 * 128, 128, 9000, 512, seed=11)
    out = sparse_attn(q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2, backend="tilelang")
    _check(out, reference.sparse_attn(q, kv, idx, sink, D**-0.5, kv2, idx2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = sparse_attn(q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2, backend="tilelang")
    q2, _, idx_b, _, idx2_b, _ = _case(160, 160 * 128, 128, 9000, 512, seed=12)
    q.copy_(q2)
    idx.copy_(idx_b)
    idx2.copy_(idx2_b)
    graph.replay()
    torch.cuda.synchronize()
    _check(out_g, reference.sparse_attn(q, kv, idx, sink, D**-0.5, kv2, idx2))
