"""Stacked FP4 experts: the reference (per-call exact decode of the used experts) equals the per-expert float
reference bit for bit; the Triton W4A16 grouped path (device permutation, fused clamped SwiGLU, weighted combine)
matches it. Interpreter at tiny shapes; `gpu` at V4.1 widths (d 5120, I 2304, top-6; 32 experts to keep the test
small, random codes and scales).

Tolerances (max |Δ| / max |ref|): fp32 1e-5 (exact fp32 dots; the reference sums a token's k rows in expert
order, the kernel in slot order); bf16 2e-2 (the kernel keeps gate/up and the down projection in fp32, the
reference rounds them to bf16). The routed combine (`combine_rows`: k-row sum + shared add + cast in one launch)
against `reference.combine_rows`: fp32 1e-6 relative (the k-sum's order), bf16 exact up to one bf16 ULP where the
fp32 sums differ in their last bit across a rounding midpoint.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.moe import StackedExperts, moe_experts, reference
from deepinfer_kernels.quant import quant_fp4
from kernels_testing import triton_interpreter
from moe_testing import column_probe, random_fp4_stack, rel, routing


def _fp4_experts(e: int, inter: int, d: int, g: torch.Generator) -> tuple[StackedExperts, list]:
    dense, packed = [], {"w1": [], "w3": [], "w2": [], "s1": [], "s3": [], "s2": []}
    for _ in range(e):
        ws = []
        for w, s, shape in (("w1", "s1", (inter, d)), ("w3", "s3", (inter, d)), ("w2", "s2", (d, inter))):
            q, sc = quant_fp4(torch.randn(*shape, generator=g) / shape[1] ** 0.5)
            packed[w].append(q)
            packed[s].append(sc)
            ws.append(q)
        dense.append(ws)
    st = StackedExperts(*(torch.stack(packed[k]) for k in ("w1", "w3", "w2", "s1", "s3", "s2")), fmt="fp4")
    return st, [st[i] for i in range(e)]


def test_stacked_reference_equals_per_expert_reference():
    g = torch.Generator().manual_seed(0)
    st, per = _fp4_experts(4, 32, 64, g)
    x = torch.randn(5, 64, generator=g)
    w, ids = routing(5, 2, 4, g)
    assert torch.equal(
        moe_experts(x, w, ids, st, 3.0, backend="torch"), reference.moe_experts(x, w, ids, per, 3.0)
    )
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        moe_experts(x, w, ids + 4, st, 3.0, backend="torch")


def test_stacked_experts_validate_shapes():
    with pytest.raises(ValueError, match="fmt"):
        StackedExperts(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 8, 4), fmt="int3")
    with pytest.raises(ValueError, match="scales exactly when quantized"):
        StackedExperts(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 8, 4), fmt="fp4")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_align_pairs_kernel_equals_the_torch_permutation():
    # the single-program kernel (decode sizes) and the torch form (prefill sizes) give identical tensors: pairs
    # sorted by expert and stable within one, runs padded to block_m with P, every row block's expert or -1
    g = torch.Generator().manual_seed(3)
    cases = [(1, 6, 384, 16), (7, 6, 384, 16), (64, 6, 384, 16), (3, 2, 4, 16), (5, 8, 256, 64), (40, 2, 3, 4)]
    with triton_interpreter("deepinfer_kernels.moe.triton") as (mod,):
        for t, k, e, bm in cases:
            ids = torch.randint(0, e, (t, k), generator=g)
            if t > 4:
                ids[: t // 2] = ids[0]  # crowd a few experts: runs longer than one block
            got = mod.align_pairs(ids, e, bm, use_kernel=True)
            want = mod.align_pairs(ids, e, bm, use_kernel=False)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (t, k, e, bm)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fp4_grouped_interpreter():
    g = torch.Generator().manual_seed(1)
    st, _ = _fp4_experts(4, 32, 64, g)
    x = torch.randn(3, 64, generator=g)
    w, ids = routing(3, 2, 4, g)
    ids[1] = ids[0]  # two tokens share their experts (rows of one block)
    with triton_interpreter("deepinfer_kernels.moe.triton") as (mod,):
        pairs, bexp = mod.align_pairs(ids, 4, 16)
        assert pairs.shape == (16 * bexp.numel(),) and bexp.numel() == 1 + 4
        used = sorted(set(ids.flatten().tolist()))
        assert sorted(bexp[bexp >= 0].tolist()) == used  # one block per used expert here
        for limit in (0.0, 0.5):
            got = mod.moe_experts_fp4(x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, limit)
            assert rel(got, reference.moe_experts(x, w, ids, st, limit)) <= 1e-5, limit
        xb = x.bfloat16()
        got = mod.moe_experts_fp4(xb, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5)
        assert rel(got, reference.moe_experts(xb, w, ids, st, 0.5)) <= 2e-2
        assert mod.moe_experts_fp4(
            x[:0], w[:0], ids[:0], st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5
        ).shape == (0, 64)
        # with the shared experts' output: (routed + shared) in x's dtype, as the reference computes it
        sh = torch.randn(3, 64, generator=g).bfloat16()
        got = mod.moe_experts_fp4(xb, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, shared=sh,
                                  out_dtype=torch.bfloat16)  # fmt: skip
        want = (reference.moe_experts(xb, w, ids, st, 0.5) + sh.float()).bfloat16()
        assert got.dtype == torch.bfloat16 and rel(got, want) <= 2e-2


def _combine_case(t: int, k: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t * k, d, generator=g), torch.randn(t, d, generator=g)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("t,k,d", [(1, 6, 640), (3, 2, 64), (5, 1, 100), (0, 6, 64)], ids=str)
def test_combine_rows_interpreter_matches_reference(t, k, d):
    rows, shared = _combine_case(t, k, d, t * 100 + k)
    with triton_interpreter("deepinfer_kernels.moe.triton") as (mod,):
        got = mod.combine_rows(rows, k)
        want = reference.combine_rows(rows, k)
        assert got.dtype == torch.float32 and got.shape == (t, d)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for sh, dt in ((shared, torch.float32), (shared.bfloat16(), torch.bfloat16), (shared[:, :], torch.float16)):
            got = mod.combine_rows(rows, k, sh, dt)
            want = reference.combine_rows(rows, k, sh, dt)
            assert got.dtype == dt and got.shape == (t, d)
            torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1e-6 if dt == torch.float32
                                       else 2.0**-7)  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_moe_experts_dispatcher_adds_shared():
    g = torch.Generator().manual_seed(5)
    st, _ = _fp4_experts(4, 32, 64, g)
    x = torch.randn(3, 64, generator=g).bfloat16()
    w, ids = routing(3, 2, 4, g)
    sh = torch.randn(3, 64, generator=g).bfloat16()
    want = (reference.moe_experts(x, w, ids, st, 0.5) + sh).bfloat16()
    got = moe_experts(x, w, ids, st, 0.5, shared=sh, backend="torch")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # the reference: the former caller's expression
    with pytest.raises(ValueError, match="shared"):
        moe_experts(x, w, ids, st, 0.5, shared=sh[:2], backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 256])
def test_fp4_grouped_gpu_v41_widths(t):
    g = torch.Generator().manual_seed(t)
    st = random_fp4_stack(32, 2304, 5120, g, "cuda")
    x = (torch.randn(t, 5120, generator=g) / 8).cuda()
    w, ids = routing(t, 6, 32, g)
    w, ids = w.cuda(), ids.cuda()
    want = reference.moe_experts(x, w, ids, st, 10.0)
    got = moe_experts(x, w, ids, st, 10.0, backend="triton")
    assert rel(got, want) <= 1e-5
    gotb = moe_experts(x.bfloat16(), w, ids, st, 10.0, backend="triton")
    assert rel(gotb, reference.moe_experts(x.bfloat16(), w, ids, st, 10.0)) <= 2e-2
    sh = (torch.randn(t, 5120, generator=g) / 8).cuda().bfloat16()
    got_sh = moe_experts(x.bfloat16(), w, ids, st, 10.0, shared=sh, backend="triton")
    assert got_sh.dtype == torch.bfloat16 and rel(got_sh, (gotb + sh.float()).bfloat16()) <= 2.0**-7


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_combine_rows_gpu_matches_reference(t):
    from deepinfer_kernels.moe import triton as mt

    rows, shared = (a.cuda() for a in _combine_case(t, 6, 5120, t))
    torch.testing.assert_close(mt.combine_rows(rows, 6), reference.combine_rows(rows, 6), atol=1e-6, rtol=1e-6)
    got = mt.combine_rows(rows, 6, shared.bfloat16(), torch.bfloat16)
    want = reference.combine_rows(rows, 6, shared.bfloat16(), torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2.0**-7)


@pytest.mark.gpu
def test_fp4_asm_decode_is_exact_for_every_code():
    """The PTX decode ("asm") reproduces the exact dequantized weight for all 16 codes and scale codes up to 250:
    one-hot activations with routing weight 1 make each down-projection output row one weight column."""
    from deepinfer_kernels.moe import triton as mt
    from deepinfer_kernels.quant.reference import dequant_fp4

    g = torch.Generator().manual_seed(7)
    e, d, inter = 2, 64, 256
    w2 = torch.randint(-128, 128, (e, d, inter // 2), generator=g, dtype=torch.int8).cuda()
    codes = torch.tensor([20, 100, 118, 127, 128, 129, 200, 250], dtype=torch.uint8)
    s2 = (
        codes[torch.randint(0, len(codes), (e, d, inter // 32), generator=g)]
        .view(torch.float8_e8m0fnu)
        .cuda()
    )
    tok, pairs, bexp, h, rows, ones = column_probe(e, d, inter, "cuda")  # token t reads one column of expert t % e
    mt.launch_down(h, w2, s2, pairs, bexp, ones, rows, 16, mt.GemmConfig(64, 128, 4, 3, "asm"), False)
    want = torch.stack([dequant_fp4(w2[i].cpu(), s2[i].cpu(), block=32) for i in range(e)])  # [e, d, inter]
    assert torch.equal(rows.cpu(), want[tok % e, :, (tok // e) % inter])


@pytest.mark.gpu
def test_align_pairs_kernel_equals_the_torch_permutation_on_gpu():
    from deepinfer_kernels.moe import triton as mt

    g = torch.Generator().manual_seed(4)
    for t, bm in ((1, 16), (8, 16), (64, 16), (300, 16), (341, 64)):  # up to P = 2046, the kernel's limit
        ids = torch.randint(0, 384, (t, 6), generator=g)
        ids[: t // 3] = ids[0]
        got = mt.align_pairs(ids.cuda(), 384, bm, use_kernel=True)
        want = mt.align_pairs(ids.cuda(), 384, bm, use_kernel=False)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (t, bm)
