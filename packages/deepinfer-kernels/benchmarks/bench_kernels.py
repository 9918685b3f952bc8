"""Microbenchmark: Triton kernels vs their torch references at DeepSeek-V4.1-Flash decode shapes (CUDA only).

Run from the repo root:
    PYTHONPATH=packages/deepinfer-kernels/src python3 packages/deepinfer-kernels/benchmarks/bench_kernels.py \
        --output-json /tmp/bench_kernels.json

Per op and batch it prints one row per backend: device time per call from CUDA-graph replay (launch gaps
removed; the eager per-call wall time is shown beside it), achieved GB/s and TFLOP/s for the bytes/FLOPs the op
must move/do, and % of the H200 roofline max(bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s) (datasheet HBM, measured
bf16 dense rate; docs/kernels.md §6.2). Inputs rotate over several sets so repeated calls do not run out of the 60 MB
L2 (decode reads each layer's KV and weights cold). Every triton result is checked against the reference first.
`--sweep` (default on) also times a few sparse-attention launch configurations (block_h, block_n, num_warps)
within `--sweep-budget-s`; `--smoke-cpu` runs the script on CPU through the Triton interpreter (no timings).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

HBM_BPS = 4.8e12  # H200 datasheet (the copy bandwidth measured on our H200 is 4.1-4.3 TB/s: docs/perf.md)
PEAK_FLOPS = 790e12  # H200 dense bf16 measured 769-798 TFLOP/s
L2_BYTES = 60 * 2**20
V41 = {"heads": 64, "head_dim": 512, "window": 128, "topk": 512, "hc_mult": 4, "hidden": 5120, "experts": 384}


def _sets_for(bytes_per_call: float, cap: int, dev: torch.device) -> int:
    """Input sets to rotate so one pass over them moves >= 3x L2 (cold-cache timing); 2 in the CPU smoke run."""
    if dev.type != "cuda":
        return 2
    return max(2, min(cap, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1.0))))


def _time_graph(calls: list[Callable[[], Any]], reps: int = 3, trials: int = 5) -> float:
    """Median microseconds per call, from replays of one CUDA graph that runs every call once."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    del graph
    return statistics.median(samples)


def _time_eager(calls: list[Callable[[], Any]], dev: torch.device, trials: int = 3) -> float:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for c in calls[:2]:
        c()
    sync()
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for c in calls:
            c()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(samples)


