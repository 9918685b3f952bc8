"""Where the device time of one graphed decode step goes: kernel time per kernel family, from a torch profile of the
step's CUDA graph replayed alone.

    python scripts/kernel_breakdown.py --model DIR [--batch 1,64] [--input-len 1024] [--replays 10] [--top 25]
        [--output-json F]

Per batch size, `bench.decode_step_seconds` runs a few engine decode steps (so the graph of that batch bucket is
captured and filled with a real step), then the profiler records `--replays` replays of that graph. Each kernel's
device time is summed and divided by the number of replays; kernels are grouped into families by name (the
patterns below, first match wins) so that a table says which part of the step to work on next. The per-kernel
list (top N) is printed too, since a family can hide one slow kernel.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

FAMILIES: list[tuple[str, str]] = [
    ("sparse attention", r"sparse_attn|_attend|flash|fmha"),
    ("moe fp4 expert gemms", r"gate_up|_down_|fp4"),
    ("moe routing / permutation", r"align|route|_combine_kernel|permut|scatter|index_add"),
    ("fp8 linear", r"_linear_kernel|scaled_mm|act_quant|quant"),
    ("indexer / top-k", r"indexer|topk|top_k|sort|radix"),
    ("compressor / cache ring", r"compress|ring_|cache_write|kv_write"),
    ("mHC (hyper-connections)", r"hc_|sinkhorn|hyper"),
    ("norms / rope / activation", r"norm|rope|rotary|swiglu|silu|gelu|sigmoid"),
    ("engram", r"engram|hash"),
    ("lm head / sampling", r"argmax|chunk_max|lm_head|sampl|gumbel"),
    ("cuBLAS / cutlass gemm", r"gemm|gemv|cutlass|xmma|cublas|nvjet"),
    ("elementwise / copies", r"elementwise|vectorized|copy|fill|cat|index|reduce|memcpy|memset"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--output-json")
    return p.parse_args(argv)


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def breakdown(llm: Any, batch: int, input_len: int, replays: int) -> dict[str, Any]:
    from deepinfer_engine.bench import decode_step_seconds
    from torch.profiler import ProfilerActivity, profile

    fwd: dict[str, float] = {}
    decode_step_seconds(llm, batch_size=batch, input_len=input_len, steps=4, forward_only=fwd)
    graphs = getattr(llm.engine.runner, "cuda_graphs", None)
    if graphs is None or graphs.last_shape is None:
        raise SystemExit("the engine ran no CUDA graph: run with graphs on (not enforce_eager) on CUDA")
    g = graphs.graphs[graphs.last_shape]
    g.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.graph.replay()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            per_kernel[e.name] += t / replays
            calls[e.name] += 1
    fams: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        fams[family(name)] += us
    return {"batch": batch, "graph_shape": list(graphs.last_shape), "forward_ms": fwd.get("forward_s", 0.0) * 1e3,
            "kernel_us": sum(per_kernel.values()),
            "families": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n, "us": us, "calls_per_step": calls[n] / replays}
                        for n, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])]}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from deepinfer_engine import LLM

    llm = LLM(ns.model, device="cuda", dtype="bfloat16")
    rows = [breakdown(llm, int(b), ns.input_len, ns.replays) for b in ns.batch.split(",") if b]
    for r in rows:
        print(f"\n== B={r['batch']} graph {r['graph_shape']}: replay {r['forward_ms']:.3f} ms, "
              f"kernel time {r['kernel_us'] / 1e3:.3f} ms/step")
        for fam, us in r["families"].items():
            print(f"  {fam:<28} {us:>9.1f} us  {us / r['kernel_us'] * 100:5.1f}%")
        print(f"  top {ns.top} kernels:")
        for k in r["kernels"][: ns.top]:
            print(f"  {k['us']:>9.1f} us  x{k['calls_per_step']:<5.0f} {k['name'][:110]}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"model": ns.model, "torch": torch.__version__,
                                                    "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
