"""EP dispatch / combine latency and bandwidth vs message size, beside the backend's own all_to_all_single rate
measured in the same run (same ranks, same bytes per rank).

    uv run --locked python packages/deepinfer-parallel/benchmarks/bench_dispatch.py --world 2          # gloo, CPU
    uv run --locked python packages/deepinfer-parallel/benchmarks/bench_dispatch.py --world 8 --backend nccl

Each rank routes T tokens to top_k distinct experts drawn uniformly from all physical slots; the local "experts" are
the identity, so the numbers are communication plus the dispatcher's own bookkeeping (and, with FP8, the
encode / decode of the payload). Low-latency buffers are sized for each step (max_tokens_per_rank = T). A timed iteration starts
after a barrier; the reported time is the slowest rank's median. Bandwidth = bytes this rank sends in the step
(routed rows for throughput mode, the whole fixed buffer for low-latency mode) / time. Prints a table and writes
JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from deepinfer_parallel import EPDispatcher, ParallelConfig, ParallelState, spawn_ranks


def _sync(state: ParallelState) -> None:
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    dist.barrier(group=state.cpu_group)


def _timed(state: ParallelState, fn, iters: int, warmup: int) -> float:
    """Median seconds of fn() on this rank, maxed over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(state)
        t0 = time.perf_counter()
        fn()
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.cpu_group)
    return float(t)


def _bench_rank(state: ParallelState, opts: dict) -> list[dict]:
    torch.manual_seed(1234 + state.rank)
    hidden, top_k, experts = opts["hidden"], opts["top_k"], opts["experts"]
    dtype = getattr(torch, opts["dtype"])
    rows = []
    for fp8 in opts["fp8"]:
        for n in opts["tokens"]:
            # Low-latency buffers sized for this step (max_tokens_per_rank = T), as a decode graph bucket would be.
            d = EPDispatcher(state, num_physical_experts=experts, hidden_size=hidden, top_k=top_k,
                             max_tokens_per_rank=n, dtype=dtype, fp8_block=fp8)
            x = torch.randn(n, hidden, device=state.device).to(dtype)
            slots = torch.argsort(torch.rand(n, experts, device=state.device), dim=1)[:, :top_k].contiguous()
            w = torch.rand(n, top_k, device=state.device)
            for mode in ("throughput", "low_latency"):
                t_dispatch = _timed(state, lambda d=d, mode=mode, x=x, slots=slots: d.dispatch(x, slots, mode=mode),
                                    opts["iters"], opts["warmup"])
                # A handle can be combined any number of times: time combine alone on one dispatch's output.
                out = d.dispatch(x, slots, mode=mode)
                y = out.recv_x.clone()
                t_combine = _timed(state, lambda d=d, out=out, y=y, w=w: d.combine(y, out.handle, w), opts["iters"],
                                   opts["warmup"])
                width = d.payload_width * torch.empty((), dtype=d.payload_dtype).element_size()
                sent_rows = n * top_k if mode == "throughput" else d.ep_size * d.capacity
                dispatch_bytes = sent_rows * width
                combine_bytes = sent_rows * hidden * torch.empty((), dtype=dtype).element_size()
                # The backend's own rate for the same bytes per rank: one equal-split all_to_all_single.
                per_peer = max(dispatch_bytes // state.ep_size, 1)
                a_in = torch.empty(per_peer * state.ep_size, dtype=torch.uint8, device=state.device)
                a_out = torch.empty_like(a_in)
                t_a2a = _timed(state, lambda a_out=a_out, a_in=a_in: dist.all_to_all_single(
                    a_out, a_in, group=state.ep_group), opts["iters"], opts["warmup"])
                rows.append({
                    "mode": mode, "fp8_block": fp8, "tokens_per_rank": n, "dispatch_bytes_per_rank": dispatch_bytes,
                    "dispatch_us": t_dispatch * 1e6, "combine_us": t_combine * 1e6,
                    "dispatch_gbps": dispatch_bytes / t_dispatch / 1e9,
                    "combine_gbps": combine_bytes / t_combine / 1e9,
                    "a2a_us": t_a2a * 1e6, "a2a_gbps": per_peer * state.ep_size / t_a2a / 1e9,
                })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--experts", type=int, default=64, help="physical expert slots over the EP group")
    p.add_argument("--tokens", default="1,4,16,64,256", help="tokens per rank, comma separated")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fp8", default="none,128", help="payloads: none and/or FP8 block sizes (32, 128)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_dispatch.json"))
    a = p.parse_args()
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    opts = {
        "hidden": a.hidden, "top_k": a.top_k, "experts": a.experts, "dtype": a.dtype,
        "tokens": [int(t) for t in a.tokens.split(",")], "iters": a.iters, "warmup": a.warmup,
        "fp8": [None if f == "none" else int(f) for f in a.fp8.split(",")],
    }
    devices = [f"cuda:{r}" for r in range(a.world)] if backend == "nccl" else None
    results = spawn_ranks(_bench_rank, a.world, opts, config=ParallelConfig(dp_size=a.world, ep_size=a.world),
                          backend=backend, devices=devices, start_method="spawn" if backend == "nccl" else "fork",
                          timeout_s=580)
    rows = results[0]
    settings = {**opts, "world": a.world, "backend": backend, "torch": torch.__version__,
                "threads_per_rank": 1, "device": "cuda" if backend == "nccl" else "cpu",
                "cpu_cores": os.cpu_count(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    print(f"settings: {json.dumps(settings)}")
    print(f"{'mode':<12}{'fp8':>5}{'tokens':>8}{'bytes/rank':>12}{'dispatch us':>13}{'combine us':>12}"
          f"{'disp GB/s':>11}{'comb GB/s':>11}{'a2a us':>10}{'a2a GB/s':>10}")
    for r in rows:
        print(f"{r['mode']:<12}{str(r['fp8_block'] or '-'):>5}{r['tokens_per_rank']:>8}"
              f"{r['dispatch_bytes_per_rank']:>12,}{r['dispatch_us']:>13.0f}{r['combine_us']:>12.0f}"
              f"{r['dispatch_gbps']:>11.3f}{r['combine_gbps']:>11.3f}{r['a2a_us']:>10.0f}{r['a2a_gbps']:>10.3f}")
    a.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
