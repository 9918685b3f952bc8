"""Offline sm_90a compile of the "frag" FP8 linear (`linear.fp8_frag`), without a GPU. What the kernel is for, checked
in the compiled code of its K loops: the decoded codes feed wgmma from registers (no layout conversion of the
decoded tile, no shared-memory store inside a loop), the activation tile is copied asynchronously in 16-byte
vectors (its alignment is specialised), nothing spills inside a loop, wgmmas issue in groups, and the fast loop
costs fewer instructions per weight than the exact one."""

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
from deepinfer_kernels.linear.fp8_frag import triton as ff

sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
       "stride_ym": "i32", "stride_split": "i32", "k_tiles_per_split": "i32", "group_n": "i32", "stride_xg": "i32"}
div = tuple(k for k in sig if k.endswith("_ptr") or k in ("N", "K") or k.startswith("stride"))
names = ff._frag_linear_kernel.arg_names
out = {}
for bm, bn, bk, warps, stages in ((64, 64, 128, 4, 3), (16, 64, 128, 4, 4), (64, 128, 128, 8, 3)):
    for fast in (True, False):
        consts = dict(B0=32, B1=32, DECODE="asm", FAST=fast, SPLIT_K=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        src = ASTSource(ff._frag_linear_kernel, dict(sig) | {k: "constexpr" for k in consts},
                        constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        sass, usage = cuobjdump(c, "-sass"), cuobjdump(c, "--dump-resource-usage")
        body = [b for b in loops(sass) if any("HGMMA" in t for t in b)]  # the K loops (not the split-K sum)
        ttgir = c.asm["ttgir"]
        out[f"{bm}x{bn}x{bk} w{warps} s{stages} fast={fast}"] = {
            "loop_instrs_per_weight": [round(len(b) / (bn * bk / (32 * warps)), 2) for b in body],
            "loop_sts": sum(1 for b in body for t in b if re.search(r"\bSTS\b", t)),
            "loop_local_mem": sum(1 for b in body for t in b if re.search(r"\b(?:STL|LDL)\b", t)),
            "loop_hgmma": sum(1 for b in body for t in b if "HGMMA" in t),
            "loop_wgmma_groups": sum(1 for b in body for t in b if "WARPGROUP.ARRIVE" in t),
            "loop_cp_async_128": sum(1 for b in body for t in b if "LDGSTS.E.BYPASS.128" in t),
            "decoded_tile_converts": len(re.findall(rf"convert_layout [^\n]*tensor<{bn}x{bk}xbf16", ttgir)),
            "decoded_tile_to_smem": len(re.findall(rf"local_alloc %a\S* : \(tensor<{bn}x{bk}xbf16", ttgir)),
            "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        }
print(json.dumps(out))
"""


def test_frag_kernel_feeds_wgmma_from_registers_on_sm90():
    report = run_compile_script(_SCRIPT)
    assert len(report) == 6
    for name, r in report.items():
        assert r["decoded_tile_converts"] == 0 and r["decoded_tile_to_smem"] == 0, (name, r)
        assert r["loop_sts"] == 0 and r["loop_local_mem"] == 0, (name, r)
        assert r["loop_hgmma"] > 0 and r["loop_cp_async_128"] > 0, (name, r)
        # ptxas serialises every wgmma (one per group) when a loop's zero-trip path zeroes the accumulator
        assert r["loop_hgmma"] >= 2 * r["loop_wgmma_groups"], (name, r)
        fast = "fast=True" in name
        # the fast kernel holds two K loops: the fast one, then the exact redo of a tile with large scale codes
        assert len(r["loop_instrs_per_weight"]) == (2 if fast else 1), (name, r)
    for tile in ("64x64x128 w4 s3", "16x64x128 w4 s4", "64x128x128 w8 s3"):
        fast, exact = report[f"{tile} fast=True"], report[f"{tile} fast=False"]
        assert fast["loop_instrs_per_weight"][0] < exact["loop_instrs_per_weight"][0], tile
