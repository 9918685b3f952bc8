"""Triton kernels of the indexer vs the torch references.

Scores: equal up to fp32 summation order (rtol 1e-5 of the row's largest |score| on fp32 inputs; bf16 operands
multiply exactly, so the same bound holds). Causal top-k and store rows: exact.

Rows cover exact ties (the lower id wins), -0.0 against +0.0 (equal), -inf and causally hidden entries (never
selected: -1 padding), +inf (pinned candidate blocks), NaN (above +inf, as the reference's sort has it), fewer
selectable entries than k, k above N, rows held in registers and rows walked in chunks, and bf16 scores.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.indexer import causal_mask, index_scores, reference, store_rows, topk_indices
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.indexer.triton") as (mod,):
        yield mod


def _scores(t: int, n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(t, n, generator=g)
    if n >= 8:
        s[:, ::3] = torch.round(s[:, ::3] * 2) / 2  # many exact ties
        s[0, : n // 2] = float("-inf")  # fewer selectable entries than k on row 0
        s[1 % t, 3] = float("inf")
        s[:, 1], s[:, 2] = -0.0, 0.0
        if t > 2:
            s[2, 5] = float("nan")
        if t > 3:
            s[3] = 0.25  # one tie class over the whole row
    return s.to(device)


def _want(s: torch.Tensor, k: int, vis: torch.Tensor | None) -> torch.Tensor:
    return reference.topk_indices(s if vis is None else causal_mask(s, vis), k)


@pytest.mark.parametrize(("t", "n", "k"), [(5, 50, 8), (2, 4100, 64), (4, 600, 100), (3, 7, 16), (2, 0, 4), (4, 300, 300),
                                           (1, 1, 1)])  # fmt: skip
def test_topk_interpreter_matches_reference(interp, t, n, k):
    s = _scores(t, n, n + k)
    vis = torch.randint(0, n + 1, (t,), generator=torch.Generator().manual_seed(n))
    assert torch.equal(interp.topk_indices(s, k), _want(s, k, None))
    assert torch.equal(interp.topk_indices(s, k, vis), _want(s, k, vis))
    sb = s.bfloat16()
    assert torch.equal(interp.topk_indices(sb, k, vis), _want(sb, k, vis))


def _score_inputs(t: int, h: int, d: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(t * h + d + n)
    q = torch.randn(t, h, d, generator=g).to(dtype).to(device)
    w = torch.randn(t, h, generator=g).to(device)
    return q, w, torch.randn(n, d, generator=g).to(dtype).to(device), torch.randn(t, n, d, generator=g).to(dtype).to(
        device)


def _close_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    if want.numel():
        scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        assert float(((got - want).abs() / scale).max()) <= 1e-5


@pytest.mark.parametrize(("t", "h", "d", "n"), [(3, 4, 32, 50), (2, 64, 128, 70), (1, 5, 24, 7), (2, 3, 16, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scores_interpreter_matches_reference(interp, t, h, d, n, dtype):
    q, w, keys, keys3 = _score_inputs(t, h, d, n, dtype)
    _close_scores(interp.index_scores(q, w, keys), reference.index_scores(q, w, keys))
    _close_scores(interp.index_scores(q, w, keys3), reference.index_scores_per_query(q, w, keys3))
    # the head-weight scale folded into the kernel: the same fp32 multiply the caller did before the call
    _close_scores(interp.index_scores(q, w, keys, 0.0883883), reference.index_scores(q, w * 0.0883883, keys))


def test_scores_dispatcher():
    q, w, keys, keys3 = _score_inputs(2, 4, 16, 9, torch.float32)
    assert torch.equal(index_scores(q, w, keys3, backend="torch"), reference.index_scores_per_query(q, w, keys3))
    torch.testing.assert_close(index_scores(q, w, keys3, backend="torch"),
                               torch.stack([reference.index_scores(q[i : i + 1], w[i : i + 1], keys3[i])[0]
                                            for i in range(2)]))  # fmt: skip
    assert torch.equal(index_scores(q, w, keys, w_scale=0.25, backend="torch"), reference.index_scores(q, w * 0.25, keys))
    with pytest.raises(ValueError, match="expected"):
        index_scores(q, w, keys[:, :8])
    # mixed dtypes: the reference
    assert torch.equal(index_scores(q, w, keys.double(), backend="auto"), reference.index_scores(q, w, keys.double()))


def _store_inputs(t: int, k: int, s: int, e: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(t + k + e)
    sel = torch.randint(-1, max(1, e // s), (t, k), generator=g)
    sel[0, : k // 2] = -1
    seq = torch.randint(0, s, (t,), generator=g)
    offsets = torch.arange(s) * (e // s)
    rows = torch.randperm(max(e, 1), generator=g)[:e] * 3
    return sel.to(device), seq.to(device), offsets.to(device), rows.to(device)


@pytest.mark.parametrize(("t", "k", "s", "e"), [(4, 8, 2, 20), (3, 1500, 3, 3000), (1, 5, 1, 1)])
def test_store_rows_interpreter_matches_reference(interp, t, k, s, e):
    sel, seq, offsets, rows = _store_inputs(t, k, s, e)
    assert torch.equal(interp.store_rows(sel, seq, offsets, rows), reference.store_rows(sel, seq, offsets, rows))


def test_store_rows_dispatcher():
    sel, seq, offsets, rows = _store_inputs(3, 6, 2, 10)
    assert torch.equal(store_rows(sel, seq, offsets, rows), reference.store_rows(sel, seq, offsets, rows))
    assert torch.equal(store_rows(sel, seq, offsets, rows[:0]), torch.full_like(sel, -1))  # no entries: reference
    with pytest.raises(ValueError, match="expected"):
        store_rows(sel, seq[:2], offsets, rows)


def test_topk_dispatcher_validation_and_torch_path():
    s = _scores(3, 20, 1)
    vis = torch.tensor([0, 5, 20])
    assert torch.equal(topk_indices(s, 4, vis, backend="torch"), _want(s, 4, vis))
    with pytest.raises(ValueError, match="k must be"):
        topk_indices(s, 0)
    with pytest.raises(ValueError, match="expected"):
        topk_indices(s, 3, torch.tensor([1, 2]))


def test_topk_kernel_compiles_for_sm90():
    """Offline sm_90a compile: the interpreter accepts what the GPU compiler may reject."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.indexer import triton as it
