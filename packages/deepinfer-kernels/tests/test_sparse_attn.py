"""sparse_attn reference vs a naive per-query loop (docs/model.md §A.4: sink only in the denominator)."""

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


def test_second_source_equals_one_concatenated_pool() -> None:
    """kv2 / indices2 (a paged store read in place) == the same rows concatenated into one pool and one list."""
    g = torch.Generator().manual_seed(1)
    T, H, D, S, S2 = 4, 3, 8, 6, 9
    q, kv, kv2 = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g), torch.randn(S2, D, generator=g)
    idx = torch.tensor([[0, 5, -1], [1, -1, -1], [-1, -1, -1], [2, 3, 4]])
    idx2 = torch.tensor([[8, 0], [-1, -1], [-1, -1], [7, 7]])  # row 2: nothing at all -> zeros
    sink = torch.tensor([0.1, -0.5, 2.0])
    out = sparse_attn(q, kv, idx, sink, 0.4, kv2=kv2, indices2=idx2)
    pool = torch.cat([kv, kv2])
    flat = torch.cat([idx, torch.where(idx2 >= 0, idx2 + S, idx2)], 1)
    torch.testing.assert_close(out, sparse_attn(q, pool, flat, sink, 0.4), atol=1e-6, rtol=1e-6)
    assert torch.equal(out[2], torch.zeros(H, D))


def test_tilelang_backend_refuses_what_it_cannot_run(monkeypatch) -> None:
    """backend="tilelang" names the missing piece and the fix: tilelang not installed, or inputs it has no kernel
    for (CPU tensors, other head counts); "auto" never picks it on the CPU."""
    import pytest
    from deepinfer_kernels._backend import KernelBackendError
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    q, kv = torch.randn(2, 64, 512).bfloat16(), torch.randn(8, 512).bfloat16()
    idx, sink = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(64)
    monkeypatch.setattr(tl_sa, "tilelang_available", lambda: False)
    with pytest.raises(KernelBackendError, match=r"not importable; install deepinfer-kernels\[tilelang\]"):
        sparse_attn(q, kv, idx, sink, 0.1, backend="tilelang")
    monkeypatch.setattr(tl_sa, "tilelang_available", lambda: True)
    with pytest.raises(KernelBackendError, match="needs bf16 q \\[T, 64, 512\\] and kv on an sm_90 GPU .* and a non-empty first index list"):
        sparse_attn(q, kv, idx, sink, 0.1, backend="tilelang")
    assert not tl_sa.supports(q, kv, idx, None)
    assert not tl_sa.supports(q[:, :8], kv, idx, None)
    ref = sparse_attn(q, kv, idx, sink, 0.1, backend="torch")
    assert torch.equal(sparse_attn(q.repeat(64, 1, 1), kv, idx.repeat(64, 1), sink, 0.1)[:2], ref)


def test_auto_takes_tilelang_only_without_an_explicit_triton_request(monkeypatch) -> None:
    """On the GPU path, "auto" runs the TileLang kernel from TILELANG_MIN_TOKENS tokens on where it applies, but not
    under DEEPINFER_KERNEL_BACKEND=triton nor below the threshold (the kernels are stubbed: this checks routing)."""
    import deepinfer_kernels.sparse_attn as sa
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa
    from deepinfer_kernels.sparse_attn import triton as tr_sa

    calls = []
    monkeypatch.setattr(sa, "resolve_backend", lambda *a, **k: "triton")
    monkeypatch.setattr(tl_sa, "tilelang_available", lambda: True)
    monkeypatch.setattr(tl_sa, "supports", lambda *a: True)
    monkeypatch.setattr(tl_sa, "sparse_attn", lambda *a, **k: calls.append("tilelang"))
    monkeypatch.setattr(tr_sa, "sparse_attn", lambda *a, **k: calls.append("triton"))
    kv, sink = torch.randn(8, 512).bfloat16(), torch.zeros(64)
    n = sa.TILELANG_MIN_TOKENS
    for t, env, backend in [(n, "", "auto"), (n - 1, "", "auto"), (n, "triton", "auto"), (n, "", "device"),
                            (n, "", "triton-where-supported")]:  # fmt: skip
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", env)
        q, idx = torch.randn(t, 64, 512).bfloat16(), torch.zeros(t, 4, dtype=torch.int64)
        sparse_attn(q, kv, idx, sink, 0.1, backend=backend)
    assert calls == ["tilelang", "triton", "triton", "tilelang", "triton"]
    # record sources: their own threshold, and the formats reach the kernel
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3

    calls.clear()
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "")
    monkeypatch.setattr(tl_sa, "sparse_attn", lambda *a, **k: calls.append(
        ("tilelang", k["kv_format"], k.get("staged", False), k.get("block_rows", tl_sa.BLOCK_ROWS))))
    rec = torch.zeros(8, 528, dtype=torch.uint8)
    m = sa.TILELANG_MIN_TOKENS_RECORDS
    for t in (m, m - 1):
        q, idx = torch.randn(t, 64, 512).bfloat16(), torch.zeros(t, 4, dtype=torch.int64)
        sparse_attn(q, rec, idx, sink, 0.1, kv_format=MXFP8_E4M3)
    # every source records: the staged producer in its 32-row tiles; a bf16 second source: the plain producer
    assert calls == [("tilelang", MXFP8_E4M3, True, tl_sa.STAGED_BLOCK_ROWS), "triton"]
    calls.clear()
    q, idx = torch.randn(m, 64, 512).bfloat16(), torch.zeros(m, 4, dtype=torch.int64)
    sparse_attn(q, rec, idx, sink, 0.1, kv2=rec, indices2=idx, kv_format=MXFP8_E4M3, kv2_format=MXFP8_E4M3)
    sparse_attn(q, rec, idx, sink, 0.1, kv2=kv, indices2=idx, kv_format=MXFP8_E4M3)
    assert calls == [("tilelang", MXFP8_E4M3, True, tl_sa.STAGED_BLOCK_ROWS),
                     ("tilelang", MXFP8_E4M3, False, tl_sa.BLOCK_ROWS)]  # fmt: skip


