"""Offline sm_90a compile of every Triton kernel at its default V4.1 configuration (no GPU needed).

Runs in a subprocess: the CPU test session imports triton in interpreter mode (conftest.py), and ahead-of-time
compilation needs the compiled (JITFunction) objects. Checks: it compiles for Hopper, the bf16 attention dots
use wgmma and its kv gathers become asynchronous copies, nothing spills to local memory (one measured exception),
shared memory fits an H200 SM.
"""

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
from deepinfer_kernels.sparse_attn import triton as sa
from deepinfer_kernels.hyper_conn import triton as hc
from deepinfer_kernels.norm_rope import triton as rn
from deepinfer_kernels.routing import triton as rt

sa_sig = {n: t for n, t in zip(
    ["q_ptr", "kv_ptr", "idx_ptr", "kv2_ptr", "idx2_ptr", "sink_ptr", "out_ptr", "m_ptr", "l_ptr", "acc_ptr",
     "H", "D", "K", "S_ROWS", "blocks_per_split", "stride_qt", "stride_qh", "stride_kv", "stride_it", "stride_ot",
     "stride_oh", "K1", "S_ROWS2", "stride_kv2", "stride_it2", "qk_scale"],
    ["*bf16", "*bf16", "*i64", "*bf16", "*i64", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32"] + ["i32"] * 15
    + ["fp32"])}
# what the JIT sees at the V4.1 shapes: 16-aligned tensors, D = 512 and row strides multiples of 16
sa_div = tuple(n for n in sa_sig if n.endswith("_ptr")) + (
    "H", "D", "stride_qt", "stride_qh", "stride_kv", "stride_ot", "stride_oh", "stride_kv2")
out = {}
for tier, cfg in (("large", sa.DEFAULT_CONFIG), ("small", sa.SMALL_BATCH_CONFIG)):
    for split in (False, True):
        for two in (False, True):  # one source (window pool) / two sources (window + paged compressed entries)
            out[f"sparse_attn {tier} split={split} two={two}"] = rep(
                sa._sparse_attn_kernel, sa_sig,
                dict(TWO=two, HEAD_BLOCKS=64 // cfg["block_h"], BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"],
                     BLOCK_D=512, SPLIT=split, UPCAST=False, EXACT_F32=False, QK_T=bool(cfg["qk_t"]),
                     DV_SPLIT=cfg["dv_split"], TILE_SRC=two, IDX_AHEAD=bool(cfg["idx_ahead"]), EVEN_D=False),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=sa_div)
# the index-prefetch candidate of the sweep (32-row tiles, 4 stages: 3 gathers in flight), two sources as the engine
out["sparse_attn large prefetch n32 s4"] = rep(
    sa._sparse_attn_kernel, sa_sig,
    dict(TWO=True, HEAD_BLOCKS=1, BLOCK_H=64, BLOCK_N=32, BLOCK_D=512, SPLIT=False, UPCAST=False, EXACT_F32=False,
         QK_T=False, DV_SPLIT=1, TILE_SRC=True, IDX_AHEAD=True, EVEN_D=False),
    num_warps=8, num_stages=4, divisible_by_16=sa_div)
# fp32 inputs (exact dots) take FP32_CONFIG: the bf16 tiles in fp32 need 279 KiB of shared memory
cfg = sa.FP32_CONFIG
out["sparse_attn fp32"] = rep(
    sa._sparse_attn_kernel, {k: ("*fp32" if v == "*bf16" else v) for k, v in sa_sig.items()},
    dict(TWO=False, HEAD_BLOCKS=64 // cfg["block_h"], BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], BLOCK_D=512,
         SPLIT=True, UPCAST=False, EXACT_F32=True, QK_T=False, DV_SPLIT=1, TILE_SRC=False, IDX_AHEAD=False,
         EVEN_D=False),
    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=sa_div)
# kv records read in place (kv_cache_dtype="auto"): MXFP8 window + NVFP4 compressed rows, decoded in the gather
rec_sig = dict(sa_sig, kv_ptr="*u8", kv2_ptr="*u8")
for tier, cfg in (("small", sa.RECORD_SMALL_BATCH_CONFIG), ("default", sa.DEFAULT_CONFIG),
                  ("large", sa.LARGE_BATCH_CONFIG)):
    out[f"sparse_attn records {tier}"] = rep(
        sa._sparse_attn_kernel, rec_sig,
        dict(TWO=True, HEAD_BLOCKS=1, BLOCK_H=64, BLOCK_N=cfg["block_n"], BLOCK_D=512, SPLIT=tier == "small",
             UPCAST=False, EXACT_F32=False, QK_T=False, DV_SPLIT=cfg["dv_split"], TILE_SRC=False,
             IDX_AHEAD=bool(cfg["idx_ahead"]), EVEN_D=True, FMT=1, FMT2=2),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible_by_16=sa_div)
out["sparse_attn combine"] = rep(
    sa._sparse_attn_combine_kernel,
    {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "H": "i32", "D": "i32",
     "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32"},
    dict(BLOCK_S=32, BLOCK_D=512), num_warps=4)
out["hc_mix partial"] = rep(
    hc._hc_mix_partial_kernel,
    {"r_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32", "T": "i32", "KDIM": "i32",
     "chunks_per_split": "i32", "stride_rt": "i32", "stride_fn": "i32"},
    dict(M=24, BLOCK_T=16, BLOCK_M=32, BLOCK_K=128), num_warps=4)
out["hc_mix finish"] = rep(
    hc._hc_mix_finish_kernel,
    {"part_ptr": "*fp32", "sq_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "pre_ptr": "*fp32",
     "post_ptr": "*fp32", "comb_ptr": "*fp32", "T": "i32", "num_splits": "i32", "inv_k": "fp32",
     "rms_eps": "fp32", "hc_eps": "fp32"},
    dict(N=4, ITERS=20, BLOCK_S=64), num_warps=1)
# the fused hc_mix at its default plans: products one token per program (decode), bf16x3 dots of 16 tokens (split)
# and of 64 (unsplit prefill); the products plan of other stream dtypes, groups of 8
for mode, tok, bk, split in ((0, 1, 128, True), (2, 16, 64, True), (2, 64, 64, False), (0, 8, 16, True)):
    out[f"hc_mix fused mode{mode} tok{tok}"] = rep(
        hc._hc_mix_fused_kernel,
        {"r_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32", "cnt_ptr": "*i32",
         "base_ptr": "*fp32", "scale_ptr": "*fp32", "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32",
         "T": "i32", "KDIM": "i32", "chunks_per_split": "i32", "num_splits": "i32", "stride_rt": "i32",
         "stride_fn": "i32", "inv_k": "fp32", "rms_eps": "fp32", "hc_eps": "fp32"},
        dict(M=24, N=4, ITERS=20, MODE=mode, SPLIT=split, TOK=tok, BLOCK_M=32, BLOCK_K=bk,
             SC=max(1, 8192 // (tok * 32)), DOT_F32=False),
        num_warps=4)
out["hc_pre"] = rep(
    hc._hc_pre_kernel, {"r_ptr": "*bf16", "pre_ptr": "*fp32", "x_ptr": "*bf16", "D": "i32"},
    dict(N=4, BLOCK_D=1024), num_warps=4)
out["hc_post"] = rep(
    hc._hc_post_kernel,
    {"y_ptr": "*bf16", "r_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16", "D": "i32"},
    dict(N=4, BLOCK_D=1024), num_warps=4)
out["rms_norm d5120"] = rep(
    rn._rms_norm_kernel,
    {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "R": "i32", "D": "i32", "stride_x": "i32",
     "stride_y": "i32", "eps": "fp32"},
    dict(HAS_W=True, BLOCK_R=1, BLOCK_D=8192), num_warps=8)
out["route_topk e384"] = rep(
    rt._route_topk_kernel,
    {"x_ptr": "*fp32", "bias_ptr": "*fp32", "alt_bias_ptr": "*fp32", "alt_rows_ptr": "*u8", "w_ptr": "*fp32",
     "id_ptr": "*i64", "E": "i32", "stride_x": "i32", "stride_b": "i32", "route_scale": "fp32"},
    dict(K=6, BLOCK_E=512, BLOCK_K=8, SQRTSOFTPLUS=True, HAS_BIAS=True, HAS_ALT=False, RENORM=True), num_warps=2)
# the CUDA-core FP4 expert kernels (moe.fp4_gemv) at their default tiles: one pair a program, bf16, chunked layout
from deepinfer_kernels.moe import triton as mt
from deepinfer_kernels.moe.fp4_gemv import triton as fv
gemv_sig = {"w_ptr": "*i32", "s_ptr": "*i32", "exp_ptr": "*i64", "pairs_ptr": "*i64", "P": "i32", "N": "i32",
            "K": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sq": "i32"}
gemv_div = ("w1_ptr", "w3_ptr", "w2_ptr", "s1_ptr", "s3_ptr", "s2_ptr", "x_ptr", "h_ptr", "out_ptr", "N", "K",
            "stride_x", "stride_h", "stride_o", "stride_we", "stride_wn", "stride_se", "stride_sq")
for name, kern, cfg, extra in (
    ("gate_up", fv._gate_up_gemv_kernel, mt.GEMV_TILES[0][2],
     {"x_ptr": "*bf16", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*i32", "s3_ptr": "*i32", "h_ptr": "*bf16",
      "stride_x": "i32", "stride_h": "i32", "limit": "fp32"}),
    ("down", fv._down_gemv_kernel, mt.GEMV_TILES[0][3],
     {"h_ptr": "*bf16", "w2_ptr": "*i32", "s2_ptr": "*i32", "rw_ptr": "*fp32", "out_ptr": "*fp32",
      "stride_h": "i32", "stride_o": "i32"}),
):
    sig = {k: (gemv_sig | extra)[k] for k in kern.arg_names if k in gemv_sig | extra}
    consts = dict(stride_sn=1, X_KIND=0, ASM=True, CHUNKED=True, PER_PAIR=True, PREFETCH=cfg.num_stages > 1,
                  BLOCK_T=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k) | ({"TOPK": 6, "CLAMP": True} if name == "gate_up" else {})
    out[f"moe gemv {name}"] = rep(kern, sig, consts, num_warps=cfg.num_warps, num_stages=1,
                                  divisible_by_16=tuple(k for k in gemv_div if k in sig))
print(json.dumps(out))
"""


def test_default_configs_compile_for_sm90_without_spills():
    report = run_compile_script(_SCRIPT)
    assert len(report) == 26
    for name, r in report.items():
        # spill bytes: none, except the large-batch sparse attention (a [64, 512] fp32 accumulator in 8 warps):
        # the H200 sweep measured it faster than every spill-free configuration (docs/perf.md); the record tiers
        # add the decode's registers to that accumulator (their configurations are the sweep's fastest too)
        # (the fp32 tier is a correctness path: a few spilled bytes are fine there)
        allowed = 512 if name.startswith("sparse_attn large") else 64 if name == "sparse_attn fp32" else 0
        allowed = 1024 if name.startswith("sparse_attn records") else allowed
        assert r["stack"] <= allowed, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)  # H200: 227 KiB of shared memory per block
    for name in (n for n in report if n.startswith("hc_mix fused mode2")):
        assert report[name]["mma"] or report[name]["wgmma"], report[name]  # bf16x3: tensor-core dots
    for name in (n for n in report if n.startswith("sparse_attn") and "combine" not in n and "fp32" not in n):
        assert report[name]["wgmma"], report[name]  # tensor-core dots, M = 64 heads
        assert report[name]["cp_async"], report[name]  # the kv gather is software-pipelined


_PDL_SCRIPT = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_kernels.linear import triton as lt
from deepinfer_kernels.norm_rope import triton as rn


def ptx(kernel, sig, cx, num_warps, div=(), **opts):
    names = kernel.arg_names
    cx = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | cx  # as a JIT launch
    src = ASTSource(kernel, dict(sig) | {k: "constexpr" for k in cx},
                    constexprs={(names.index(k),): v for k, v in cx.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=1, **opts)).asm["ptx"]


def facts(text):
    # instruction counts before / after the first grid-dependency wait (all "before" when there is none)
    cut = text.find("griddepcontrol.wait")
    pre, post = (text, "") if cut < 0 else (text[:cut], text[cut:])
    out = {"wait": text.count("griddepcontrol.wait"), "trigger": text.count("griddepcontrol.launch_dependents")}
    for key, pat in (("ld_v4", "ld.global.v4"), ("ld_v2", "ld.global.v2"), ("ld_u8", "ld.global.u8"),
                     ("ld", "ld.global"), ("st", "st.global"), ("atom", "atom.global"), ("l2", "prefetch.global.L2")):
        out[key + "_pre"], out[key + "_post"] = pre.count(pat), post.count(pat)
    return out


gemv_sig = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
            "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
            "stride_ym": "i32", "stride_split": "i32", "k_tiles_per_split": "i32", "group_n": "i32",
            "stride_xg": "i32"}
gemv_div = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "ws_ptr", "stride_xm", "stride_wn", "K", "N", "stride_ym")
norm_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "R": "i32", "D": "i32", "stride_x": "i32",
            "stride_y": "i32", "eps": "fp32"}
rope_sig = {"x_ptr": "*bf16", "cos_ptr": "*i64", "sin_ptr": "*fp32", "y_ptr": "*bf16", "w_ptr": "*bf16", "R": "i32",
            "M": "i32", "D": "i32", "stride_x": "i32", "stride_y": "i32", "stride_c": "i32", "eps": "fp32"}
act_sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "K": "i32", "stride_xm": "i32", "stride_ym": "i32"}
out = {}
for pdl in (False, True):
    # wq_a at M = 1 (`_gemv_config`: 16 x 1024 tiles, 8 warps, prefetch 2), split-K so the atomics are there too
    out[f"gemv pdl={pdl}"] = facts(ptx(
        lt._gemv_linear_kernel, gemv_sig,
        dict(B0=32, B1=32, SCALE_E8M0=True, ACT_QUANT=False, X_KIND=0, ASM=True, PREFETCH=2, EVEN_K=True, VEC_K=True,
             SPLIT_K=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024, PDL=pdl), 8, gemv_div, launch_pdl=pdl))
    if pdl:  # the measured knobs: launch_dependents after the K loop, 4 more K tiles prefetched into L2
        gemv_cx = dict(B0=32, B1=32, SCALE_E8M0=True, ACT_QUANT=False, X_KIND=0, ASM=True, PREFETCH=2, EVEN_K=True,
                       VEC_K=True, SPLIT_K=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024, PDL=True, PDL_TRIGGER=1,
                       L2_TILES=4)
        text = ptx(lt._gemv_linear_kernel, gemv_sig, gemv_cx, 8, gemv_div, launch_pdl=True)
        # the K loop is the first loop after the wait (the L2 prefetch loop precedes it); it ends at the branch
        # back to its header label
        wait = text.find("griddepcontrol.wait")
        head = re.compile(r"(\$L__BB\d+_\d+):[^\n]*\n?\s*// =>This Inner Loop Header").search(text, wait)
        back = re.compile(r"bra\s+" + re.escape(head.group(1)) + ";").search(text, head.end())
        out["gemv l2 trigger-after-loop pdl=True"] = dict(
            facts(text), trigger_after_loop=text.find("griddepcontrol.launch_dependents") > back.start())
    out[f"rms_norm pdl={pdl}"] = facts(ptx(
        rn._rms_norm_kernel, norm_sig, dict(HAS_W=True, BLOCK_R=1, BLOCK_D=8192, PDL=pdl), 8, launch_pdl=pdl))
    out[f"act_fake_quant pdl={pdl}"] = facts(ptx(
        lt._act_fake_quant_kernel, act_sig, dict(GROUP=32, GROUPS=128, PDL=pdl), 4, launch_pdl=pdl))
    out[f"rope_at pdl={pdl}"] = facts(ptx(
        rn._rope_kernel, rope_sig, dict(P=32, INVERSE=False, FROM_POS=True, NORM=True, HAS_W=True, BLOCK_R=8,
                                        BLOCK_D=512, BLOCK_P=32, PDL=pdl), 4, launch_pdl=pdl, enable_fp_fusion=False))
print(json.dumps(out))
"""


def test_pdl_kernels_wait_before_reading_activations_and_writing():
    """PDL (docs/pdl.md) on sm_90a: with pdl on, the gemv, RMSNorm, activation-pass and RoPE kernels hold one
    griddepcontrol.wait and one launch_dependents; with pdl off neither. The PTX order is the contract: before the
    wait the gemv issues only its first tile's weight (16-byte) and UE8M0 scale loads, never an activation load
    (its 8-byte vector loads) nor a store or atomic; the RMSNorm only its weight load; the activation pass and the
    RoPE nothing."""
    report = run_compile_script(_PDL_SCRIPT)
    for name, r in report.items():
        on = name.endswith("pdl=True")
        assert (r["wait"], r["trigger"]) == ((1, 1) if on else (0, 0)), (name, r)
        if not on:
            continue
        assert r["st_pre"] == 0 and r["atom_pre"] == 0 and r["st_post"] > 0, (name, r)
        if name.startswith("gemv"):
            assert r["l2_post"] == 0 and (r["l2_pre"] > 0) == ("l2" in name), (name, r)  # L2 prefetch before only
            assert r.get("trigger_after_loop", True), (name, r)
            assert r["ld_v4_pre"] > 0 and r["ld_u8_pre"] > 0, (name, r)  # weight words and scales of tile 0
            assert r["ld_v2_pre"] == 0 and r["ld_v2_post"] > 0, (name, r)  # activations only after the wait
            assert r["ld_pre"] == r["ld_v4_pre"] + r["ld_u8_pre"], (name, r)
            assert r["atom_post"] > 0, (name, r)
        elif name.startswith("rms_norm"):
            assert 0 < r["ld_pre"] == r["ld_post"], (name, r)  # the weight row before, the x row (same shape) after
        else:
            assert r["ld_pre"] == 0 and r["ld_post"] > 0, (name, r)
