"""Where the device time of one graphed decode step goes: kernel time per kernel family, from a torch profile of the
step's CUDA graph replayed alone.

    python scripts/kernel_breakdown.py --model DIR [--batch 1,64] [--input-len 1024] [--replays 10] [--top 25]
        [--kv-cache-dtype bfloat16|auto] [--prefill N] [--output-json F]

Per batch size, `bench.decode_step_seconds` runs a few engine decode steps (so the graph of that batch bucket is
captured and filled with a real step), then the profiler records `--replays` replays of that graph. Each kernel's
device time is summed and divided by the number of replays; kernels are grouped into families by name (the
patterns below, first match wins) so that a table says which part of the step to work on next. The per-kernel
list (top N) is printed too, since a family can hide one slow kernel. Beside each: the engine step (median of 8)
and the bytes bound of that step (`roofline.decode_step_bytes` for what the cache stores, over the copy bandwidth
measured in the same process).

`--prefill N` also profiles a prefill of N prompts of input-len tokens (eager: prefill runs outside the graphs),
after one unprofiled prefill of as many other prompts so that kernel compiles and autotuning are not counted: wall
time, kernel time, the tokens computed and the same families, to say where a prefill spends its time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
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
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=("bfloat16", "auto"))
    p.add_argument("--prefill", type=int, default=0, help="also profile a prefill of this many prompts")
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
    from deepinfer_kernels.device_rates import device_state
    from torch.profiler import ProfilerActivity, profile

    fwd: dict[str, float] = {}
    decode_step_seconds(llm, batch_size=batch, input_len=input_len, steps=2)  # captures this batch's graph
    times = decode_step_seconds(llm, batch_size=batch, input_len=input_len, steps=8, forward_only=fwd)
    state = device_state("cuda")  # the SM clock the timed steps ran at (None without NVML)
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
    return {"batch": batch, "graph_shape": list(graphs.last_shape), "forward_ms": fwd.get("forward_s", 0.0) * 1e3,
            "step_ms": statistics.median(times) * 1e3, "device_state": state, **_tally(prof, replays)}


def _tally(prof: Any, runs: int) -> dict[str, Any]:
    """Device time per kernel and per family of a profile, per run (`calls_per_step`: launches per run)."""
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            per_kernel[e.name] += t / runs
            calls[e.name] += 1
    fams: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        fams[family(name)] += us
    return {"kernel_us": sum(per_kernel.values()),
            "families": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n, "us": us, "calls_per_step": calls[n] / runs}
                        for n, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])]}


def prefill_breakdown(llm: Any, prompts: int, input_len: int) -> dict[str, Any]:
    """One prefill of `prompts` random prompts (one output token each) profiled after an unprofiled one of as many
    other prompts; `computed_tokens`: the prompt tokens the engine computed in it (fewer than all on a prefix-cache
    hit)."""
    import time

    from deepinfer_engine import SamplingParams
    from deepinfer_engine.bench import random_prompts
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    vocab = int(getattr(eng.args, "vocab_size", 129280))
    # other prompts than the decode tables' (seed 0) and than each other: with the prefix cache on, a prefill of
    # prompts seen before recomputes only their last page
    warm, ids = (random_prompts(prompts, input_len, vocab, seed, eng.bos_token_id) for seed in (1, 2))
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(warm, sp, use_tqdm=False)
    torch.cuda.synchronize()
    before = eng.total.prefill_tokens
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(ids, sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"prompts": prompts, "input_len": input_len, "wall_ms": wall * 1e3,
            "computed_tokens": eng.total.prefill_tokens - before, **_tally(prof, 1)}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from deepinfer_engine import LLM
    from deepinfer_engine.bench import kv_storage
    from deepinfer_engine.roofline import decode_step_bytes, measure_copy_bandwidth

    llm = LLM(ns.model, device="cuda", dtype="bfloat16", kv_cache_dtype=ns.kv_cache_dtype)
    copy_bw = measure_copy_bandwidth(torch.device("cuda"), nbytes=1 << 30)
    rows = [breakdown(llm, int(b), ns.input_len, ns.replays) for b in ns.batch.split(",") if b]
    for r in rows:
        nbytes = decode_step_bytes(llm.engine.args, r["batch"], ns.input_len + 4, kv_storage(llm))  # type: ignore[arg-type]
        r["bytes_bound_ms"] = nbytes.total / copy_bw * 1e3
        print(f"\n== B={r['batch']} graph {r['graph_shape']} kv {kv_storage(llm)}: engine step {r['step_ms']:.3f} ms, "
              f"replay {r['forward_ms']:.3f} ms, kernel time {r['kernel_us'] / 1e3:.3f} ms/step, bytes bound "
              f"{r['bytes_bound_ms']:.3f} ms ({r['bytes_bound_ms'] / r['step_ms'] * 100:.1f}% of the step; copy "
              f"{copy_bw / 1e9:.1f} GB/s)")
        if r["device_state"]:
            st = r["device_state"]
            print(f"   device after the timed steps: SM {st['sm_clock_mhz']:.0f} MHz, {st['temperature_c']:.0f} C, "
                  f"{st['power_w']:.0f} W")
        _print_tally(r, ns.top)
    pre = None
    if ns.prefill:
        pre = prefill_breakdown(llm, ns.prefill, ns.input_len)
        print(f"\n== prefill {ns.prefill} x {ns.input_len} tokens kv {ns.kv_cache_dtype} ({pre['computed_tokens']} computed): "
              f"wall {pre['wall_ms']:.1f} ms, kernel time {pre['kernel_us'] / 1e3:.1f} ms")
        _print_tally(pre, ns.top)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"model": ns.model, "torch": torch.__version__,
                                                    "kv_cache_dtype": ns.kv_cache_dtype,
                                                    "copy_bandwidth_Bps": copy_bw,
                                                    "gpu": torch.cuda.get_device_name(), "rows": rows,
                                                    "prefill": pre}, indent=2))
    return 0


def _print_tally(r: dict[str, Any], top: int) -> None:
    for fam, us in r["families"].items():
        print(f"  {fam:<28} {us:>9.1f} us  {us / max(r['kernel_us'], 1e-9) * 100:5.1f}%")
    print(f"  top {top} kernels:")
    for k in r["kernels"][:top]:
        print(f"  {k['us']:>9.1f} us  x{k['calls_per_step']:<5.0f} {k['name'][:110]}")


if __name__ == "__main__":
    raise SystemExit(main())
