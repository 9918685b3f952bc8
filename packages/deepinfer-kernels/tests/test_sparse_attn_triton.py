"""Triton sparse attention vs the torch reference: CPU interpreter at tiny shapes, GPU at V4.1 decode shapes.

Tolerances (|triton - reference| <= atol + rtol * |reference|, elementwise):
- fp32 inputs: atol 2e-6, rtol 1e-5 (exact fp32 dots; only the summation order differs).
- bf16 inputs, interpreter: atol 1e-3, rtol 2^-7 = 1 bf16 ULP of the output (dots run on fp32 upcasts there;
  the interpreter truncates f32 -> bf16 instead of rounding).
- bf16 inputs, GPU: atol 1.5e-2, rtol 2e-2 (P is rounded to bf16 for the P@V tensor-core dot).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from deepinfer_kernels.sparse_attn import reference, sparse_attn
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_TOL = {
    ("cpu", torch.float32): (2e-6, 1e-5),
    ("cpu", torch.bfloat16): (1e-3, 2.0**-7),
    ("cuda", torch.float32): (2e-6, 1e-5),
    ("cuda", torch.bfloat16): (1.5e-2, 2e-2),
}


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.sparse_attn.triton") as (mod,):
        yield mod


def _case(t, h, d, s, k, dtype, device="cpu", seed=0, invalid_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(s, d, generator=g).to(dtype)
    idx = torch.randint(0, s, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < invalid_frac] = -1
    sink = torch.randn(h, generator=g) * 2
    return q.to(device), kv.to(device), idx.to(device), sink.to(device)


def _check(out, ref, device, dtype):
    atol, rtol = _TOL[(device, dtype)]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# (T, H, D, S, K): irregular heads (not a multiple of the head block), D not a power of two, K not a multiple of
# BLOCK_N=32, K shorter than one block, one decode token (split path chosen automatically).
_SHAPES = [(1, 4, 64, 50, 37), (3, 20, 40, 23, 70), (2, 16, 32, 9, 5), (5, 3, 24, 64, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreter_matches_reference(interp, shape, dtype):
    q, kv, idx, sink = _case(*shape, dtype)
    scale = shape[2] ** -0.5
    _check(
        interp.sparse_attn(q, kv, idx, sink, scale),
        reference.sparse_attn(q, kv, idx, sink, scale),
        "cpu",
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpreter_two_sources(interp, dtype, num_splits):
    """Window pool + a second source read in place (a tile straddles the boundary: K1 = 37 with BLOCK_N 16)."""
    q, kv, idx, sink = _case(3, 20, 40, 23, 37, dtype, seed=3)
    _, kv2, idx2, _ = _case(3, 20, 40, 50, 21, dtype, seed=4)
    idx2[1] = -1
    out = interp.sparse_attn(q, kv, idx, sink, 0.2, kv2=kv2, indices2=idx2, num_splits=num_splits, block_n=16)
    _check(out, reference.sparse_attn(q, kv, idx, sink, 0.2, kv2, idx2), "cpu", dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("qk_t,dv_split", [(False, 1), (False, 2), (True, 1), (True, 2)], ids=str)
def test_interpreter_launch_variants(interp, qk_t, dv_split, num_splits):
    """Both dot orientations x whole / half output columns per program: fp32 one source, bf16 two sources with the
    per-tile source choice (K1 = 32, a multiple of BLOCK_N 16) and with two loops (K1 = 37 and tile_src=False)."""
    kw = dict(num_splits=num_splits, block_n=16, qk_t=qk_t, dv_split=dv_split)
    q, kv, idx, sink = _case(3, 8, 32, 23, 37, torch.float32, seed=11)
    _check(interp.sparse_attn(q, kv, idx, sink, 0.2, **kw), reference.sparse_attn(q, kv, idx, sink, 0.2), "cpu",
           torch.float32)  # fmt: skip
    for k1, tile_src in ((32, True), (37, True), (32, False)):
        q, kv, idx, sink = _case(2, 8, 32, 23, k1, torch.bfloat16, seed=12)
        _, kv2, idx2, _ = _case(2, 8, 32, 50, 40, torch.bfloat16, seed=13)
        idx2[1] = -1
        out = interp.sparse_attn(q, kv, idx, sink, 0.2, kv2=kv2, indices2=idx2, tile_src=tile_src, **kw)
        _check(out, reference.sparse_attn(q, kv, idx, sink, 0.2, kv2, idx2), "cpu", torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dv_split", [1, 2])
def test_interpreter_index_prefetch_and_even_d(interp, dv_split, num_splits):
    """idx_ahead (next tile's indices loaded one iteration early) and even_d (no column mask, D a power of two):
    one source with a ragged last tile, two sources with the per-tile source choice (K1 = 32) and two loops
    (K1 = 37: the prefetch past each loop's end must read nothing)."""
    kw = dict(num_splits=num_splits, block_n=16, dv_split=dv_split, idx_ahead=True, even_d=True)
    q, kv, idx, sink = _case(3, 8, 32, 23, 45, torch.bfloat16, seed=21)
    _check(interp.sparse_attn(q, kv, idx, sink, 0.2, **kw), reference.sparse_attn(q, kv, idx, sink, 0.2), "cpu",
           torch.bfloat16)  # fmt: skip
    for k1 in (32, 37):
        q, kv, idx, sink = _case(2, 8, 32, 23, k1, torch.bfloat16, seed=22)
        _, kv2, idx2, _ = _case(2, 8, 32, 50, 40, torch.bfloat16, seed=23)
        idx2[1] = -1
        out = interp.sparse_attn(q, kv, idx, sink, 0.2, kv2=kv2, indices2=idx2, **kw)
        _check(out, reference.sparse_attn(q, kv, idx, sink, 0.2, kv2, idx2), "cpu", torch.bfloat16)
    # D = 40 is not a power of two: even_d must fall back to the masked tile
    q, kv, idx, sink = _case(2, 4, 40, 23, 37, torch.bfloat16, seed=24)
    _check(interp.sparse_attn(q, kv, idx, sink, 0.2, **kw), reference.sparse_attn(q, kv, idx, sink, 0.2), "cpu",
           torch.bfloat16)  # fmt: skip


def test_interpreter_large_batch_config_and_bf16_partials(interp):
    """More than SMALL_BATCH_CONFIG['max_tokens'] tokens take DEFAULT_CONFIG; a bf16 split workspace rounds each
    partial output once more (tolerance: 2 bf16 ULPs of outputs of magnitude <= 2 on top of the usual)."""
    t = interp.SMALL_BATCH_CONFIG["max_tokens"] + 1
    q, kv, idx, sink = _case(t, 4, 16, 30, 50, torch.float32, seed=14)
    _check(interp.sparse_attn(q, kv, idx, sink, 0.3), reference.sparse_attn(q, kv, idx, sink, 0.3), "cpu",
           torch.float32)  # fmt: skip
    # bf16 batches of LARGE_BATCH_CONFIG['min_tokens'] tokens take that tier (4 stages, indices ahead, no column mask)
    q, kv, idx, sink = _case(interp.LARGE_BATCH_CONFIG["min_tokens"], 4, 16, 30, 40, torch.bfloat16, seed=16)
    _check(interp.sparse_attn(q, kv, idx, sink, 0.3), reference.sparse_attn(q, kv, idx, sink, 0.3), "cpu",
           torch.bfloat16)  # fmt: skip
    q, kv, idx, sink = _case(3, 4, 16, 30, 50, torch.bfloat16, seed=15)
    out = interp.sparse_attn(q, kv, idx, sink, 0.3, num_splits=3, block_n=16, partial_dtype=torch.bfloat16)
    ref = reference.sparse_attn(q, kv, idx, sink, 0.3)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2.0**-7)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 100])
