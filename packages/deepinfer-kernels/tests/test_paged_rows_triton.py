"""Triton `paged_rows` (one launch) vs the torch reference: identical int64 rows for one-token and verify steps,
padding sequences, pages missing from a table, entries in progress and entries completed at a page boundary."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.paged_rows import paged_rows, paged_rows_constants, reference
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.paged_rows.triton") as (mod,):
        yield mod


def _case(S: int, ratio: int, page: int, width: int, tokens: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    per_page = page // ratio
    pages = -(-width // per_page) + int(torch.randint(0, 2, (1,), generator=g))
    bt = torch.randperm(S * pages + 7, generator=g)[: S * pages].view(S, pages).clone()
    cut = torch.randint(1, pages + 1, (S,), generator=g)  # each table: a prefix of pages, then -1
    bt[torch.arange(pages)[None, :] >= cut[:, None]] = -1
    # positions within what each table covers: (ctx + n) // ratio entries at most cut * per_page
    top = (cut * per_page * ratio - tokens).clamp(min=0)
    ctx = (torch.rand(S, generator=g) * (top + 1).float()).long()
    lens = torch.randint(1, tokens + 1, (S,), generator=g)
    lens[torch.rand(S, generator=g) < 0.25] = 0  # padding sequences
    return [t.to(device) for t in (bt, ctx, lens)]


CASES = [
    # (sequences, ratio, page size, entry slots, tokens per sequence)
    (1, 4, 128, 256, 1),  # a B = 1 decode step, ratio 4
    (64, 4, 128, 512, 1),
    (3, 128, 128, 16, 1),  # ratio 128: one entry per page
    (9, 4, 64, 100, 6),  # a verify step: K = 2 new entries per sequence
    (5, 2, 16, 37, 3),  # slots not a multiple of the page's entries
    (17, 1, 8, 40, 4),  # ratio 1: every token an entry (K = 4)
    (4, 4, 128, 3000, 1),  # several blocks of slots per sequence
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}r{c[1]}w{c[3]}q{c[4]}")
def test_interpreter_matches_reference(interp, case):
    S, ratio, page, width, tokens = case
    for seed in range(3):
        bt, ctx, lens = _case(S, ratio, page, width, tokens, seed)
        kw = dict(ratio=ratio, page_size=page, width=width, tokens=tokens, scratch_row=99999)
        want = reference.paged_rows(bt, ctx, lens, consts=paged_rows_constants(ratio, page, S, width, tokens, "cpu"),
                                    **kw)
        got = interp.paged_rows(bt, ctx, lens, **kw)
        for a, b in zip(got, want):
            assert a.dtype == torch.int64 and torch.equal(a, b), (case, seed)


def test_reference_rows_by_hand():
    # ratio 2, page 8 (4 entries a page), 6 slots; seq 0 at ctx 9 (+1 token) completes entry 4 (page 7, row 0 =
    # store row 28) and reads 5 entries; seq 1 at ctx 2: entry 1 in progress; seq 2 is padding
    bt, ctx, lens = torch.tensor([[3, 7], [5, -1], [-1, -1]]), torch.tensor([9, 2, 30]), torch.tensor([1, 1, 0])
    read, write, new_w = paged_rows(bt, ctx, lens, ratio=2, page_size=8, width=6, tokens=1, scratch_row=99,
                                    consts=paged_rows_constants(2, 8, 3, 6, 1, "cpu"), backend="torch")
    assert read.view(3, 6).tolist() == [[12, 13, 14, 15, 28, 99], [20, 99, 99, 99, 99, 99], [99] * 6]
    assert write.tolist() == [28, 99, 99] and new_w.tolist() == [4, 1, 15]


def test_dispatcher_checks(interp):
    bt, ctx, lens = _case(4, 4, 64, 40, 2, seed=0)
    consts = paged_rows_constants(4, 64, 4, 40, 2, "cpu")
    kw = dict(ratio=4, page_size=64, width=40, tokens=2, scratch_row=7, consts=consts)
    assert all(torch.equal(a, b) for a, b in zip(paged_rows(bt, ctx, lens, backend="triton", **kw),
                                                  paged_rows(bt, ctx, lens, backend="torch", **kw)))
    with pytest.raises(ValueError, match="has no kernel"):  # int32 tables: the reference only
        paged_rows(bt.int(), ctx, lens, backend="triton", **kw)
    with pytest.raises(ValueError, match="cover fewer"):
        paged_rows(bt[:, :1], ctx, lens, backend="torch", **kw)
    with pytest.raises(ValueError, match=r"\[S, P\]"):
        paged_rows(bt, ctx[:3], lens, backend="torch", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}r{c[1]}w{c[3]}q{c[4]}")
def test_gpu_matches_reference(case):
    S, ratio, page, width, tokens = case
    for seed in range(3):
        bt, ctx, lens = _case(S, ratio, page, width, tokens, seed, device="cuda")
        kw = dict(ratio=ratio, page_size=page, width=width, tokens=tokens, scratch_row=99999,
                  consts=paged_rows_constants(ratio, page, S, width, tokens, "cuda"))
        for a, b in zip(paged_rows(bt, ctx, lens, backend="triton", **kw), paged_rows(bt, ctx, lens, backend="torch",
                                                                                    **kw)):
            assert torch.equal(a, b), (case, seed)


def test_kernel_compiles_for_sm90():
    """The interpreter runs Python semantics the GPU compiler may reject: compile the kernel for sm_90a offline, as
    the engine launches it (one-token steps, K = 1 with KB = 2; verify steps, K = 2)."""
    from kernels_testing import run_compile_script

    report = run_compile_script(r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.paged_rows import triton as pr

sig = {"bt_ptr": "*i64", "ctx_ptr": "*i64", "lens_ptr": "*i64", "read_ptr": "*i64", "write_ptr": "*i64",
       "new_w_ptr": "*i64", "pages": "i32", "width": "i32", "per_page": "i32", "ratio": "i32", "K": "i32",
       "scratch_row": "i32"}
out = {f"block {b} KB {kb}": rep(pr._paged_rows_kernel, sig, {"BLOCK": b, "KB": kb}, num_warps=4)
       for b, kb in ((512, 2), (1024, 2), (16, 4))}
print(json.dumps(out))
""")
    assert len(report) == 3
    for name, r in report.items():
        assert r["stack"] == 0, (name, r)
