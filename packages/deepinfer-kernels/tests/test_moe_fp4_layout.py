"""The chunked layout of FP4 experts (`moe.fp4_layout`, fmt "fp4_chunked"): the byte permutation itself, its exact
decode by the reference, and the Triton kernels on it against the reference. Interpreter: the portable decodes
("bits" tiles, "grouped_bits") at small shapes with d and I multiples of 128. `gpu`: the PTX decodes ("asm" tiles,
"grouped") at V4.1 widths and an exactness check over every code.

Tolerances (max |Δ| / max |ref|), as the checkpoint-layout tests: fp32 activations 1e-5 (exact fp32 dots, only the
summation order differs); bf16 2e-2 (the reference rounds gate/up and h to bf16, the kernels keep fp32).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.moe import StackedExperts, moe_experts, reference
from deepinfer_kernels.moe.fp4_layout import (
    chunk_codes,
    chunk_codes_,
    chunk_scales,
    chunk_scales_,
    unchunk_codes,
    unchunk_scales,
)
from kernels_testing import triton_interpreter
from moe_testing import column_probe, quantized_fp4_experts, random_fp4_stack, rel, routing

_MODULES = ("deepinfer_kernels.wgmma_frag.triton", "deepinfer_kernels.moe.fp4_grouped.triton",
            "deepinfer_kernels.moe.triton")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_chunked_positions_and_round_trip():
    g = torch.Generator().manual_seed(0)
    e, n, k = 3, 5, 256
    w = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int8)
    s = torch.randint(0, 256, (e, n, k // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    cw, cs = chunk_codes(w), chunk_scales(s)
    assert cw.shape == w.shape and cw.dtype == w.dtype and cs.shape == s.shape and cs.dtype == s.dtype
    words, cwords = w.view(torch.int32), cw.view(torch.int32)  # [e, n, k/8]
    for q in range(k // 128):
        for grp in range(4):
            for c in range(4):  # word c of group grp moves to position 4c + grp of its chunk
                assert torch.equal(cwords[:, :, 16 * q + 4 * c + grp], words[:, :, 16 * q + 4 * grp + c])
    sw, csw = s.view(torch.uint8).view(torch.int32), cs.view(torch.uint8).view(torch.int32)  # [e, n, k/128]
    flat = csw.reshape(e, -1)
    for q in range(k // 128):
        for r in range(n):  # scale word (row r, chunk q) at q * N + r of its matrix
            assert torch.equal(flat[:, q * n + r], sw[:, r, q])
    assert torch.equal(unchunk_codes(cw), w) and torch.equal(
        unchunk_scales(cs).view(torch.uint8), s.view(torch.uint8)
    )
    w2, s2 = w.clone(), s.clone()
    assert chunk_codes_(w2) is w2 and chunk_scales_(s2) is s2
    assert torch.equal(w2, cw) and torch.equal(s2.view(torch.uint8), cs.view(torch.uint8))


def test_chunked_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        chunk_codes(torch.zeros(4, 48, dtype=torch.int8))  # K = 96
    with pytest.raises(ValueError, match="one byte each"):
        chunk_scales(torch.zeros(4, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        chunk_codes(torch.zeros(64, 4, dtype=torch.int8).t())
    st = quantized_fp4_experts(2, 64, 96, torch.Generator().manual_seed(1))  # d = 96: no whole chunks
    with pytest.raises(ValueError, match="multiples of 128"):
        StackedExperts(st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, fmt="fp4_chunked")
    with pytest.raises(ValueError, match="expected 'fp4'"):
        StackedExperts(st.w1, st.w3, st.w2, fmt="dense").chunked()


def test_chunked_reference_decodes_the_exact_weights():
    g = torch.Generator().manual_seed(2)
    st = quantized_fp4_experts(3, 128, 256, g)
    ch = st.chunked()
    assert ch.fmt == "fp4_chunked" and ch.w1.shape == st.w1.shape and ch.s2.shape == st.s2.shape
    assert not torch.equal(ch.w1, st.w1)  # the bytes did move
    for e in range(3):
        for a, b in zip(ch[e], st[e], strict=True):
            assert torch.equal(a, b)
    x = torch.randn(4, 256, generator=g)
    w, ids = routing(4, 2, 3, g)
    assert torch.equal(
        moe_experts(x, w, ids, ch, 3.0, backend="torch"), moe_experts(x, w, ids, st, 3.0, backend="torch")
    )


@needs_triton
def test_chunked_interpreter_matches_reference():
    """Both kernel families on the chunked layout: the "bits" tiles (two chunks per K tile, a partial N tile) and
    the grouped kernels ("grouped_bits", two chunks per iteration), fp32 and bf16 activations (the defaults:
    `test_dispatcher_routes_chunked_experts_to_the_kernels`)."""
    g = torch.Generator().manual_seed(3)
    e, inter, d, t, k = 4, 384, 256, 3, 2
    st = quantized_fp4_experts(e, inter, d, g)
    ch = st.chunked()
    x = torch.randn(t, d, generator=g)
    w, ids = routing(t, k, e, g)
    ids[1] = ids[0]  # two tokens share their experts
    args = (ch.w1, ch.w3, ch.w2, ch.s1, ch.s3, ch.s2)
    with triton_interpreter(*_MODULES) as (_, _, mod):
        tiles = (16, mod.GemmConfig(256, 256, 4, 1, "bits"), mod.GemmConfig(128, 256, 4, 1, "bits"))
        grouped = (
            16,
            mod.GemmConfig(256, 128, 4, 1, "grouped_bits"),
            mod.GemmConfig(128, 256, 4, 1, "grouped_bits"),
        )
        for cfgs, limit in ((tiles, 0.5), (grouped, 0.0)):
            got = mod.moe_experts_fp4(x, w, ids, *args, limit, configs=cfgs, chunked=True)
            assert rel(got, reference.moe_experts(x, w, ids, st, limit)) <= 1e-5, (cfgs, limit)
            xb = x.bfloat16()
            got = mod.moe_experts_fp4(xb, w, ids, *args, 0.5, configs=cfgs, chunked=True)
            assert rel(got, reference.moe_experts(xb, w, ids, st, 0.5)) <= 2e-2, cfgs
        with pytest.raises(ValueError, match="multiple of 128"):
            small = (16, mod.GemmConfig(16, 32, 4, 1, "bits"), mod.GemmConfig(16, 32, 4, 1, "bits"))
            mod.moe_experts_fp4(x, w, ids, *args, 0.5, configs=small, chunked=True)


@needs_triton
def test_dispatcher_routes_chunked_experts_to_the_kernels():
    g = torch.Generator().manual_seed(4)
    st = quantized_fp4_experts(3, 128, 128, g)
    ch = st.chunked()
    x = torch.randn(2, 128, generator=g)
    w, ids = routing(2, 2, 3, g)
    with triton_interpreter(*_MODULES):
        got = moe_experts(x, w, ids, ch, 0.5, backend="triton")
    assert rel(got, reference.moe_experts(x, w, ids, st, 0.5)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_chunked_gpu_v41_widths(t):
    """V4.1 widths (d 5120, I 2304, top-6; 32 experts): the chunked layout through the dispatcher's defaults and
    through each kernel family explicitly (tile "asm" and "grouped" at every T), bf16 activations, and fp32 through
    the defaults, against the reference of the checkpoint-layout experts."""
    from deepinfer_kernels.moe import triton as mt

    g = torch.Generator().manual_seed(200 + t)
    st = random_fp4_stack(32, 2304, 5120, g, "cuda")
    ch = st.chunked()
    x = (torch.randn(t, 5120, generator=g) / 8).cuda()
    w, ids = routing(t, 6, 32, g)
    w, ids = w.cuda(), ids.cuda()
    xb = x.bfloat16()
    want_b = reference.moe_experts(xb, w, ids, st, 10.0)
    assert rel(moe_experts(xb, w, ids, ch, 10.0, backend="triton"), want_b) <= 2e-2
    assert (
        rel(moe_experts(x, w, ids, ch, 10.0, backend="triton"), reference.moe_experts(x, w, ids, st, 10.0))
        <= 1e-5
    )
    block_m = mt.default_configs(t * 6, False, False)[0]
    tile = mt.default_configs(t * 6, False, False, grouped=False, chunked=True, gemv=False)
    grouped = mt.default_configs(max(t * 6, mt.GROUPED_MIN_PAIRS), False, False, grouped=True, chunked=True)
    for cfgs in (tile, (block_m, *grouped[1:])):
        got = mt.moe_experts_fp4(
            xb, w, ids, ch.w1, ch.w3, ch.w2, ch.s1, ch.s3, ch.s2, 10.0, configs=cfgs, chunked=True
        )
        assert rel(got, want_b) <= 2e-2, cfgs


@pytest.mark.gpu
@pytest.mark.parametrize("codes", [(0, 1, 20, 100, 118, 126, 127), (20, 100, 118, 127, 128, 129, 200, 250)])
def test_chunked_ptx_decode_is_exact_for_every_code(codes):
    """One-hot activations (routing weight 1) make each down-projection output row one weight column: the PTX
    decodes on the chunked layout (tile "asm", "grouped" fast with its exact redo, "grouped_exact") reproduce every
    dequantized weight bit for bit."""
    from deepinfer_kernels.moe import triton as mt
    from deepinfer_kernels.moe.fp4_grouped.triton import permute_columns
    from deepinfer_kernels.quant.reference import dequant_fp4

    g = torch.Generator().manual_seed(9)
    e, d, inter = 2, 64, 256
    w2 = torch.randint(-128, 128, (e, d, inter // 2), generator=g, dtype=torch.int8)
    table = torch.tensor(codes, dtype=torch.uint8)
    s2 = table[torch.randint(0, len(table), (e, d, inter // 32), generator=g)].view(torch.float8_e8m0fnu)
    want = torch.stack([dequant_fp4(w2[i], s2[i], block=32) for i in range(e)])
    cw2, cs2 = chunk_codes(w2).cuda(), chunk_scales(s2).cuda()
    tok, pairs, bexp, h, rows, ones = column_probe(e, d, inter, "cuda")  # token t reads one column of expert t % e
    for cfg in (
        mt.GemmConfig(64, 128, 4, 3, "asm"),
        mt.GemmConfig(128, 256, 8, 3, "asm"),
        mt.GemmConfig(64, 128, 4, 4, "grouped"),
        mt.GemmConfig(64, 256, 4, 3, "grouped"),
        mt.GemmConfig(64, 256, 4, 3, "grouped_exact"),
    ):
        rows.fill_(float("nan"))
        hin = permute_columns(h) if cfg.variant.startswith("grouped") else h
        mt.launch_down(hin, cw2, cs2, pairs, bexp, ones, rows, 16, cfg, False, chunked=True)
        assert torch.equal(rows.cpu(), want[tok % e, :, (tok // e) % inter]), cfg
