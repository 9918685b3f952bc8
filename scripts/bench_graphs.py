"""Decode step with CUDA graphs vs eager, in one process over one loaded model (GPU).

    python scripts/bench_graphs.py --model DIR [--batch 1,8,32,64] [--input-len 1024] [--steps 8]
        [--profile-batch 1,64] [--output-json F]

Per mode (graphs on, then off by detaching the runner's CudaGraphRunner, i.e. what `enforce_eager=True` runs):
`bench.decode_roofline` (median engine decode step beside the bytes bound and the copy bandwidth measured in the
same run) and `profile_step.profile_batch` (kernel launches, graph replays, host syncs, GPU busy per step).
Prints the capture count, time and pool memory of the graphs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def top_kernels(llm, batch: int, input_len: int, steps: int, n: int) -> str:
    """Device-time table of the kernels of `steps` full-batch decode steps (torch profiler)."""
    import torch
    from deepinfer_engine import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    budget = int(llm.config.scheduler.max_num_batched_tokens)
    sp = SamplingParams(max_tokens=steps + 3 + -(-batch * input_len // budget), temperature=0.0, ignore_eos=True)
    ids = [f"top-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, [0] + [(7 * i + j) % 100000 + 3 for j in range(input_len - 1)], sp)
    while True:  # until a step decodes every sequence (graph captured in that step if new)
        before = eng.total.decode_tokens
        eng.step()
        if eng.total.decode_tokens - before == batch:
            break
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    try:
        return prof.key_averages().table(sort_by="device_time_total", row_limit=n)
    except (KeyError, AttributeError, ValueError):
        return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--profile-batch", default="1,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--top-kernels", type=int, default=0, help="print the N kernels with the most device time")
    p.add_argument("--modes", default="graphs,eager", help="which of graphs / eager to run, in order")
    p.add_argument("--output-json")
    ns = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from deepinfer_engine import LLM
    from deepinfer_engine.bench import decode_roofline, format_roofline
    from profile_step import profile_batch

    opts = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": max(int(b) for b in ns.batch.split(","))}
    if ns.max_model_len:
        opts["max_model_len"] = ns.max_model_len
    llm = LLM(ns.model, **opts)
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    batches = [int(b) for b in ns.batch.split(",") if b]
    out: dict = {"model": ns.model, "options": opts}
    for mode in ns.modes.split(","):
        runner.cuda_graphs = graphs if mode == "graphs" else None
        r = decode_roofline(llm, batch_sizes=batches, input_len=ns.input_len, steps=ns.steps)
        print(f"--- {mode}")
        print(format_roofline(r))
        prof = [profile_batch(llm, int(b), ns.input_len, ns.steps) for b in ns.profile_batch.split(",") if b]
        for row in prof:
            print(f"profile B={row['batch']}: {row['step_ms_median']:.2f} ms/step, "
                  f"{row['kernel_launches_per_step']:.0f} launches, {row.get('graph_launches_per_step', 0):.1f} graph "
                  f"replays, {row['host_syncs_per_step']:.1f} syncs, GPU busy {row['gpu_busy_fraction'] * 100:.1f}%")
        out[mode] = {"roofline": r, "profile": prof}
        if mode == "graphs":
            st = graphs.stats
            out["graph_stats"] = {"captures": st.captures, "capture_s": st.capture_s, "pool_bytes": graphs.pool_bytes(),
                                  "output_bytes": graphs.output_bytes(), "replays": st.replays,
                                  "eager_steps": st.eager_steps, "shapes": st.shapes}
            print(f"graphs: {st.captures} captures {st.shapes} in {st.capture_s:.2f} s, "
                  f"{graphs.pool_bytes() / 2**20:.0f} MiB in their pool + {graphs.output_bytes() / 2**20:.0f} MiB of "
                  f"shared outputs, {st.replays} replays")
    if ns.top_kernels:
        runner.cuda_graphs = graphs
        for b in (int(x) for x in ns.profile_batch.split(",") if x):
            print(f"--- top kernels, graphs on, B={b} (device time over {ns.steps} decode steps)")
            print(top_kernels(llm, b, ns.input_len, ns.steps, ns.top_kernels))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
