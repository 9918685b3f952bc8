"""Offline sm_90a compile of the FP8 linear's "gemv" kernel (`_gemv_linear_kernel`) at decode tiles, without a GPU.

Checks what the design relies on: no MMA; no barrier inside the K loop (a layout conversion of the decoded weight
tile or of the activations goes through shared memory with a bar.sync each iteration; only the final cross-thread
sums after the loop use a few KiB); no register spills at M = 1 (registers are reported). bf16 / fp32 activations, act_quant, the
three prefetch depths."""

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
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.linear import triton as lt


def loop_barriers(kernel, sig, cx, div, num_warps):
    # bar.sync between the K loop's header and its back branch (the compile is a cache hit after rep)
    names = kernel.arg_names
    cx = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | cx  # as a JIT launch
    src = ASTSource(kernel, dict(sig) | {k: "constexpr" for k in cx},
                    constexprs={(names.index(k),): v for k, v in cx.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": 1}).asm["ptx"]
    head = re.search(r"(\$L__BB\d+_\d+):[^\n]*\n?\s*// =>This Inner Loop Header", ptx)
    tail = re.search(r"bra\s+" + re.escape(head.group(1)) + ";", ptx[head.end():])
    body = ptx[head.end():head.end() + tail.start()]
    return body.count("bar.sync")

sig = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
       "stride_ym": "i32", "stride_split": "i32", "k_tiles_per_split": "i32", "group_n": "i32", "stride_xg": "i32"}
div = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "ws_ptr", "stride_xm", "stride_wn", "K", "N", "stride_ym")
out = {}
for name, bm, bn, bk, nw, pf, aq, f32, even in (("m1 bf16", 1, 16, 512, 4, 2, False, False, True),
                                                 ("m1 bf16 act_quant", 1, 16, 512, 4, 2, True, False, True),
                                                 ("m1 bf16 K tail", 1, 16, 512, 4, 2, False, False, False),
                                                 ("m1 fp32", 1, 32, 256, 4, 1, False, True, True),
                                                 ("m8 bf16", 8, 16, 256, 4, 0, False, False, True)):
    s = dict(sig, x_ptr="*fp32", y_ptr="*fp32") if f32 else sig
    cx = dict(B0=32, B1=32, SCALE_E8M0=True, ACT_QUANT=aq, X_KIND=2 if f32 else 0, ASM=True, PREFETCH=pf,
              EVEN_K=even, VEC_K=True, SPLIT_K=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    out[name] = rep(lt._gemv_linear_kernel, s, cx, num_warps=nw, num_stages=1, divisible_by_16=div)
    out[name]["loop_barriers"] = loop_barriers(lt._gemv_linear_kernel, s, cx, div, nw)
print(json.dumps(out))
"""


def test_gemv_kernel_compiles_for_sm90_without_mma_or_shared_tiles():
    report = run_compile_script(_SCRIPT)
    print(report)
    assert len(report) == 5
    for name, r in report.items():
        assert not r["mma"] and not r["wgmma"], (name, r)
        assert r["loop_barriers"] == 0 and r["shared"] <= 4096, (name, r)
        if name.startswith("m1"):
            assert r["stack"] == 0, (name, r)