def test_interpreter_split_counts(interp, num_splits):
    """Flash-decoding merge: any split count (more than blocks = clamped) gives the same result."""
    q, kv, idx, sink = _case(2, 5, 32, 40, 100, torch.float32, seed=1)
    out = interp.sparse_attn(q, kv, idx, sink, 0.3, num_splits=num_splits, block_n=16)
    _check(out, reference.sparse_attn(q, kv, idx, sink, 0.3), "cpu", torch.float32)


def test_interpreter_corner_rows(interp):
    """All-invalid rows give exactly 0; -1 padding at the end (window style) and duplicates count like the
    reference; a split that sees only -1 entries must not disturb the merge; out-of-range rows act as -1."""
    t, h, d, s, k = 4, 4, 16, 12, 40
    q, kv, idx, sink = _case(t, h, d, s, k, torch.float32, seed=2, invalid_frac=0.0)
    idx[0] = -1  # all invalid
    idx[1, 7:] = -1  # trailing padding: the later splits see nothing
    idx[2] = 3  # one row repeated: weight K * exp(s) vs the sink
    idx[3, ::2] = -1
    out = interp.sparse_attn(q, kv, idx, sink, 0.25, num_splits=3, block_n=16)
    ref = reference.sparse_attn(q, kv, idx, sink, 0.25)
    _check(out, ref, "cpu", torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    bad = idx.clone()
    bad[3, ::2] = s + 5  # out of range: masked like -1 by the kernel (no device-side range check)
    torch.testing.assert_close(interp.sparse_attn(q, kv, bad, sink, 0.25, num_splits=3, block_n=16), out)


def test_interpreter_extreme_sink_and_scores(interp):
    """A huge sink swamps every score (output -> 0); a very negative sink leaves plain softmax attention."""
    q, kv, idx, sink = _case(2, 4, 16, 10, 20, torch.float32, seed=3, invalid_frac=0.1)
    q = q * 30  # large logits stress the running max
    for value in (80.0, -80.0):
        sk = torch.full_like(sink, value)
        out = interp.sparse_attn(q, kv, idx, sk, 1.0, num_splits=2, block_n=16)
        _check(out, reference.sparse_attn(q, kv, idx, sk, 1.0), "cpu", torch.float32)


def test_interpreter_non_contiguous_q_and_empty(interp):
    q, kv, idx, sink = _case(3, 8, 32, 16, 20, torch.float32, seed=4)
    wide = torch.randn(3, 8, 64)
    wide[..., :32] = q
    qs = wide[..., :32]  # stride(2)=1, stride(1)=64
    _check(
        interp.sparse_attn(qs, kv, idx, sink, 0.2),
        reference.sparse_attn(q, kv, idx, sink, 0.2),
        "cpu",
        torch.float32,
    )
    empty = interp.sparse_attn(q[:0], kv, idx[:0], sink, 0.2)
    assert empty.shape == (0, 8, 32)


def test_dispatcher_routes_to_interpreter(interp, monkeypatch):
    """The public sparse_attn(backend='triton') reaches the (interpreted) kernel and keeps the dtype."""
    q, kv, idx, sink = _case(2, 4, 16, 8, 12, torch.bfloat16, seed=5)
    out = sparse_attn(q, kv, idx, sink, 0.25, backend="triton")
    _check(out, reference.sparse_attn(q, kv, idx, sink, 0.25), "cpu", torch.bfloat16)
    called = []
    monkeypatch.setattr(interp, "sparse_attn", lambda *a, **kw: called.append(1) or reference.sparse_attn(*a))
    sparse_attn(q, kv, idx, sink, 0.25, backend="triton")
    assert called == [1]
    sparse_attn(q, kv, idx, sink, 0.25)  # auto on CPU: reference, not the kernel
    assert called == [1]


def _records(x, fmt):
    from deepinfer_kernels.quant.kv_formats import quantize

    codes, scales = quantize(x.float(), fmt)
    return torch.cat([codes, scales], 1)


def _decoded(rec, fmt, dim, dtype):
    from deepinfer_kernels.quant.kv_formats import dequantize

    cb = fmt.code_bytes(dim)
    return dequantize(rec[:, :cb], rec[:, cb:], fmt, dtype)


def _record_pair(t, h, d, s, s2, k, k2, device="cpu", seed=0):
    """A window source of MXFP8 records and a compressed source of NVFP4 records (V4.1's cache), with values
    over a wide range of magnitudes (2^-12 to 2^1 per 16 channels: subnormal e4m3 scales and codes included)."""
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    mag = 2.0 ** torch.randint(-12, 2, (s + s2, d // 16), generator=g).float().repeat_interleave(16, 1)
    vals = torch.randn(s + s2, d, generator=g) * mag
    r1, r2 = _records(vals[:s], MXFP8_E4M3), _records(vals[s:], NVFP4_E2M1)
    idx, idx2 = torch.randint(-1, s, (t, k), generator=g), torch.randint(-1, s2, (t, k2), generator=g)
    sink = torch.randn(h, generator=g)
    return [x.to(device) for x in (q, r1, r2, idx, idx2, sink)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_splits,dv_split", [(1, 1), (3, 1), (1, 2), (3, 2)], ids=str)
def test_interpreter_records_read_in_place(interp, dtype, num_splits, dv_split):
    """MXFP8 window + NVFP4 compressed records decoded in the gather == the kernel over the decoded values
    (bitwise: the decoded values are exact in bf16) and the reference within the tolerances above."""
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1

    q, r1, r2, idx, idx2, sink = _record_pair(3, 20, 64, 40, 30, 33, 12, seed=num_splits + 10 * dv_split)
    q = q.to(dtype)
    d1, d2 = _decoded(r1, MXFP8_E4M3, 64, dtype), _decoded(r2, NVFP4_E2M1, 64, dtype)
    kw = dict(num_splits=num_splits, dv_split=dv_split)
    got = interp.sparse_attn(q, r1, idx, sink, 0.125, kv2=r2, indices2=idx2, kv_format=MXFP8_E4M3,
                             kv2_format=NVFP4_E2M1, **kw)  # fmt: skip
    assert torch.equal(got, interp.sparse_attn(q, d1, idx, sink, 0.125, kv2=d2, indices2=idx2, **kw))
    _check(got, reference.sparse_attn(q, d1, idx, sink, 0.125, d2, idx2), "cpu", dtype)


def test_interpreter_record_formats_alone_and_mixed(interp):
    """Each decoder alone (one source), and records beside plain values in either order."""
    from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1

    q, _, _, idx, idx2, sink = _record_pair(2, 8, 64, 24, 16, 20, 9, seed=5)
    g = torch.Generator().manual_seed(6)
    vals, vals2 = torch.randn(24, 64, generator=g), torch.randn(16, 64, generator=g)
    for fmt in (MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1):
        rec = _records(vals, fmt)
        dec = _decoded(rec, fmt, 64, torch.float32)
        got = interp.sparse_attn(q, rec, idx, sink, 0.125, kv_format=fmt)
        _check(got, reference.sparse_attn(q, dec, idx, sink, 0.125), "cpu", torch.float32)
        got = interp.sparse_attn(q, rec, idx, sink, 0.125, kv2=vals2, indices2=idx2, kv_format=fmt)
        _check(got, reference.sparse_attn(q, dec, idx, sink, 0.125, vals2, idx2), "cpu", torch.float32)
        rec2 = _records(vals2, fmt)
        got = interp.sparse_attn(q, vals, idx, sink, 0.125, kv2=rec2, indices2=idx2, kv2_format=fmt)
        want = reference.sparse_attn(q, vals, idx, sink, 0.125, _decoded(rec2, fmt, 64, torch.float32), idx2)
        _check(got, want, "cpu", torch.float32)


# ------------------------------------------------------------------------------------------------ GPU (H200)
_GPU_SHAPES = [
    (1, 64, 512, 4096, 640),
    (7, 64, 512, 3000, 640),
    (64, 64, 512, 65536, 640),
    (33, 16, 512, 900, 129),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_reference(shape, dtype):
    q, kv, idx, sink = _case(*shape, dtype, device="cuda", seed=7)
    idx[0] = -1
    scale = 1 / math.sqrt(shape[2])
    out = sparse_attn(q, kv, idx, sink, scale, backend="triton")
    _check(out, reference.sparse_attn(q, kv, idx, sink, scale), "cuda", dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_two_sources_match_reference(dtype):
    """V4.1 decode shape: window pool of 128 rows + 512 selected compressed rows of a paged store, in place."""
    q, kv, idx, sink = _case(8, 64, 512, 8 * 136, 128, dtype, device="cuda", seed=9)
    _, kv2, idx2, _ = _case(8, 64, 512, 4096, 512, dtype, device="cuda", seed=10)
    out = sparse_attn(q, kv, idx, sink, 512**-0.5, kv2=kv2, indices2=idx2, backend="triton")
    _check(out, reference.sparse_attn(q, kv, idx, sink, 512**-0.5, kv2, idx2), "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5, 20])
def test_gpu_split_counts(num_splits):
    q, kv, idx, sink = _case(3, 64, 512, 2000, 640, torch.bfloat16, device="cuda", seed=8)
    from deepinfer_kernels.sparse_attn import triton as triton_backend

    out = triton_backend.sparse_attn(q, kv, idx, sink, 512**-0.5, num_splits=num_splits)
    _check(out, reference.sparse_attn(q, kv, idx, sink, 512**-0.5), "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [dict(block_n=32, num_stages=4, idx_ahead=True, even_d=True), dict(block_n=32, num_stages=3, idx_ahead=True)],
    ids=["ahead-s4-even", "ahead-s3"],
)
def test_gpu_launch_knobs_match_reference(cfg):
    """The sweep's index-prefetch configurations at the V4.1 decode shape, one and two sources, split and
    not (T = 3 splits the index list; T = 64 with num_splits=1 does not)."""
    from deepinfer_kernels.sparse_attn import triton as triton_backend

    kw = dict(cfg, block_h=64, num_warps=8, dv_split=1)
    for t, splits in ((3, None), (64, 1)):
        q, kv, idx, sink = _case(t, 64, 512, 4096, 640, torch.bfloat16, device="cuda", seed=40 + t)
        out = triton_backend.sparse_attn(q, kv, idx, sink, 512**-0.5, num_splits=splits, **kw)
        _check(out, reference.sparse_attn(q, kv, idx, sink, 512**-0.5), "cuda", torch.bfloat16)
        out = triton_backend.sparse_attn(
            q, kv, idx[:, :128], sink, 512**-0.5, kv2=kv, indices2=idx[:, 128:], num_splits=splits, **kw
        )
        _check(out, reference.sparse_attn(q, kv, idx[:, :128], sink, 512**-0.5, kv, idx[:, 128:]), "cuda",
               torch.bfloat16)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_gpu_records_read_in_place(t):
    """V4.1 decode shape over the deployed records: 128 MXFP8 window rows + 512 NVFP4 compressed rows per token,
    every launch tier (small / default / large batch); == the kernel over the decoded bf16 values, bitwise."""
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1
    from deepinfer_kernels.sparse_attn import triton as tk

    q, r1, r2, idx, idx2, sink = _record_pair(t, 64, 512, t * 136, 4096, 128, 512, device="cuda", seed=t)
    q = q.bfloat16()
    d1, d2 = _decoded(r1, MXFP8_E4M3, 512, torch.bfloat16), _decoded(r2, NVFP4_E2M1, 512, torch.bfloat16)
    got = sparse_attn(q, r1, idx, sink, 512**-0.5, kv2=r2, indices2=idx2, kv_format=MXFP8_E4M3,
                      kv2_format=NVFP4_E2M1, backend="triton")  # fmt: skip
    # bitwise only under one launch configuration: up to SMALL_BATCH_CONFIG's tokens records take their own tiles
    same = {} if t > tk.SMALL_BATCH_CONFIG["max_tokens"] else dict(tk.RECORD_SMALL_BATCH_CONFIG)
    plain = tk.sparse_attn(q, d1, idx, sink, 512**-0.5, kv2=d2, indices2=idx2, **same)
    _check(got, reference.sparse_attn(q, d1, idx, sink, 512**-0.5, d2, idx2), "cuda", torch.bfloat16)
    assert torch.equal(got, plain)
