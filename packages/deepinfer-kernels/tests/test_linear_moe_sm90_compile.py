"""Offline sm_90a compile of the quantized-weight GEMM kernels (linear: FP8 block-scaled / LM head; moe: FP4
grouped gate-up + down) at their decode configurations, without a GPU. Checks: they compile for Hopper, the bf16
dots use tensor cores, shared memory fits an H200 SM. Spills are reported, not forbidden: BLOCK_M 64 of the FP8
linear and the MoE kernels use all 255 registers (measured on the H200: docs/perf.md)."""

from __future__ import annotations

import importlib.util

import pytest
from kernels_testing import run_compile_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]

_SCRIPT = r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.linear import triton as lt
from deepinfer_kernels.moe import triton as mt

sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
       "stride_ym": "i32", "stride_split": "i32", "k_tiles_per_split": "i32", "group_n": "i32",
       "stride_xg": "i32"}
out = {}
for aq in (False, True):
    out[f"fp8_linear act_quant={aq}"] = rep(lt._linear_kernel, sig, dict(B0=32, B1=32, W_FP8=True, SCALE_E8M0=True,
        ACT_QUANT=aq, DOT=0, EVEN_K=True, SPLIT_K=True, SWAP_AB=aq, MODE=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), num_warps=4,
        num_stages=4)
out["lm_head"] = rep(lt._linear_kernel, dict(sig, w_ptr="*bf16", y_ptr="*fp32"), dict(B0=1, B1=1, W_FP8=False,
    SCALE_E8M0=False, ACT_QUANT=False, DOT=0, EVEN_K=True, SPLIT_K=False, SWAP_AB=False, MODE=0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128),
    num_warps=4, num_stages=4)
g = {"x_ptr": "*bf16", "w1_ptr": "*u8", "w3_ptr": "*u8", "s1_ptr": "*u8", "s3_ptr": "*u8", "pairs_ptr": "*i32",
     "bexp_ptr": "*i32", "h_ptr": "*bf16", "P": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_we": "i32",
     "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_sq": "i32", "stride_h": "i32",
     "limit": "fp32"}
# chunked: the chunked FP4 layout, scales read as 32-bit words
for v, pack, wt, ch in (("asm", 8, "*i32", False), ("bits", 2, "*u8", False), ("asm", 8, "*i32", True)):
    st = "*i32" if ch else "*u8"
    out[f"moe gate_up {v} chunked={ch}"] = rep(mt._gate_up_kernel, dict(g, w1_ptr=wt, w3_ptr=wt, s1_ptr=st, s3_ptr=st),
        dict(TOPK=6, CLAMP=True, DOT_F32=False, VARIANT=v, PACK=pack, EVEN=True, CHUNKED=ch, BLOCK_M=16, BLOCK_N=64,
        BLOCK_K=128), num_warps=4, num_stages=3)
d = {"h_ptr": "*bf16", "w2_ptr": "*u8", "s2_ptr": "*u8", "pairs_ptr": "*i32", "bexp_ptr": "*i32", "rw_ptr": "*fp32",
     "out_ptr": "*fp32", "P": "i32", "N": "i32", "K": "i32", "stride_h": "i32", "stride_we": "i32", "stride_wn": "i32",
     "stride_se": "i32", "stride_sn": "i32", "stride_sq": "i32", "stride_o": "i32"}
for v, pack, wt, ch in (("asm", 8, "*i32", False), ("bits", 2, "*u8", False), ("asm", 8, "*i32", True)):
    out[f"moe down {v} chunked={ch}"] = rep(mt._down_kernel, dict(d, w2_ptr=wt, s2_ptr="*i32" if ch else "*u8"),
        dict(DOT_F32=False, VARIANT=v, PACK=pack, EVEN=True, CHUNKED=ch, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128),
        num_warps=4, num_stages=3)
print(json.dumps(out))
"""


def test_quantized_gemm_kernels_compile_for_sm90():
    report = run_compile_script(_SCRIPT)
    assert len(report) == 9
    for name, r in report.items():
        assert r["mma"] or r["wgmma"], (name, r)  # bf16 tensor-core dots
        assert r["shared"] <= 227 * 1024, (name, r)


_LOAD_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_testing import cuobjdump, sass_loops
from deepinfer_kernels.linear import triton as lt

k = lt._linear_kernel
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
       "stride_ym": "i32", "stride_split": "i32", "k_tiles_per_split": "i32", "group_n": "i32", "stride_xg": "i32"}
# what the JIT assumes at a launch with 16-divisible strides: every argument it specialises is divisible by 16
div = [n for n in sig if (n.endswith("_ptr") or n in ("N", "K") or n.startswith("stride"))
       and n not in k.do_not_specialize]
consts = dict(B0=1, B1=1, W_FP8=False, SCALE_E8M0=False, ACT_QUANT=False, DOT=0, EVEN_K=True, SPLIT_K=False,
              SWAP_AB=False, MODE=0, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)
src = ASTSource(k, dict(sig) | {n: "constexpr" for n in consts},
                constexprs={(k.arg_names.index(n),): v for n, v in consts.items()},
                attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in div})
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
body = [b for b in sass_loops(cuobjdump(c, "-sass")) if any("GMMA" in t for t in b)]
print(json.dumps({"loops": len(body), "sync_loads": sum(1 for b in body for t in b if re.search(r"\bLDG\.", t)),
                  "async_copies": sum(1 for b in body for t in b if "LDGSTS" in t)}))
"""


def test_lm_head_tile_copies_its_activations_asynchronously_on_sm90():
    """The LM head's M = 64 tile (plain bf16 weight, fp32 out) as the JIT compiles it for 16-divisible strides: the
    activation and weight tiles are asynchronous copies, no synchronous global load in the K loop (an unspecialised
    group stride of x made Triton load the activations two bytes at a time inside the loop)."""
    r = run_compile_script(_LOAD_SCRIPT)
    assert r["loops"] >= 1 and r["async_copies"] > 0 and r["sync_loads"] == 0, r
