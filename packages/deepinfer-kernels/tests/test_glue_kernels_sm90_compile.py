"""Offline sm_90a compile of the decode-step glue kernels (MoE combine, ring pool, ratio-2 pooling at plan rows,
FP8 Engram row lookup, routing with the alternative-bias rows), without a GPU: the CPU interpreter accepts Python
that the GPU compiler rejects, so each kernel is compiled for Hopper here with the launch constants it gets at
V4.1 widths (d 5120, head_dim 512, 384 experts top-6, Engram head_dim 256 assumed)."""

from __future__ import annotations

import importlib.util

import pytest
from kernels_testing import run_compile_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.moe import triton as mt
from deepinfer_kernels.ring_pool import triton as rp
from deepinfer_kernels.compressor import triton as ct
from deepinfer_kernels.engram import triton as et
from deepinfer_kernels.routing import triton as rt

out = {}
out["combine"] = rep(mt._combine_kernel, {"rows_ptr": "*fp32", "shared_ptr": "*bf16", "out_ptr": "*bf16", "D": "i32",
    "stride_s": "i32", "stride_o": "i32"}, {"K": 6, "HAS_SHARED": True, "BLOCK": 512}, num_warps=4,
    divisible_by_16=("D", "stride_s", "stride_o"))
# a bf16 ring fed fp32 rows too (the GPU test's third case): the kernel's branches must not merge mixed dtypes
for dt, ft, block in (("*bf16", "*bf16", 512), ("*fp32", "*fp32", 1024), ("*bf16", "*fp32", 64)):
    out[f"ring pool {dt} {ft}"] = rep(rp._ring_pool_kernel, {"flat_ptr": dt, "hist_ptr": "*i64", "fresh_ptr": ft,
        "dst_ptr": "*i64", "src_ptr": "*i64", "pool_ptr": ft, "H": "i32", "T": "i32", "W": "i32", "skip": "i32"},
        {"BLOCK": block}, num_warps=4, divisible_by_16=("W",))
out["pool at rows"] = rep(ct._pool_at_rows_kernel, {"pool_ptr": "*fp32", "rows_ptr": "*i64", "out_ptr": "*bf16",
    "C": "i32"}, {"K": 2, "BLOCK_K": 2, "BLOCK_C": 256}, num_warps=2, divisible_by_16=("C",))
out["lookup rows"] = rep(et._lookup_rows_kernel, {"w_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i64",
    "out_ptr": "*bf16", "D": "i32", "SG": "i32"}, {"GROUP": 32, "BLOCK_D": 256}, num_warps=2,
    divisible_by_16=("D",))
out["route alt bias"] = rep(rt._route_topk_kernel, {"x_ptr": "*fp32", "bias_ptr": "*fp32", "alt_bias_ptr": "*fp32",
    "alt_rows_ptr": "*u8", "w_ptr": "*fp32", "id_ptr": "*i64", "E": "i32", "stride_x": "i32", "stride_b": "i32",
    "route_scale": "fp32"}, {"K": 6, "BLOCK_E": 512, "BLOCK_K": 8, "SQRTSOFTPLUS": True, "HAS_BIAS": True,
    "HAS_ALT": True, "RENORM": True}, num_warps=2)
print(json.dumps(out))
"""


def test_glue_kernels_compile_for_sm90():
    report = run_compile_script(_SCRIPT)
    assert len(report) == 7
    for name, r in report.items():
        assert r["stack"] == 0 and r["shared"] <= 227 * 1024, (name, r)  # no spills in these elementwise kernels
