"""Offline sm_90a compile of the per-scale-group FP4 expert kernels (variant "grouped", `moe.fp4_grouped`), without a
GPU. What the variant is for, checked in the compiled code of its K loops: the decoded weights feed wgmma from
registers with no layout conversion (no `convert_layout`, no shared-memory store and no barrier inside a loop),
the weight and scale tiles are pipelined by asynchronous copies, nothing spills to local memory, and the fast loop spends fewer
instructions per weight than the exact one (one bf16x2 multiply per pair instead of two). On the chunked layout
(`moe.fp4_layout`) the weights are copied 16 bytes a lane (no 8-byte copies) and read back from shared memory as
16-byte vectors (no ldmatrix). Every loop issues its wgmmas in groups (ptxas did not serialise them)."""

from __future__ import annotations

import importlib.util

import pytest
from kernels_testing import run_compile_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]

_SCRIPT = r"""
import json, re
from kernels_testing import cuobjdump, sass_loops as loops
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_kernels.moe.fp4_grouped import triton as fg

def compile_sm90(kernel, sig, consts, div16, num_warps, num_stages, **options):
    names = kernel.arg_names
    full = dict(sig) | {k: "constexpr" for k in consts}
    src = ASTSource(kernel, full, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})

def report(c, weights_per_thread):
    sass, usage = cuobjdump(c, "-sass"), cuobjdump(c, "--dump-resource-usage")
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    body = loops(sass)
    ttgir = c.asm["ttgir"]
    loop_ir = ttgir[ttgir.index("scf.for"):]
    return {"regs": int(regs), "stack": int(stack), "shared": int(c.metadata.shared),
            "loop_instrs_per_weight": [round(len(b) / weights_per_thread, 2) for b in body],
            "loop_bar_sync": sum(1 for b in body for t in b if "BAR.SYNC" in t),
            "loop_sts": sum(1 for b in body for t in b if re.search(r"\bSTS\b", t)),
            "local_mem": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
            "loop_hgmma": sum(1 for b in body for t in b if "HGMMA" in t),
            "loop_cp_async": sum(1 for b in body for t in b if "LDGSTS" in t),
            "loop_cp_async_8b": sum(1 for b in body for t in b if "LDGSTS.E.64" in t),
            "loop_lds_128": sum(1 for b in body for t in b if "LDS.128" in t),
            "loop_ldsm": sum(1 for b in body for t in b if "LDSM" in t),
            "loop_local_mem": sum(1 for b in body for t in b if re.search(r"\b(?:STL|LDL)\b", t)),
            "loop_wgmma_groups": sum(1 for b in body for t in b if "WARPGROUP.ARRIVE" in t),
            "converts_after_loop_start": loop_ir.count("ttg.convert_layout"),
            "stores_after_loop_start": loop_ir.count("ttg.local_store") + loop_ir.count("tt.store")}

up_sig = {"x_ptr": "*bf16", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*i32", "s3_ptr": "*i32",
          "pairs_ptr": "*i32", "bexp_ptr": "*i32", "h_ptr": "*bf16", "P": "i32", "N": "i32", "K": "i32",
          "stride_x": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
          "stride_sq": "i32", "stride_h": "i32", "limit": "fp32"}
down_sig = {"h_ptr": "*bf16", "w2_ptr": "*i32", "s2_ptr": "*i32", "pairs_ptr": "*i32", "bexp_ptr": "*i32",
            "rw_ptr": "*fp32", "out_ptr": "*fp32", "P": "i32", "N": "i32", "K": "i32", "stride_h": "i32",
            "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_sq": "i32",
            "stride_o": "i32"}
out = {}
for chunked in (False, True):
    # the JIT specialises a unit stride to a constant: the row stride of chunked scales, the chunk stride otherwise
    one = "stride_sn" if chunked else "stride_sq"
    up = {k: v for k, v in up_sig.items() if k != one}
    down = {k: v for k, v in down_sig.items() if k != one}
    div = lambda sig: tuple(k for k in sig if k.endswith("_ptr") or k in ("N", "K") or k.startswith("stride"))
    for fast in (True, False):
        c = compile_sm90(fg._gate_up_grouped_kernel, up, {one: 1} | dict(TOPK=6, CLAMP=True, DECODE="asm", FAST=fast,
                         H_PERM=True, CHUNKED=chunked, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), div(up), 4, 4)
        out[f"gate_up 64x128 chunked={chunked} fast={fast}"] = report(c, 64 * 128 * 2 / 128)
        c = compile_sm90(fg._down_grouped_kernel, down, {one: 1} | dict(DECODE="asm", FAST=fast, CHUNKED=chunked,
                         BLOCK_M=16, BLOCK_N=64, BLOCK_K=256), div(down), 4, 3)
        out[f"down 64x256 chunked={chunked} fast={fast}"] = report(c, 64 * 256 / 128)
# the sweep's register-capped chunked gate/up (GemmConfig.max_regs = 128: 4 CTAs per SM instead of 3)
c = compile_sm90(fg._gate_up_grouped_kernel, up, {one: 1} | dict(TOPK=6, CLAMP=True, DECODE="asm", FAST=True,
                 H_PERM=True, CHUNKED=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), div(up), 4, 4, maxnreg=128)
capped = report(c, 64 * 128 * 2 / 128)
print(json.dumps({"kernels": out, "capped": capped}))
"""


def test_grouped_kernels_feed_wgmma_from_registers_on_sm90():
    both = run_compile_script(_SCRIPT)
    report, capped = both["kernels"], both["capped"]
    # spills of the capped kernel stay outside its loops
    assert capped["regs"] <= 128 and capped["loop_local_mem"] == 0, capped
    assert len(report) == 8
    for name, r in report.items():
        fast = "fast=True" in name
        # ptxas serialises every wgmma of a kernel (C7515: one wgmma per group, each waited for) when a loop's
        # zero-trip path zeroes the accumulators after the loop; the kernels assume K > 0 to keep the groups
        assert r["loop_hgmma"] >= 4 * r["loop_wgmma_groups"], (name, r)
        if "chunked=True" in name:
            assert r["loop_cp_async_8b"] == 0 and r["loop_lds_128"] > 0 and r["loop_ldsm"] == 0, (name, r)
        # no spill: no local-memory access at all (triton 3.9 reserves an unused 8-byte stack frame for the fast
        # gate/up kernel, so the frame size alone is not the test)
        assert r["local_mem"] == 0 and r["stack"] <= 16, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)
        # the fast kernels hold two loops (fast, then the exact redo of a tile with a scale code >= 128)
        assert len(r["loop_instrs_per_weight"]) == (2 if fast else 1), (name, r)
        assert r["loop_hgmma"] > 0 and r["loop_cp_async"] > 0, (name, r)
        # no layout conversion of the decoded tile: the only convert is the epilogue's (h / rows store)
        assert r["converts_after_loop_start"] <= 1, (name, r)
        assert r["loop_bar_sync"] <= 2 * len(r["loop_instrs_per_weight"]) and r["loop_sts"] == 0, (name, r)
        if fast:
            fast_loop, exact_loop = r["loop_instrs_per_weight"]
            assert fast_loop < exact_loop, (name, r)