def _records(x, fmt):
    from deepinfer_kernels.quant.kv_formats import quantize

    codes, scales = quantize(x, fmt)
    return torch.cat([codes, scales], 1)


def _decoded(rec, fmt, dim):
    from deepinfer_kernels.quant.kv_formats import dequantize

    cb = fmt.code_bytes(dim)
    return dequantize(rec[:, :cb], rec[:, cb:], fmt)


def test_record_sources_equal_attention_over_their_decoded_values() -> None:
    """kv_format / kv2_format: uint8 records read in place == the same rows decoded first (the decoded values are
    exact in bf16, so fp32 and bf16 agree with a bf16 cache holding the decoded values)."""
    from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1

    g = torch.Generator().manual_seed(3)
    T, H, D, S, S2 = 3, 4, 64, 10, 12
    q, kv, kv2 = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g), torch.randn(S2, D, generator=g)
    idx, idx2 = torch.randint(-1, S, (T, 7), generator=g), torch.randint(-1, S2, (T, 5), generator=g)
    sink = torch.randn(H, generator=g)
    for f1, f2 in ((MXFP8_E4M3, NVFP4_E2M1), (MXFP4_E2M1, None), (None, NVFP4_E2M1)):
        a = kv if f1 is None else _records(kv, f1)
        b = kv2 if f2 is None else _records(kv2, f2)
        da = kv if f1 is None else _decoded(a, f1, D)
        db = kv2 if f2 is None else _decoded(b, f2, D)
        for dt in (torch.float32, torch.bfloat16):
            got = sparse_attn(q.to(dt), a if f1 else a.to(dt), idx, sink, 0.2, kv2=b if f2 else b.to(dt),
                              indices2=idx2, kv_format=f1, kv2_format=f2)  # fmt: skip
            want = sparse_attn(q.to(dt), da.to(dt), idx, sink, 0.2, kv2=db.to(dt), indices2=idx2)
            assert torch.equal(got, want), (f1, f2, dt)


def test_record_sources_are_checked(monkeypatch) -> None:
    """A record source of the wrong dtype or width, a format without a decoder, or records backend="tilelang" has
    no kernel for, each get a clear error naming the fix."""
    import dataclasses

    import pytest
    from deepinfer_kernels._backend import KernelBackendError
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1

    q, idx, sink = torch.randn(2, 4, 64), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4)
    rec = _records(torch.randn(5, 64), MXFP8_E4M3)
    with pytest.raises(ValueError, match=r"not a set of mxfp8_e4m3 records of 64 channels; expected uint8 \[S, 66\]"):
        sparse_attn(q, rec[:, :-1], idx, sink, 0.1, kv_format=MXFP8_E4M3)
    with pytest.raises(ValueError, match="not a set of nvfp4_e2m1 records"):
        sparse_attn(q, rec, idx, sink, 0.1, kv_format=NVFP4_E2M1)
    with pytest.raises(ValueError, match="not a set of mxfp8_e4m3 records"):
        sparse_attn(q, torch.randn(5, 66), idx, sink, 0.1, kv_format=MXFP8_E4M3)
    odd = dataclasses.replace(MXFP8_E4M3, name="fp8_per_64", block=64)
    with pytest.raises(ValueError, match="fp8_per_64 has no decoder"):
        sparse_attn(q, rec, idx, sink, 0.1, kv_format=odd)
    with pytest.raises(ValueError, match=r"expected kv2 \[S2, 64\] torch.float32 \(or uint8 records with kv2_format\)"):
        sparse_attn(q, rec, idx, sink, 0.1, kv_format=MXFP8_E4M3, kv2=rec, indices2=idx)
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    monkeypatch.setattr(tl_sa, "tilelang_available", lambda: True)
    with pytest.raises(KernelBackendError, match="16-byte aligned MXFP8 / NVFP4 records"):
        sparse_attn(q, rec, idx, sink, 0.1, kv_format=MXFP8_E4M3, backend="tilelang")  # CPU tensors


def test_tilelang_staged_producer_takes_record_sources_in_32_row_tiles_only() -> None:
    """staged=True is refused, before any compile, for a bf16 source or tiles other than 32 rows."""
    import pytest
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(1, 4, dtype=torch.int64)
    sink = torch.zeros(64)
    rec = torch.zeros(8, 528, dtype=torch.uint8)
    with pytest.raises(ValueError, match="staged=True reads record sources only"):
        tl_sa.sparse_attn(q, torch.zeros(8, 512, dtype=torch.bfloat16), idx, sink, 0.1, block_rows=32, staged=True)
    with pytest.raises(ValueError, match="staged=True reads record sources only"):
        tl_sa.sparse_attn(q, rec, idx, sink, 0.1, block_rows=64, kv_format=MXFP8_E4M3, staged=True)
    with pytest.raises(ValueError, match="staged=True reads record sources only"):
        tl_sa.sparse_attn(q, rec, idx, sink, 0.1, kv2=torch.zeros(8, 512, dtype=torch.bfloat16), indices2=idx,
                          block_rows=32, kv_format=MXFP8_E4M3, staged=True)
