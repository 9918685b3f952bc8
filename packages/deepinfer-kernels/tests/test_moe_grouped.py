"""The per-scale-group FP4 expert kernels (variants "grouped" / "grouped_bits", `moe.fp4_grouped`) against the torch
reference. Interpreter: the portable decode with the same tiling, column permutation and permuted h (small shapes,
d and I multiples of 128, one partial N tile). `gpu`: the PTX decode at V4.1 widths and an exactness check over
every code and scale codes up to 250.

Tolerances (max |Δ| / max |ref|): fp32 activations 1e-5 (exact fp32 dots, only the summation order differs);
bf16 2e-2 (the reference rounds gate/up and h to bf16 differently; the kernel keeps fp32 accumulators).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.moe import reference
from kernels_testing import triton_interpreter
from moe_testing import column_probe, quantized_fp4_experts, random_fp4_stack, rel

_MODULES = ("deepinfer_kernels.wgmma_frag.triton", "deepinfer_kernels.moe.fp4_grouped.triton",
            "deepinfer_kernels.moe.triton")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
def test_permute_columns_is_the_dot_order():
    from deepinfer_kernels.moe.fp4_grouped.triton import permute_columns

    x = torch.arange(2 * 64).view(2, 64)
    p = permute_columns(x)
    for pos in range(64):
        q = pos % 32
        s, h, c, j = q // 16, (q // 8) % 2, (q // 2) % 4, q % 2
        assert torch.equal(p[:, pos], x[:, pos - q + 8 * c + 4 * j + 2 * h + s])


@needs_triton
def test_grouped_bits_interpreter_matches_reference():
    g = torch.Generator().manual_seed(11)
    e, inter, d, t, k = 4, 384, 256, 3, 2
    st = quantized_fp4_experts(e, inter, d, g)
    x = torch.randn(t, d, generator=g)
    w = torch.rand(t, k, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[1] = ids[0]  # two tokens share their experts
    with triton_interpreter(*_MODULES) as (_, _, mod):
        # gate/up: one partial N tile (384 = 256 + 128 rows); down: two K chunks of 128 per iteration
        cfgs = (
            16,
            mod.GemmConfig(256, 128, 4, 1, "grouped_bits"),
            mod.GemmConfig(128, 256, 4, 1, "grouped_bits"),
        )
        for limit in (0.0, 0.5):
            got = mod.moe_experts_fp4(
                x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, limit, configs=cfgs
            )
            assert rel(got, reference.moe_experts(x, w, ids, st, limit)) <= 1e-5, limit
        xb = x.bfloat16()
        got = mod.moe_experts_fp4(xb, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, configs=cfgs)
        assert rel(got, reference.moe_experts(xb, w, ids, st, 0.5)) <= 2e-2
        # a grouped down kernel needs the permuted h, which only the grouped gate/up kernel writes
        mixed = (16, mod.GemmConfig(16, 32, 4, 1, "bits"), cfgs[2])
        with pytest.raises(ValueError, match="h_perm needs a grouped config"):
            mod.moe_experts_fp4(x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, configs=mixed)


@needs_triton
def test_grouped_configs_fall_back_when_widths_are_not_multiples_of_128():
    g = torch.Generator().manual_seed(12)
    st = quantized_fp4_experts(3, 64, 96, g)  # I 64, d 96: multiples of 32 (FP4 groups), not of 128 (scale words)
    x = torch.randn(2, 96, generator=g)
    w = torch.rand(2, 2, generator=g)
    ids = torch.tensor([[0, 2], [1, 2]])
    with triton_interpreter(*_MODULES) as (_, fg, mod):
        assert not fg.supports(96, 64, st.w1) and fg.supports(128, 256, st.w1)
        cfg = mod.GemmConfig(64, 128, 4, 1, "grouped_bits")
        got = mod.moe_experts_fp4(
            x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, configs=(16, cfg, cfg)
        )
        assert rel(got, reference.moe_experts(x, w, ids, st, 0.5)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 256, 1024])  # 1024: BLOCK_M 64 (P >= 4096)
def test_grouped_gpu_v41_widths(t):
    """The grouped defaults (`default_configs(grouped=True)`, the configs the engine would run) against the
    reference: fp32 activations take the portable decode (exact fp32 dots), bf16 the fast PTX decode."""
    from deepinfer_kernels.moe import triton as mt

    g = torch.Generator().manual_seed(100 + t)
    st = random_fp4_stack(32, 2304, 5120, g, "cuda")
    x = (torch.randn(t, 5120, generator=g) / 8).cuda()
    w = torch.rand(t, 6, generator=g).cuda()
    ids = torch.stack([torch.randperm(32, generator=g)[:6] for _ in range(t)]).cuda()
    # below GROUPED_MIN_PAIRS the engine runs the tile kernels; the grouped ones are still checked at T = 1 here
    cfgs = mt.default_configs(max(t * 6, mt.GROUPED_MIN_PAIRS), False, False, grouped=True)
    assert cfgs[1].variant == cfgs[2].variant == "grouped"
    assert cfgs[0] == mt.default_configs(t * 6, False, False, grouped=True)[0]
    args = (w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 10.0)
    got = mt.moe_experts_fp4(x, *args, configs=cfgs)
    assert rel(got, reference.moe_experts(x, w, ids, st, 10.0)) <= 1e-5
    xb = x.bfloat16()
    got = mt.moe_experts_fp4(xb, *args, configs=cfgs)
    assert rel(got, reference.moe_experts(xb, w, ids, st, 10.0)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("codes", [(0, 1, 20, 100, 118, 126, 127), (20, 100, 118, 127, 128, 129, 200, 250)])
def test_grouped_ptx_decode_is_exact_for_every_code(codes):
    """One-hot activations (routing weight 1) make each down-projection output row one weight column: the PTX
    decode of the grouped kernels reproduces every dequantized weight bit for bit. Codes < 128 stay on the fast
    decode; the second set puts codes >= 128 in every tile, which the fast kernel redoes with the exact decode."""
    from deepinfer_kernels.moe import triton as mt
    from deepinfer_kernels.moe.fp4_grouped.triton import permute_columns
    from deepinfer_kernels.quant.reference import dequant_fp4

    g = torch.Generator().manual_seed(8)
    e, d, inter = 2, 64, 256
    w2 = torch.randint(-128, 128, (e, d, inter // 2), generator=g, dtype=torch.int8).cuda()
    table = torch.tensor(codes, dtype=torch.uint8)
    s2 = (
        table[torch.randint(0, len(table), (e, d, inter // 32), generator=g)]
        .view(torch.float8_e8m0fnu)
        .cuda()
    )
    tok, pairs, bexp, h, rows, ones = column_probe(e, d, inter, "cuda")  # token t reads one column of expert t % e
    want = torch.stack([dequant_fp4(w2[i].cpu(), s2[i].cpu(), block=32) for i in range(e)])
    for cfg in (
        mt.GemmConfig(64, 128, 4, 4, "grouped"),
        mt.GemmConfig(64, 256, 4, 3, "grouped"),
        mt.GemmConfig(64, 256, 4, 3, "grouped_exact"),
    ):
        rows.fill_(float("nan"))
        mt.launch_down(permute_columns(h), w2, s2, pairs, bexp, ones, rows, 16, cfg, False)
        assert torch.equal(rows.cpu(), want[tok % e, :, (tok // e) % inter]), cfg
