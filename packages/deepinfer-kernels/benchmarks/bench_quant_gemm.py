"""Decode-size GEMMs over weights in their checkpoint formats on one CUDA GPU (V4.1-Flash widths).

Prints one JSON object: device, versions, the measured device-to-device copy bandwidth, and per case the kernel
time (triton.testing.do_bench: median, L2 flushed before every call, eager launches included), the time of a torch
bf16 matmul over a bf16 weight of the same shape, and the bytes bound (bytes the kernel must read / copy bandwidth).

    PYTHONPATH=packages/deepinfer-kernels/src python packages/deepinfer-kernels/benchmarks/bench_quant_gemm.py
"""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton
from deepinfer_kernels.device_rates import measure_copy_bandwidth
from deepinfer_kernels.linear import fp8_linear, linear_f32_out
from deepinfer_kernels.moe import StackedExperts, moe_experts
from triton.testing import do_bench

DENSE = {  # name: (N, K, block) - V4.1 attention / shared expert; one V4 shape with 128x128 blocks
    "wq_a": (1280, 5120, (32, 32)),
    "wq_b": (32768, 1280, (32, 32)),
    "wo_b": (5120, 8192, (32, 32)),
    "shared_w1": (2304, 5120, (32, 32)),
    "shared_w2": (5120, 2304, (32, 32)),
    "v4_wo_a": (8192, 4096, (128, 128)),
}


def rand_fp8(n: int, k: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(-126, 127, (n, k), dtype=torch.int8, device="cuda")
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w).view(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (-(-n // block[0]), -(-k // block[1])), dtype=torch.uint8, device="cuda")
    return w, s.view(torch.float8_e8m0fnu)


def bench_dense(bw: float) -> list[dict]:
    out = []
    for name, (n, k, block) in DENSE.items():
        w, s = rand_fp8(n, k, block)
        wb = w.to(torch.bfloat16)
        wbytes = w.numel() + s.numel()
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = do_bench(partial(fp8_linear, x, w, s, block), warmup=10, rep=100)
            ta = do_bench(partial(fp8_linear, x, w, s, block, act_quant=True), warmup=10, rep=100)
            tb = do_bench(partial(F.linear, x, wb), warmup=10, rep=100)
            bound = (wbytes + 2 * m * (k + n)) / bw * 1e3
            out.append({"case": f"fp8_linear {name} [{n}x{k}] block {block[0]}", "M": m, "triton_ms": t,
                        "triton_act_quant_ms": ta, "torch_bf16_ms": tb, "bytes_bound_ms": bound,
                        "fraction_of_bound": bound / t})  # fmt: skip
    return out


def _old_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())  # the previous LM head: converts the weight to fp32 every step


def bench_head(bw: float) -> list[dict]:
    out = []
    w = torch.randn(129280, 5120, device="cuda", dtype=torch.bfloat16)
    for m in (1, 64):
        x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
        t = do_bench(partial(linear_f32_out, x, w), warmup=10, rep=50)
        tb = do_bench(partial(F.linear, x, w), warmup=10, rep=50)
        told = do_bench(partial(_old_head, x, w), warmup=3, rep=20)
        bound = (w.numel() * 2 + m * 5120 * 2 + m * 129280 * 4) / bw * 1e3
        out.append({"case": "lm_head [129280x5120] bf16 -> fp32", "M": m, "triton_ms": t, "torch_bf16_out_ms": tb,
                    "old_fp32_convert_ms": told, "bytes_bound_ms": bound, "fraction_of_bound": bound / t})  # fmt: skip
    return out


def bench_moe(bw: float) -> list[dict]:
    e, d, inter, k = 384, 5120, 2304, 6

    def packed(o, i):
        return torch.randint(-128, 128, (e, o, i // 2), dtype=torch.int8, device="cuda")

    def scale(o, i):
        return torch.randint(122, 126, (e, o, i // 32), dtype=torch.uint8, device="cuda").view(
            torch.float8_e8m0fnu
        )

    st = StackedExperts(packed(inter, d), packed(inter, d), packed(d, inter), scale(inter, d), scale(inter, d),
                        scale(d, inter), fmt="fp4")  # fmt: skip
    per_expert = 3 * inter * d // 2 + 3 * inter * d // 32
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (1, 8, 64, 256):
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, device="cuda")
        hit = int(torch.unique(ids).numel())
        ms = do_bench(partial(moe_experts, x, w, ids, st, 10.0), warmup=10, rep=100)
        bound = hit * per_expert / bw * 1e3
        row = {"case": "moe fp4 grouped (384 experts, d 5120, I 2304, top-6)", "T": t, "experts_hit": hit,
               "triton_ms": ms, "bytes_bound_ms": bound, "fraction_of_bound": bound / ms}  # fmt: skip
        if t in (1, 8):  # the old path's shape: per used expert, bf16 weights, one GEMM triple each
            used = torch.unique(ids).tolist()
            dense = {u: st[u] for u in used}
            dense = {u: tuple(v.to(torch.bfloat16) for v in ws) for u, ws in dense.items()}
            full = [dense.get(i, dense[used[0]]) for i in range(e)]
            from deepinfer_kernels.moe import reference

            row["per_expert_bf16_loop_ms"] = do_bench(
                partial(reference.moe_experts, x, w, ids, full, 10.0), warmup=3, rep=20
            )
        out.append(row)
    return out


def main() -> None:
    bw = measure_copy_bandwidth("cuda")
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_GBps": bw / 1e9,
        "timing": "triton.testing.do_bench median, L2 flushed before each call, eager launches",
        "dense": bench_dense(bw),
        "lm_head": bench_head(bw),
        "moe": bench_moe(bw),
    }
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
