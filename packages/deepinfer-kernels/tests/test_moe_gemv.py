"""The CUDA-core FP4 expert kernels (variants "gemv" / "gemv_expert", `moe.fp4_gemv`) against the torch reference.
Interpreter: the portable decode and loads (small shapes, d and I multiples of 128, a partial N tile), T = 1, 2, 4
with top-2..6, tokens sharing experts, both weight layouts, with and without the register prefetch, fp32 and bf16
activations, the shared experts' add through `combine_rows`. `gpu`: the PTX path at V4.1 widths.

Tolerances (max |Δ| / max |ref|): fp32 activations 1e-5 (exact fp32 products, only the summation order differs);
bf16 2e-2 (the reference rounds gate/up to bf16 before the SwiGLU; the kernels keep fp32).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.moe import reference
from kernels_testing import triton_interpreter
from moe_testing import quantized_fp4_experts, random_fp4_stack, rel, routing

_MODULES = (
    "deepinfer_kernels.wgmma_frag.triton",
    "deepinfer_kernels.moe.fp4_grouped.triton",
    "deepinfer_kernels.moe.fp4_gemv.triton",
    "deepinfer_kernels.moe.triton",
)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _case(t: int, k: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = routing(t, k, e, g)
    if t > 1:
        ids[1, : k // 2 + 1] = ids[0, : k // 2 + 1]  # tokens 0 and 1 share experts (one run of two slots)
    return w, ids


@needs_triton
def test_gemv_interpreter_matches_reference():
    g = torch.Generator().manual_seed(21)
    e, inter, d = 6, 256, 128
    st = quantized_fp4_experts(e, inter, d, g)
    ck = st.chunked()
    # (T, top-k, variant, block_m (gemv_expert slots), layout, num_stages (2: prefetch)). Gate/up: one N tile of 512
    # rows over I = 256 (partly masked); down: two K tiles of 128 (the prefetch crosses a tile).
    cases = [
        (1, 6, "gemv", 1, ck, 2),
        (2, 3, "gemv_expert", 2, ck, 2),  # the shared experts' two pairs in one program
        (4, 2, "gemv_expert", 1, st, 1),  # block_m 1: an expert's two pairs take two programs
    ]
    with triton_interpreter(*_MODULES) as (_, _, _, mod):
        for t, k, variant, block_m, exp, stages in cases:
            w, ids = _case(t, k, e, g)
            x = torch.randn(t, d, generator=g)
            up = mod.GemmConfig(512, 128, 4, stages, variant)
            down = mod.GemmConfig(128, 128, 2, stages, variant)
            args = (w, ids, exp.w1, exp.w3, exp.w2, exp.s1, exp.s3, exp.s2)
            chunked = exp.fmt == "fp4_chunked"
            name = (t, k, variant, exp.fmt, stages)
            limit = 0.5 if t < 4 else 0.0
            got = mod.moe_experts_fp4(x, *args, limit, configs=(block_m, up, down), chunked=chunked)
            assert rel(got, reference.moe_experts(x, w, ids, st, limit)) <= 1e-5, name
            xb = x.bfloat16()
            sh = torch.randn(t, d, generator=g).bfloat16()
            got = mod.moe_experts_fp4(xb, *args, 0.5, configs=(block_m, up, down), chunked=chunked, shared=sh,
                                      out_dtype=torch.bfloat16)  # fmt: skip
            want = (reference.moe_experts(xb, w, ids, st, 0.5) + sh.float()).bfloat16()
            assert got.dtype == torch.bfloat16 and rel(got, want) <= 2e-2, name


@needs_triton
def test_gemv_configs_validate_and_fall_back():
    g = torch.Generator().manual_seed(22)
    # widths multiples of 32, not of 128: the gemv kernels do not apply
    st = quantized_fp4_experts(3, 64, 96, g)
    x = torch.randn(2, 96, generator=g)
    w, ids = routing(2, 2, 3, g)
    with triton_interpreter(*_MODULES) as (_, _, fv, mod):
        assert not fv.supports(96, 64, st.w1)
        cfg = mod.GemmConfig(64, 128, 4, 1, "gemv")
        got = mod.moe_experts_fp4(
            x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, configs=(1, cfg, cfg)
        )
        assert rel(got, reference.moe_experts(x, w, ids, st, 0.5)) <= 1e-5
        mixed = (1, cfg, mod.GemmConfig(64, 128, 4, 1, "gemv_expert"))
        with pytest.raises(ValueError, match="same variant"):
            mod.moe_experts_fp4(x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, 0.5, configs=mixed)
        # on by default (H200 sweep): only decode pair counts on the chunked layout take it
        assert mod.GEMV_DEFAULT and mod.default_configs(6, False, False, chunked=True)[1].variant == "gemv"
        assert mod.default_configs(6, False, False, chunked=True, gemv=False)[1].variant != "gemv"
        assert mod.default_configs(6, False, False, chunked=False, gemv=True)[1].variant != "gemv"
        big = mod.GEMV_TILES[-1][0] + 1
        assert mod.default_configs(big, False, False, chunked=True, gemv=True)[1].variant != "gemv"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("variant", ["gemv", "gemv_expert"])
def test_gemv_gpu_v41_widths(t, variant):
    from deepinfer_kernels.moe import triton as mt

    g = torch.Generator().manual_seed(t)
    st = random_fp4_stack(16, 2304, 5120, g, "cuda")
    w, ids = _case(t, 6, 16, g)
    w, ids = w.cuda(), ids.cuda()
    x = (torch.randn(t, 5120, generator=g) / 8).cuda()
    ck = st.chunked()
    args = (w, ids, ck.w1, ck.w3, ck.w2, ck.s1, ck.s3, ck.s2, 10.0)
    cfgs = (
        1 if variant == "gemv" else 2,
        mt.GemmConfig(32, 256, 4, 2, variant),
        mt.GemmConfig(64, 256, 4, 2, variant),
    )
    for xt, tol in ((x, 1e-5), (x.bfloat16(), 2e-2), (x.half(), 2e-2)):
        got = mt.moe_experts_fp4(xt, *args, configs=cfgs, chunked=True)
        assert rel(got, reference.moe_experts(xt, w, ids, st, 10.0)) <= tol, xt.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 64])
def test_shared_from_a_side_stream_joins_before_the_combine(t):
    # the shared expert's output written on another stream, slowly (a long matmul chain first): with shared_ready
    # the combine waits for it, so the result equals the one-stream call bit for bit at every T (gemv at T <= 4,
    # the grouped kernels above)
    from deepinfer_kernels.moe import moe_experts

    g = torch.Generator().manual_seed(t)
    st = random_fp4_stack(16, 2304, 5120, g, "cuda")
    w, ids = _case(t, 6, 16, g)
    w, ids = w.cuda(), ids.cuda()
    x = (torch.randn(t, 5120, generator=g) / 8).cuda().bfloat16()
    sh_src = torch.randn(t, 5120, generator=g).cuda().bfloat16()
    ck = st.chunked()
    want = moe_experts(x, w, ids, ck, 10.0, shared=sh_src)
    side = torch.cuda.Stream()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(20):  # keeps the side stream busy well past the routed GEMMs
                busy = (busy @ busy).tanh_()
            shared = sh_src * 1.0  # written only after the chain
            done = torch.cuda.Event()
            done.record(side)
        got = moe_experts(x, w, ids, ck, 10.0, shared=shared, shared_ready=done)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, want)
