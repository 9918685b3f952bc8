"""Offline sm_90a compile of the small decode-step kernels (greedy argmax stages, the MoE permutation, RoPE, KV
records, the FP8 linears' activation quantization and weight decode), without a
GPU. The CPU interpreter runs Python semantics that the compiler rejects (a kernel reading a plain module global
passed every interpreter test and failed to compile on the H200); compiling for Hopper here catches that class."""

from __future__ import annotations

import importlib.util

import pytest
from kernels_testing import run_compile_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.moe import triton as mt
from deepinfer_kernels.sampling import triton as st

out = {}
for dt, block in (("*fp32", 4096), ("*bf16", 32)):
    out[f"argmax chunks {dt} {block}"] = rep(st._chunk_max_kernel, {"x_ptr": dt, "val_ptr": "*fp32", "idx_ptr": "*i32",
        "nan_ptr": "*i32", "V": "i32", "C": "i32", "stride_x": "i32"}, {"BLOCK": block}, num_warps=8)
for use in (True, False):
    out[f"argmax combine {use}"] = rep(st._combine_kernel, {"val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32",
        "out_ptr": "*i64", "C": "i32", "invalid": "i32"}, {"USE_INVALID": use, "BLOCK_C": 32}, num_warps=1)
# the inverse-CDF draws (drafts: fp32 logits; verification: fp32 weights, bf16 logits for the logsumexp)
for dt in ("*fp32", "*bf16"):
    out[f"draw weight sums {dt}"] = rep(st._weight_sums_kernel, {"w_ptr": dt, "sum_ptr": "*fp32", "V": "i32",
        "C": "i32", "stride_w": "i32"}, {"BLOCK": 4096}, num_warps=8)
    out[f"draw softmax stats {dt}"] = rep(st._softmax_stats_kernel, {"x_ptr": dt, "t_ptr": "*fp32",
        "max_ptr": "*fp32", "arg_ptr": "*i32", "sum_ptr": "*fp32", "V": "i32", "C": "i32", "stride_x": "i32"},
        {"BLOCK": 4096, "DRAW": True}, num_warps=8)
out["draw lse stats *bf16"] = rep(st._softmax_stats_kernel, {"x_ptr": "*bf16", "t_ptr": "*fp32", "max_ptr": "*fp32",
    "arg_ptr": "*fp32", "sum_ptr": "*fp32", "V": "i32", "C": "i32", "stride_x": "i32"}, {"BLOCK": 4096, "DRAW": False},
    num_warps=4)
_res = {"x_ptr": "*bf16", "rows_ptr": "*i64", "t_ptr": "*fp32", "lse_ptr": "*fp32", "q_ptr": "*fp32", "pos_ptr": "*i64",
        "rej_ptr": "*i8", "alpha": "fp32", "V": "i32", "C": "i32", "stride_x": "i32", "stride_qb": "i32",
        "stride_qn": "i32"}
out["residual sums"] = rep(st._residual_sums_kernel, {**_res, "psum_ptr": "*fp32", "rsum_ptr": "*fp32"},
    {"BLOCK": 4096, "HAS_Q": True}, num_warps=8)
out["residual pick"] = rep(st._residual_pick_kernel, {**_res, "u_ptr": "*fp32", "psum_ptr": "*fp32",
    "rsum_ptr": "*fp32", "out_ptr": "*i64"}, {"BLOCK": 4096, "BLOCK_C": 32, "HAS_Q": True}, num_warps=8)
out["draw weight pick"] = rep(st._weight_pick_kernel, {"w_ptr": "*fp32", "u_ptr": "*fp32", "sum_ptr": "*fp32",
    "out_ptr": "*i64", "V": "i32", "C": "i32", "stride_w": "i32"}, {"BLOCK": 4096, "BLOCK_C": 32}, num_warps=8)
out["draw softmax pick"] = rep(st._softmax_pick_kernel, {"x_ptr": "*fp32", "t_ptr": "*fp32", "u_ptr": "*fp32",
    "max_ptr": "*fp32", "arg_ptr": "*i32", "sum_ptr": "*fp32", "tok_ptr": "*i64", "best_ptr": "*i64",
    "stat_ptr": "*fp32", "V": "i32", "C": "i32", "stride_x": "i32"}, {"BLOCK": 4096, "BLOCK_C": 32},
    num_warps=8)
out["draw softmax probs"] = rep(st._softmax_probs_kernel, {"x_ptr": "*fp32", "t_ptr": "*fp32", "stat_ptr": "*fp32",
    "best_ptr": "*i64", "out_ptr": "*fp32", "V": "i32", "stride_x": "i32", "stride_o": "i32"}, {"BLOCK": 4096},
    num_warps=8)
out["draw lse combine"] = rep(st._lse_combine_kernel, {"t_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
    "out_ptr": "*fp32", "C": "i32"}, {"BLOCK_C": 32}, num_warps=1)
