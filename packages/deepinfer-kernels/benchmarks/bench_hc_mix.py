"""Microbenchmark: mHC `hc_mix` (Triton) at DeepSeek-V4.1-Flash widths, the two-launch path vs the one-launch
(fused) kernel and its tuning knobs. CUDA only (`--smoke-cpu` runs the same code on the Triton interpreter at a
small width, no timings).

Run from the repo root (about 30-60 s on one H200, mostly Triton compiles):
    PYTHONPATH=packages/deepinfer-kernels/src python3 packages/deepinfer-kernels/benchmarks/bench_hc_mix.py \
        --output-json /tmp/bench_hc_mix.json

Shapes: n = 4 streams, d = 5120, fn [24, 20480] fp32, bf16 streams, T in --tokens (1 8 64 256). Time per call
comes from replaying CUDA graphs of 20 calls each; the calls rotate over enough input copies (fn, base, scale,
streams: a different layer's weights per call, as in a decode step) that one pass moves >= 3x the L2, so fn is
mostly read cold. The bytes bound of a call is (fn + streams + outputs) / the copy bandwidth measured in the same
run (read + write bytes of a large device-to-device copy). Every variant is first checked against the torch
reference (atol 2e-5, rtol 1e-4, the test suite's tolerance) and for bit-identical repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from deepinfer_kernels.device_rates import measure_copy_bandwidth

L2_BYTES = 60 * 2**20
N, D = 4, 5120
M = (2 + N) * N
KW = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)  # V4.1: hc_sinkhorn_iters 20, rms_norm_eps 1e-20
ATOL, RTOL = 2e-5, 1e-4

# name -> keyword arguments of deepinfer_kernels.hyper_conn.triton.hc_mix; "counters": False = none passed (the
# kernel allocates zeroed counters per call)
VARIANTS: dict[str, dict[str, Any]] = {
    "two-launch": {"fused": False},
    "fused": {},
    "fused/no-counters": {"counters": False},
    "fused/s160": {"num_splits": 160},  # one BLOCK_K=128 chunk per program at T=1 (the default caps at 128 splits)
    "products/tok1": {"mode": "products", "block_t": 1},
    "products/tok8": {"mode": "products", "block_t": 8},
    # decode (T = 1) knobs: fewer warps shorten the cross-warp reductions of the serial Sinkhorn finish; fewer,
    # longer splits shorten the finish's partial sum
    "products/w1": {"mode": "products", "block_t": 1, "num_warps": 1},
    "products/w2": {"mode": "products", "block_t": 1, "num_warps": 2},
    "products/w8": {"mode": "products", "block_t": 1, "num_warps": 8},
    "products/s32": {"mode": "products", "block_t": 1, "num_splits": 32},
    "products/s64": {"mode": "products", "block_t": 1, "num_splits": 64},
    "products/s64w2": {"mode": "products", "block_t": 1, "num_splits": 64, "num_warps": 2},
    "products/k256s64": {"mode": "products", "block_t": 1, "block_k": 256, "num_splits": 64},
    "dot/k32": {"mode": "dot"},
    "bf16x3/tok16": {"mode": "bf16x3", "block_t": 16},
    "bf16x3/tok64": {"mode": "bf16x3", "block_t": 64},
}


def _inputs(t: int, sets: int, d: int, dev: torch.device) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(t)
    out = []
    for i in range(sets):
        if i == 0:
            r = torch.randn(t, N, d, generator=g).to(torch.bfloat16)
            fn = torch.randn(M, N * d, generator=g) / (N * d) ** 0.5
            base = torch.randn(M, generator=g) * 0.5
            scale = torch.rand(3, generator=g) + 0.5
            first = [x.to(dev) for x in (r, fn, base, scale)]
            out.append(tuple(first))
        else:  # copies: the same values (one reference check) in other memory
            out.append(tuple(x.clone() for x in first))
    return out


def _check(hc: Any, sets: list[tuple[torch.Tensor, ...]], knobs: dict[str, Any], counters: torch.Tensor | None) -> float:
    from deepinfer_kernels.hyper_conn import reference

    r, fn, base, scale = sets[0]
    out = hc.hc_mix(r, fn, base, scale, counters=counters, **knobs, **KW)
    again = hc.hc_mix(r, fn, base, scale, counters=counters, **knobs, **KW)
    ref = reference.hc_mix(r, fn, base, scale, **KW)
    if not all(torch.equal(a, b) for a, b in zip(out, again)):
        raise AssertionError(f"hc_mix {knobs}: two calls on the same input differ")
    if counters is not None and bool(counters.any()):
        raise AssertionError(f"hc_mix {knobs}: counters not left zero")
    worst = 0.0
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
        worst = max(worst, float((a - b).abs().max()))
    return worst


def _time(hc: Any, sets: list[tuple[torch.Tensor, ...]], knobs: dict[str, Any], counters: torch.Tensor | None,
          calls: int) -> float:
    """Median microseconds per call over replays of graphs of `calls` calls, rotating over all input sets."""
    graphs = []
    for g0 in range(0, len(sets), calls):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                r, fn, base, scale = sets[(g0 + i) % len(sets)]
                hc.hc_mix(r, fn, base, scale, counters=counters, **knobs, **KW)
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for g in graphs:
            g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / (calls * len(graphs)))
    del graphs
    return statistics.median(samples)


def _plan(hc: Any, t: int, d: int, knobs: dict[str, Any], dev: torch.device) -> str:
    if knobs.get("fused", True) is False:
        return "rows+finish" if t <= hc.ROWS_MAX_T else "dot16-k128+finish"
    mode, tok, bk, splits, _ = hc._fused_plan(t, M, N * d, torch.bfloat16, dev, knobs.get("mode"),
                                               knobs.get("num_splits"), knobs.get("block_t"), knobs.get("block_k"))
    return f"{mode} t{tok} k{bk} s{splits}"


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--calls", type=int, default=20, help="hc_mix calls per CUDA graph")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--smoke-cpu", action="store_true", help="Triton interpreter, d = 64, checks only")
    args = ap.parse_args()
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        dev, d = torch.device("cpu"), 64
    elif not torch.cuda.is_available():
        print("bench_hc_mix: needs a CUDA device (or --smoke-cpu)", file=sys.stderr)
        return 2
    else:
        dev, d = torch.device("cuda"), D
    from deepinfer_kernels.hyper_conn import triton as hc

    t_start = time.perf_counter()
    bw = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "copy_bandwidth_Bps": bw,
        "n": N,
        "d": d,
        "calls_per_graph": args.calls,
    }
    if bw is not None:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); {info['device']}")
    print(f"{'T':>4} {'variant':<18} {'plan':<22} {'us/call':>8} {'bound_us':>8} {'%bound':>7} {'x2launch':>8} "
          f"{'max_err':>8}")  # fmt: skip
    rows = []
    for t in args.tokens:
        nbytes = M * N * d * 4 + t * N * d * 2 + t * M * 4  # fn + streams + pre / post / comb
        sets_n = 2 if dev.type != "cuda" else args.calls * max(1, math.ceil(3 * L2_BYTES / (args.calls * nbytes)))
        sets = _inputs(t, sets_n, d, dev)
        base_us = None
        for name in args.variants:
            knobs = dict(VARIANTS[name])
            counters = None
            if knobs.pop("counters", True) is not False:
                counters = torch.zeros(1024, dtype=torch.int32, device=dev)
            err = _check(hc, sets, knobs, counters)
            us = _time(hc, sets, knobs, counters, args.calls) if dev.type == "cuda" else None
            bound = nbytes / bw * 1e6 if bw else None
            if name == "two-launch":
                base_us = us
            row = {"T": t, "variant": name, "knobs": knobs, "plan": _plan(hc, t, d, knobs, dev), "bytes": nbytes,
                   "us_per_call": us, "bound_us": bound, "max_abs_err": err, "input_sets": sets_n}  # fmt: skip
            rows.append(row)
            pct = _fmt(100 * bound / us if us and bound else None, ".1f")
            speed = _fmt(base_us / us if us and base_us else None, ".2f")
            print(f"{t:>4} {name:<18} {row['plan']:<22} {_fmt(us, '.2f'):>8} {_fmt(bound, '.2f'):>8} {pct:>7} "
                  f"{speed:>8} {err:>8.1e}", flush=True)  # fmt: skip
        del sets
    info["wall_s"] = time.perf_counter() - t_start
    print(f"total {info['wall_s']:.1f} s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