out = {}
for dt, hv in (("*fp32", True), ("*bf16", False)):
    for chunked, block, warps in ((True, 1024, 8), (False, 4096, 8), (False, 64, 4)):
        out[f"{dt} {hv} {chunked} {block}"] = rep(it._topk_kernel, {"s_ptr": dt, "vis_ptr": "*i64",
            "out_ptr": "*i64", "N": "i32", "K": "i32", "stride_s": "i32", "stride_o": "i32"},
            {"HAS_VIS": hv, "CHUNKED": chunked, "BLOCK": block}, num_warps=warps)
for dt, f32 in (("*bf16", False), ("*fp32", True)):
    out[f"scores {dt}"] = rep(it._scores_kernel, {"q_ptr": dt, "w_ptr": "*fp32", "k_ptr": dt, "out_ptr": "*fp32",
        "H": "i32", "N": "i32", "D": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_wt": "i32",
        "stride_kt": "i32", "stride_kn": "i32", "stride_ot": "i32", "w_scale": "fp32"},
        {"DOT_F32": f32, "BLOCK_H": 64, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8)
out["store rows"] = rep(it._store_rows_kernel, {"sel_ptr": "*i64", "seq_ptr": "*i64", "off_ptr": "*i64",
    "rows_ptr": "*i64", "out_ptr": "*i64", "K": "i32", "E": "i32", "stride_s": "i32", "stride_o": "i32"},
    {"BLOCK": 1024}, num_warps=4)
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    support = str(Path(__file__).resolve().parent / "support")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (support, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 9
    for name, r in report.items():
        assert r["stack"] <= 64 and r["shared"] <= 64 * 1024, (name, r)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), [(1, 4096, 512), (64, 4096, 512), (8, 65536, 2048), (3, 300, 1024),
                                           (16, 2048, 64)])  # fmt: skip
def test_topk_gpu_matches_reference(t, n, k):
    s = _scores(t, n, t * n + k, "cuda")
    vis = torch.randint(0, n + 1, (t,), generator=torch.Generator().manual_seed(k)).cuda()
    vis[0] = n
    for dt in (torch.float32, torch.bfloat16):
        x = s.to(dt)
        assert torch.equal(topk_indices(x, k, backend="triton"), _want(x, k, None)), dt
        assert torch.equal(topk_indices(x, k, vis, backend="triton"), _want(x, k, vis)), dt


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n"), [(1, 4096), (64, 2048), (8, 300)])
def test_scores_gpu_matches_reference(t, n):
    """V4.1 indexer widths: 64 heads of 128 dims."""
    for dtype in (torch.bfloat16, torch.float32):
        q, w, keys, keys3 = _score_inputs(t, 64, 128, n, dtype, "cuda")
        _close_scores(index_scores(q, w, keys, backend="triton"), reference.index_scores(q, w, keys))
        _close_scores(index_scores(q, w, keys3, backend="triton"), reference.index_scores_per_query(q, w, keys3))


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "k", "s", "e"), [(1, 512, 1, 4096), (64, 512, 64, 64 * 2048), (8, 2048, 3, 300)])
def test_store_rows_gpu_matches_reference(t, k, s, e):
    sel, seq, offsets, rows = _store_inputs(t, k, s, e, "cuda")
    got = store_rows(sel, seq, offsets, rows, backend="triton")
    assert torch.equal(got, reference.store_rows(sel, seq, offsets, rows))


@pytest.mark.gpu
def test_topk_gpu_in_cuda_graph():
    s = _scores(4, 4096, 3, "cuda")
    vis = torch.tensor([4096, 100, 0, 2049], device="cuda")
    want = _want(s, 512, vis)
    out = topk_indices(s, 512, vis, backend="triton")  # compile outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = topk_indices(s, 512, vis, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