out["align pairs"] = rep(mt._align_pairs_kernel, {"ids_ptr": "*i64", "pairs_ptr": "*i32", "bexp_ptr": "*i32",
    "scratch_ptr": "*i32", "P": "i32", "E": "i32", "NB": "i32"}, {"BLOCK_M": 16, "BLOCK_P": 512, "BLOCK_E": 512,
    "LOG_E": 9, "BLOCK_B": 256}, num_warps=4)
from deepinfer_kernels.norm_rope import triton as rn
# cos/sin tables; positions + freqs with the angles computed in the kernel; the same with the row's RMSNorm first
for from_pos, norm in ((False, False), (True, False), (True, True)):
    out[f"rope from_pos={from_pos} norm={norm}"] = rep(rn._rope_kernel, {"x_ptr": "*bf16",
        "cos_ptr": "*i64" if from_pos else "*fp32", "sin_ptr": "*fp32", "y_ptr": "*bf16", "w_ptr": "*bf16",
        "R": "i32", "M": "i32", "D": "i32", "stride_x": "i32", "stride_y": "i32", "stride_c": "i32", "eps": "fp32"},
        {"P": 32, "INVERSE": False, "FROM_POS": from_pos, "NORM": norm, "HAS_W": norm, "BLOCK_R": 8, "BLOCK_D": 512,
        "BLOCK_P": 32}, num_warps=4)
from deepinfer_kernels.kv_records import triton as kr
# the deployed KV records of a decode step: window rows (MXFP8, 512), compressed entries (NVFP4, 512), indexer
# keys (MXFP4, 128) encoded; indexer queries rounded (MXFP4, 128, bf16 values)
for name, dim, block, e4m3, ue8m0, fake in (("mxfp8 512", 512, 32, True, True, False),
                                            ("nvfp4 512", 512, 16, False, False, False),
                                            ("mxfp4 128", 128, 32, False, True, False),
                                            ("mxfp4 128 fake", 128, 32, False, True, True)):
    out[f"kv records {name}"] = rep(kr._records_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16" if fake else "*u8",
        "rows": "i32", "stride_x": "i32", "stride_o": "i32", "amax_floor": "fp32", "inv6": "fp32"},
        {"DIM": dim, "BLOCK": block, "E4M3": e4m3, "UE8M0": ue8m0, "FAKE": fake, "R": 2048 // dim}, num_warps=4,
        divisible_by_16=("x_ptr", "out_ptr"))
out["kv records decode mxfp4 128"] = rep(kr._decode_kernel, {"rec_ptr": "*u8", "out_ptr": "*bf16", "rows": "i32",
    "stride_r": "i32", "stride_o": "i32"}, {"DIM": 128, "BLOCK": 32, "E4M3": False, "UE8M0": True, "R": 16},
    num_warps=4, divisible_by_16=("rec_ptr", "out_ptr"))
from deepinfer_kernels.linear import triton as lt
# the FP8 linears' one-pass activation quantization, and the weight decode of their "dense" (prefill) mode
for dt, group in (("*bf16", 32), ("*fp32", 128)):
    out[f"act fake quant {dt} {group}"] = rep(lt._act_fake_quant_kernel, {"x_ptr": dt, "y_ptr": dt, "K": "i32",
        "stride_xm": "i32", "stride_ym": "i32"}, {"GROUP": group, "GROUPS": 4096 // group}, num_warps=4)
import triton.language as tl
for out_dtype, yt in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
    out[f"dequant fp8 {yt}"] = rep(lt._dequant_fp8_kernel, {"w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": yt,
        "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_yn": "i32"}, {"B0": 32, "B1": 32,
        "SCALE_E8M0": True, "OUT": out_dtype, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4)
print(json.dumps(out))
"""


def test_small_decode_kernels_compile_for_sm90():
    report = run_compile_script(_SCRIPT)
    assert len(report) == 28
    for name, r in report.items():
        assert r["stack"] <= 64 and r["shared"] <= 227 * 1024, (name, r)  # align pairs keeps 8 bytes on the stack


def test_no_kernel_reads_a_plain_module_global():
    """Every name a @triton.jit function of the package reads from its module is a tl.constexpr, a module, a
    dtype or a function: the GPU compiler rejects any other global (the interpreter does not)."""
    import ast
    import inspect
    import pkgutil

    import deepinfer_kernels
    import triton.language as tl

    found = []
    for info in pkgutil.walk_packages(deepinfer_kernels.__path__, "deepinfer_kernels."):
        if not info.name.endswith(".triton"):
            continue
        mod = importlib.import_module(info.name)
        for node in ast.parse(inspect.getsource(mod)).body:
            if not isinstance(node, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = {a.arg for a in node.args.args}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in args:
                    v = getattr(mod, sub.id, None)
                    ok = v is None or isinstance(v, (tl.constexpr, tl.dtype)) or inspect.ismodule(v) or callable(v)
                    if not ok:
                        found.append(f"{info.name}.{node.name} reads {sub.id} ({type(v).__name__})")
    assert not found, found
