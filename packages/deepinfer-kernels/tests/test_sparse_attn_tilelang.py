"""TileLang sparse decode attention (warp-specialised, sm_90a) vs the torch reference, at the V4.1 head shape.

GPU only: TileLang compiles CUDA kernels without a GPU but cannot run them (docs/kernels.md §7). Tolerance as the
Triton kernel's bf16 GPU tests: atol 1.5e-2, rtol 2e-2 (P is rounded to bf16 for the P@V tensor-core dot).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1, decode_records, quantize
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


# Record sources: the producer decodes uint8 records (codes, then scale bytes) into the bf16 tile. Two checks per
# case: against the torch reference over the same records (tolerance above), and bitwise against the same kernel
# over the decoded bf16 rows, since the record path must store exactly the values decode_records gives at the
# positions the bf16 path copies them to (the consumers are the same code).


def _record_rows(s, fmt, g):
    """s random rows as fmt records [s, fmt.record_bytes(D)] uint8 (CUDA). Every third row is scaled by
    2^-(b mod 13) in 16-column block b: small UE8M0 scales and e4m3 scales in NVFP4's subnormal range occur."""
    x = torch.randn(s, D, generator=g)
    x[::3] *= 2.0 ** -(torch.arange(D // 16) % 13).repeat_interleave(16).float()
    codes, scales = quantize(x, fmt)
    return torch.cat([codes, scales], 1).cuda()


def _source(s, fmt, g):
    return torch.randn(s, D, generator=g).to(torch.bfloat16).cuda() if fmt is None else _record_rows(s, fmt, g)


def _decoded(src, fmt):
    return src if src is None or fmt is None else decode_records(src, fmt, torch.bfloat16)


def _record_case(t, s1, k1, s2, k2, seed, fmt1, fmt2):
    """A decode-like case over record sources with -1 and out-of-range indices in both lists and, for t > 1, a
    last token whose lists are all invalid. Returns the inputs and the reference's index lists (out of range -> -1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g).to(torch.bfloat16).cuda()
    kv = _source(s1, fmt1, g)
    idx = _rows(t, s1, k1, g, 0.2)
    idx[:, 1] = s1 + torch.arange(t)  # past kv's rows
    kv2 = _source(s2, fmt2, g) if k2 else None
    idx2 = _rows(t, s2, k2, g, 0.2) if k2 else None
    if k2:
        idx2[:, 0] = 10**9  # past kv2's rows
    if t > 1:
        idx[-1] = -1
        if k2:
            idx2[-1] = -1
    sink = (torch.randn(H, generator=g) * 2).cuda()
    idx, idx2 = idx.cuda(), None if idx2 is None else idx2.cuda()
    ref_idx = idx.masked_fill(idx >= s1, -1)
    ref_idx2 = None if idx2 is None else idx2.masked_fill(idx2 >= s2, -1)
    return q, kv, idx, kv2, idx2, sink, ref_idx, ref_idx2


def _check_records(case, fmt1, fmt2, block_rows=64, staged=False):
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    q, kv, idx, kv2, idx2, sink, ref_idx, ref_idx2 = case
    assert tl_sa.supports(q, kv, idx, kv2, fmt1, fmt2)
    out = tl_sa.sparse_attn(
        q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2, block_rows=block_rows, kv_format=fmt1, kv2_format=fmt2,
        staged=staged,
    )  # fmt: skip
    _check(out, reference.sparse_attn(q, kv, ref_idx, sink, D**-0.5, kv2, ref_idx2, kv_format=fmt1, kv2_format=fmt2))
    same = tl_sa.sparse_attn(
        q, _decoded(kv, fmt1), idx, sink, D**-0.5, kv2=_decoded(kv2, fmt2), indices2=idx2, block_rows=block_rows
    )
    assert torch.equal(out, same)
    if q.shape[0] > 1:  # all-invalid token: the sink alone, exactly 0 (no NaN from the tile buffers)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    return out


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
@pytest.mark.parametrize("t", [1, 64, 200])
def test_records_window_mxfp8_compressed_nvfp4(t):
    """The deployed decode form: window ring of MXFP8 records (128 per token) + compressed store of NVFP4 records."""
    case = _record_case(t, t * 128, 128, 5000, 300, seed=100 + t, fmt1=MXFP8_E4M3, fmt2=NVFP4_E2M1)
    _check_records(case, MXFP8_E4M3, NVFP4_E2M1)


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
@pytest.mark.parametrize("fmt", [MXFP8_E4M3, NVFP4_E2M1], ids=lambda f: f.name)
def test_records_one_source(fmt):
    """One record source (the one-source kernel declares its unused second source in the first one's format)."""
    case = _record_case(5, 700, 333, 1, 0, seed=7, fmt1=fmt, fmt2=None)
    _check_records(case, fmt, None)


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
@pytest.mark.parametrize(
    "fmts",
    [(None, NVFP4_E2M1), (MXFP8_E4M3, None), (NVFP4_E2M1, MXFP8_E4M3)],
    ids=lambda f: "-".join(x.name if x else "bf16" for x in f),
)
def test_records_mixed_with_bf16_and_swapped_formats(fmts):
    """A bf16 source next to a record source (cp.async copies and decoded stores in one tile), and the formats
    swapped between the sources."""
    case = _record_case(9, 1200, 150, 900, 170, seed=21, fmt1=fmts[0], fmt2=fmts[1])
    _check_records(case, *fmts)


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
def test_records_32_row_tiles():
    """32-row tiles (four buffers; the producer then decodes one pass of rows at a time)."""
    case = _record_case(64, 64 * 128, 128, 3000, 256, seed=3, fmt1=MXFP8_E4M3, fmt2=NVFP4_E2M1)
    _check_records(case, MXFP8_E4M3, NVFP4_E2M1, block_rows=32)


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
@pytest.mark.parametrize(
    "t, s1, k1, s2, k2, fmts",
    [(1, 128, 128, 5000, 300, (MXFP8_E4M3, NVFP4_E2M1)), (200, 200 * 128, 128, 20000, 512, (MXFP8_E4M3, NVFP4_E2M1)),
     (5, 700, 333, 1, 0, (MXFP8_E4M3, None)), (5, 700, 333, 1, 0, (NVFP4_E2M1, None)),
     (9, 1200, 150, 900, 170, (NVFP4_E2M1, MXFP8_E4M3))],
    ids=["decode-t1", "decode-t200", "one-mxfp8", "one-nvfp4", "swapped"],
)  # fmt: skip
def test_records_staged_producer(t, s1, k1, s2, k2, fmts):
    """The staged record producer (raw rows cp.async'd into shared slots tiles ahead, decoded from there) equals the
    reference, and bit for bit the bf16 kernel over the decoded rows with the same 32-row tiles: lists shorter than
    the copy lookahead, lists off the tile grid, one source of each format and the formats swapped."""
    case = _record_case(t, s1, k1, s2, k2, seed=40 + t, fmt1=fmts[0], fmt2=fmts[1])
    _check_records(case, *fmts, block_rows=32, staged=True)


@pytest.mark.parametrize("staged", [False, True], ids=["loads", "staged"])
@pytest.mark.parametrize("fmts", [(1, 2), (2, 1), (1, 1)], ids=["mxfp8-nvfp4", "nvfp4-mxfp8", "mxfp8-mxfp8"])
def test_records_kernel_parameters_keep_their_names(fmts, staged):
    """The prim_func's buffers keep the parameter names and each source its own record width: a source buffer
    bound to a Python name inside a macro was once renamed after it, and the two sources' shared name failed the
    packed-call shape check at launch (no compile needed to see it)."""
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    func = tl_sa.build_kernel(H, D, D**-0.5, True, 32, *fmts, staged=staged)
    bufs = list(func.buffer_map.values())
    assert [b.name for b in bufs] == ["Q", "KV", "Idx", "KV2", "Idx2", "Sink", "Out"]
    widths = {1: MXFP8_E4M3.record_bytes(D), 2: NVFP4_E2M1.record_bytes(D)}
    assert [int(bufs[i].shape[1]) for i in (1, 3)] == [widths[f] for f in fmts]


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
def test_records_supports():
    """supports() takes records only in the two decoded formats, at their record widths, uint8, 16-byte aligned."""
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    q = torch.zeros(2, H, D, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 4, dtype=torch.int64, device="cuda")
    mx = torch.zeros(8, 528, dtype=torch.uint8, device="cuda")
    nv = torch.zeros(8, 288, dtype=torch.uint8, device="cuda")
    assert tl_sa.supports(q, mx, idx, nv, MXFP8_E4M3, NVFP4_E2M1)
    assert tl_sa.supports(q, nv, idx, None, NVFP4_E2M1)
    assert not tl_sa.supports(q, mx, idx, None)  # records without their format
    assert not tl_sa.supports(q, nv, idx, None, MXFP8_E4M3)  # wrong width
    assert not tl_sa.supports(q, mx.view(torch.int8), idx, None, MXFP8_E4M3)  # wrong dtype
    assert not tl_sa.supports(q, torch.zeros(8, 272, dtype=torch.uint8, device="cuda"), idx, None, MXFP4_E2M1)
    shifted = torch.zeros(9 * 528, dtype=torch.uint8, device="cuda")[8 : 8 + 8 * 528].view(8, 528)
    assert not tl_sa.supports(q, shifted, idx, None, MXFP8_E4M3)  # rows not 16-byte aligned


@pytest.mark.skipif(not _sm90(), reason="the TileLang kernel is built for sm_90a")
def test_records_replay_in_a_graph():
    """A CUDA graph capture over record sources replays with new queries, index lists and record contents (the
    records are read in place at replay)."""
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    fmts = (MXFP8_E4M3, NVFP4_E2M1)
    q, kv, idx, kv2, idx2, sink, _, _ = _record_case(96, 96 * 128, 128, 6000, 512, seed=31, fmt1=fmts[0], fmt2=fmts[1])
    tl_sa.sparse_attn(q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2, kv_format=fmts[0], kv2_format=fmts[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = tl_sa.sparse_attn(
            q, kv, idx, sink, D**-0.5, kv2=kv2, indices2=idx2, kv_format=fmts[0], kv2_format=fmts[1]
        )
    new = _record_case(96, 96 * 128, 128, 6000, 512, seed=32, fmt1=fmts[0], fmt2=fmts[1])
    for dst, src in zip((q, kv, idx, kv2, idx2), new[:5], strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _check_records((q, kv, idx, kv2, idx2, sink, new[6], new[7]), *fmts)
    ref = reference.sparse_attn(q, kv, new[6], sink, D**-0.5, kv2, new[7], kv_format=fmts[0], kv2_format=fmts[1])
    _check(out_g, ref)