def _err(out: Any, ref: Any) -> float:
    """max over outputs of ||out - ref|| / ||ref|| (fp64)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for a, b in zip(outs, refs):
        a, b = a.double(), b.double()
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    return worst


def _record(
    rows, op, backend, shape, config, nbytes, flops, calls, err, base_us=None, *, dev
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "op": op,
        "backend": backend,
        "shape": shape,
        "config": config,
        "bytes": nbytes,
        "flops": flops,
        "rel_err": err,
    }
    try:
        row["time_us"] = _time_graph(calls) if dev.type == "cuda" else None
    except Exception as exc:  # graph capture can fail for a reference op; keep the eager number
        row["time_us"] = None
        row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["eager_us"] = _time_eager(calls, dev)
    t = row["time_us"] or row["eager_us"]
    row["gbps"] = nbytes / (t * 1e-6) / 1e9
    row["tflops"] = flops / (t * 1e-6) / 1e12
    roof_us = max(nbytes / HBM_BPS, flops / PEAK_FLOPS) * 1e6
    row["roofline_us"] = roof_us
    row["pct_roofline"] = 100.0 * roof_us / t
    if base_us is not None:
        row["speedup_vs_torch"] = base_us / t
    rows.append(row)
    _print_row(row)
    return row


def _print_header() -> None:
    print(
        f"{'op':<12} {'backend':<8} {'shape':<34} {'config':<18} {'us':>9} {'eager_us':>9} {'GB/s':>8} "
        f"{'TFLOP/s':>8} {'%roof':>6} {'xtorch':>7} {'rel_err':>8}"
    )


def _print_row(r: dict[str, Any]) -> None:
    us = f"{r['time_us']:.2f}" if r["time_us"] is not None else "n/a"
    sp = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else ""
    err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else ""
    print(
        f"{r['op']:<12} {r['backend']:<8} {r['shape']:<34} {r['config']:<18} {us:>9} {r['eager_us']:>9.2f} "
        f"{r['gbps']:>8.1f} {r['tflops']:>8.2f} {r['pct_roofline']:>6.1f} {sp:>7} {err:>8}",
        flush=True,
    )


# ------------------------------------------------------------------------------------------------- ops
def bench_sparse_attn(rows, batches, sweep, deadline, dev) -> None:
    from deepinfer_kernels.sparse_attn import reference
    from deepinfer_kernels.sparse_attn import triton as tk

    h, d, w, k = V41["heads"], V41["head_dim"], V41["window"], V41["topk"]
    n_idx = w + k
    # 256 MiB of bf16 kv rows (windows + compressed entries of many sequences); small in the CPU smoke run
    pool_rows = 262144 if dev.type == "cuda" else 2048
    g = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(pool_rows, d, device=dev, generator=g).to(torch.bfloat16)
    sink = torch.randn(h, device=dev, generator=g)
    scale = d**-0.5
    for t in batches:
        nbytes = float(t * n_idx * d * 2 + 2 * t * h * d * 2 + t * n_idx * 8)
        flops = 4.0 * t * h * n_idx * d
        sets = _sets_for(t * n_idx * d * 2, 256 if t < 8 else 32, dev)
        q = torch.randn(t, h, d, device=dev, generator=g).to(torch.bfloat16)
        idx_sets = []
        for _ in range(sets):  # window: 128 consecutive rows; top-k: 512 distinct sorted rows
            start = torch.randint(0, pool_rows - w, (t, 1), device=dev, generator=g)
            win = start + torch.arange(w, device=dev)[None, :]
            top = torch.randint(0, pool_rows, (t, k), device=dev, generator=g).sort(-1).values
            idx_sets.append(torch.cat([win, top], 1).contiguous())
        shape = f"T={t} H={h} D={d} K={n_idx}"
        ref_calls = [lambda i=i, q=q: reference.sparse_attn(q, kv, i, sink, scale) for i in idx_sets]
        base = _record(rows, "sparse_attn", "torch", shape, "", nbytes, flops, ref_calls, None, dev=dev)[
            "time_us"
        ]
        configs: list[dict] = [{}]  # the kernel's own per-T choice (DEFAULT_CONFIG / SMALL_BATCH_CONFIG)
        if sweep and t in (1, 64, 256) and dev.type == "cuda":
            configs += [  # sm_90 resource use from an offline compile (triton 3.9): regs / spill bytes
                {"block_h": 16, "block_n": 32, "num_warps": 8, "num_stages": 2},  # 153 regs, no spill
                {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2},  # 241 regs, no spill
                {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2},  # 225 regs, no spill
                {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 3},  # 167 regs, no spill
                # wgmma; 255 regs, ~0.5 KB spill
                {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
            ]
        # split-K counts at small batch (default: enough splits to fill 2x the SMs)
        if sweep and t in (1, 8) and dev.type == "cuda":
            configs += [{"num_splits": ns} for ns in (2, 5, 10)]
        ref_out = reference.sparse_attn(q, kv, idx_sets[0], sink, scale)
        for ci, cfg in enumerate(configs):
            if ci > 0 and time.time() > deadline:
                print(f"# sweep cut short by --sweep-budget-s at T={t}", flush=True)
                break
            label = (
                f"h{cfg['block_h']} n{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
                if "block_h" in cfg
                else "default"
            )
            if "num_splits" in cfg:
                label += f" k{cfg['num_splits']}"
            try:
                err = _err(tk.sparse_attn(q, kv, idx_sets[0], sink, scale, **cfg), ref_out)
                calls = [
                    lambda i=i, q=q, cfg=cfg: tk.sparse_attn(q, kv, i, sink, scale, **cfg) for i in idx_sets
                ]
                _record(rows, "sparse_attn", "triton", shape, label, nbytes, flops, calls, err, base, dev=dev)
            except Exception as exc:  # e.g. out of shared memory for a sweep point
                print(f"# sparse_attn {shape} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                rows.append(
                    {
                        "op": "sparse_attn",
                        "backend": "triton",
                        "shape": shape,
                        "config": label,
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                )


def bench_hc_mix(rows, batches, dev) -> None:
    from deepinfer_kernels.hyper_conn import reference
    from deepinfer_kernels.hyper_conn import triton as tk

    n, d = V41["hc_mult"], V41["hidden"]
    m = (2 + n) * n
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    g = torch.Generator(device=dev).manual_seed(1)
    for t in batches:
        nbytes = float(t * n * d * 2 + m * n * d * 4 + t * m * 4)
        flops = 2.0 * t * m * n * d
        sets = _sets_for(nbytes, 96, dev)
        data = []
        for _ in range(sets):  # fn rotates too: 40 layers x 2 mixes of 1.97 MB are cold in a real step
            r = torch.randn(t, n, d, device=dev, generator=g).to(torch.bfloat16)
            fn = torch.randn(m, n * d, device=dev, generator=g) * (n * d) ** -0.5
            base = torch.randn(m, device=dev, generator=g) * 0.5
            sc = torch.rand(3, device=dev, generator=g) + 0.5
            data.append((r, fn, base, sc))
        shape = f"T={t} n={n} d={d}"
        base_us = _record(
            rows,
            "hc_mix",
            "torch",
            shape,
            "",
            nbytes,
            flops,
            [lambda a=a: reference.hc_mix(*a, **kw) for a in data],
            None,
            dev=dev,
        )["time_us"]
        err = _err(tk.hc_mix(*data[0], **kw), reference.hc_mix(*data[0], **kw))
        _record(
            rows,
            "hc_mix",
            "triton",
            shape,
            "bt16 bk128",
            nbytes,
            flops,
            [lambda a=a: tk.hc_mix(*a, **kw) for a in data],
            err,
            base_us,
            dev=dev,
        )


def bench_hc_streams(rows, batches, dev) -> None:
    """hc_pre (collapse) and hc_post (combine) over [T, 4, 5120] bf16 streams."""
    from deepinfer_kernels.hyper_conn import reference
    from deepinfer_kernels.hyper_conn import triton as tk

    n, d = V41["hc_mult"], V41["hidden"]
    g = torch.Generator(device=dev).manual_seed(4)
    for t in batches:
        sets = _sets_for(t * n * d * 2 * 2, 128, dev)
        data = []
        for _ in range(sets):
            r = torch.randn(t, n, d, device=dev, generator=g).to(torch.bfloat16)
            y = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
            pre = torch.rand(t, n, device=dev, generator=g)
            post = torch.rand(t, n, device=dev, generator=g)
            comb = torch.rand(t, n, n, device=dev, generator=g)
            data.append((r, y, pre, post, comb))
        shape = f"T={t} n={n} d={d}"
        pre_bytes = float(t * n * d * 2 + t * d * 2 + t * n * 4)
        base = _record(
            rows,
            "hc_pre",
            "torch",
            shape,
            "",
            pre_bytes,
            2.0 * t * n * d,
            [lambda a=a: reference.hc_pre(a[0], a[2]) for a in data],
            None,
            dev=dev,
        )["time_us"]
        err = _err(tk.hc_pre(data[0][0], data[0][2]), reference.hc_pre(data[0][0], data[0][2]))
        _record(
            rows,
            "hc_pre",
            "triton",
            shape,
            "bd1024",
            pre_bytes,
            2.0 * t * n * d,
            [lambda a=a: tk.hc_pre(a[0], a[2]) for a in data],
            err,
            base,
            dev=dev,
        )
        post_bytes = float(2 * t * n * d * 2 + t * d * 2 + t * (n + n * n) * 4)
        flops = 2.0 * t * n * d * (n + 1)
        base = _record(
            rows,
            "hc_post",
            "torch",
            shape,
            "",
            post_bytes,
            flops,
            [lambda a=a: reference.hc_post(a[1], a[0], a[3], a[4]) for a in data],
            None,
            dev=dev,
        )["time_us"]
        a0 = data[0]
        err = _err(tk.hc_post(a0[1], a0[0], a0[3], a0[4]), reference.hc_post(a0[1], a0[0], a0[3], a0[4]))
        _record(
            rows,
            "hc_post",
            "triton",
            shape,
            "bd1024",
            post_bytes,
            flops,
            [lambda a=a: tk.hc_post(a[1], a[0], a[3], a[4]) for a in data],
            err,
            base,
            dev=dev,
        )


def bench_rms_norm(rows, batches, dev) -> None:
    from deepinfer_kernels.norm_rope import reference
    from deepinfer_kernels.norm_rope import triton as tk

    g = torch.Generator(device=dev).manual_seed(2)
    for t in batches:
        for shape_t, label, has_w in (
            ((t, V41["hidden"]), "hidden", True),
            ((t, V41["heads"], V41["head_dim"]), "q heads", False),
        ):
            numel = math.prod(shape_t)
            dd = shape_t[-1]
            nbytes = float(2 * numel * 2 + (dd * 2 if has_w else 0))
            flops = 4.0 * numel
            sets = _sets_for(nbytes, 128, dev)
            xs = [torch.randn(*shape_t, device=dev, generator=g).to(torch.bfloat16) for _ in range(sets)]
            w = (torch.rand(dd, device=dev, generator=g) + 0.5).to(torch.bfloat16) if has_w else None
            shape = f"{label} {list(shape_t)}"
            base_us = _record(
                rows,
                "rms_norm",
                "torch",
                shape,
                "",
                nbytes,
                flops,
                [lambda x=x, w=w: reference.rms_norm(x, w, 1e-6) for x in xs],
                None,
                dev=dev,
            )["time_us"]
            err = _err(tk.rms_norm(xs[0], w, 1e-6), reference.rms_norm(xs[0], w, 1e-6))
            _record(
                rows,
                "rms_norm",
                "triton",
                shape,
                "",
                nbytes,
                flops,
                [lambda x=x, w=w: tk.rms_norm(x, w, 1e-6) for x in xs],
                err,
                base_us,
                dev=dev,
            )


def bench_routing(rows, batches, dev) -> None:
    try:
        from deepinfer_kernels.routing import reference
        from deepinfer_kernels.routing import triton as tk
    except ImportError:
        return
    e, k = V41["experts"], 6
    g = torch.Generator(device=dev).manual_seed(3)
    for t in batches:
        nbytes = float(t * e * 4 + e * 4 + t * k * 12)
        flops = 4.0 * t * e
        sets = _sets_for(nbytes, 64, dev)
        data = [
            (torch.randn(t, e, device=dev, generator=g), torch.randn(e, device=dev, generator=g) * 0.1)
            for _ in range(sets)
        ]

        def ref(lg, b):
            s = torch.sqrt(torch.nn.functional.softplus(lg))
            return reference.select_experts(s, k, bias=b, route_scale=2.5)

        shape = f"T={t} E={e} k={k}"
        base_us = _record(
            rows,
            "route_topk",
            "torch",
            shape,
            "sqrtsoftplus",
            nbytes,
            flops,
            [lambda a=a: ref(*a) for a in data],
            None,
            dev=dev,
        )["time_us"]
        w_t, i_t = tk.route_topk(*data[0], k, route_scale=2.5)
        w_r, i_r = ref(*data[0])
        err = _err(w_t, w_r) if torch.equal(i_t, i_r) else float("inf")
        _record(
            rows,
            "route_topk",
            "triton",
            shape,
            "sqrtsoftplus",
            nbytes,
            flops,
            [lambda a=a: tk.route_topk(*a, k, route_scale=2.5) for a in data],
            err,
            base_us,
            dev=dev,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,256", help="comma-separated decode batch sizes (tokens)")
    p.add_argument("--ops", default="sparse_attn,hc_mix,rms_norm,routing")
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time a few sparse_attn launch configs at T in {1, 64, 256}",
    )
    p.add_argument(
        "--sweep-budget-s",
        type=float,
        default=60.0,
        help="stop the optional config sweep after this many seconds",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="exercise this script on CPU through the Triton interpreter (T=1 only, timings meaningless)",
    )
    ns = p.parse_args(argv)
    if ns.smoke_cpu:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: triton.jit reads it at decoration
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    import triton

    t0 = time.time()
    deadline = t0 + ns.sweep_budget_s
    batches = [1] if ns.smoke_cpu else [int(b) for b in ns.batches.split(",") if b]
    ops = set(ns.ops.split(","))
    info = {
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "hbm_bps": HBM_BPS,
        "peak_flops": PEAK_FLOPS,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if dev.type == "cuda" else 0,
    }
    print("# " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    _print_header()
    rows: list[dict[str, Any]] = []
    torch.backends.cuda.matmul.allow_tf32 = False  # references stay true fp32 (their spec)
    with torch.no_grad():
        if "sparse_attn" in ops:
            bench_sparse_attn(rows, batches, ns.sweep, deadline, dev)
        if "hc_mix" in ops:
            bench_hc_mix(rows, batches, dev)
            bench_hc_streams(rows, batches, dev)
        if "rms_norm" in ops:
            bench_rms_norm(rows, batches, dev)
        if "routing" in ops:
            bench_routing(rows, batches, dev)
    info["wall_s"] = time.time() - t0
    print(f"# wall {info['wall_s']:.1f} s", flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
