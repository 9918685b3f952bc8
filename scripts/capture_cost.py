"""Where the seconds of a ragged verify-graph capture go (CUDA): the DSpark testbed engine is warmed with a short
speculative run, then verify graphs of new (B, L, T) shapes are captured one by one, each timed phase by phase
(static step built, first warm-up, freeze, second warm-up, capture) and the first of each batch bucket also under
cProfile (top functions by cumulative time).

    python scripts/capture_cost.py --ckpt .cache/dspark-testbed --batches 256 64 8 --json capture_cost.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed_capture(graphs, B: int, L: int, Q: int, capture: tuple[int, ...], rows: int) -> dict:
    """One capture of (B, L, rows), the runner's own steps with a synchronised clock between them."""
    from deepinfer_engine.model.static_step import StaticDecodeStep
    from deepinfer_engine.worker.cuda_graph import verify_row_sizes

    dev = graphs.device
    marks = {}
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    step = StaticDecodeStep(graphs.cache, B, L, dev, tokens=Q, rows=rows)
    torch.cuda.synchronize(dev)
    marks["static_step"] = time.perf_counter() - t0
    logits_out = graphs._logits_out("verify", rows, verify_row_sizes(graphs.batch_sizes[-1], Q)[-1])

    def forward():
        return graphs._forward(step, capture, logits_out)

    if graphs._pool is None:
        graphs._pool = torch.cuda.graph_pool_handle()
        graphs._pools.append(graphs._pool)
        graphs._stream = torch.cuda.Stream(dev)
    stream = graphs._stream
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.no_grad():
        for i in range(2):
            t = time.perf_counter()
            with torch.cuda.stream(stream):
                forward()
            torch.cuda.synchronize(dev)
            marks[f"warm_up_{i + 1}"] = time.perf_counter() - t
            if i == 0:
                t = time.perf_counter()
                step.freeze()
                torch.cuda.synchronize(dev)
                marks["freeze"] = time.perf_counter() - t
        t = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs._pool, stream=stream):
            forward()
        torch.cuda.synchronize(dev)
        marks["capture"] = time.perf_counter() - t
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(dev)
        marks["first_replay"] = time.perf_counter() - t
    marks["total"] = time.perf_counter() - t0
    return {k: round(v * 1e3, 2) for k, v in marks.items()}


def main() -> int:
    from deepinfer_engine import LLM, SamplingParams
    from deepinfer_engine.worker.cuda_graph import length_bucket, verify_row_sizes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 64, 8])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    llm = LLM(str(args.ckpt), device="cuda", max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 30, speculative_config={"method": "dspark", "policy": "verify_all"})
    runner = llm.engine.runner
    graphs, spec = runner.cuda_graphs, runner.spec
    prompts = [[100 + (i % 50), 200, 300, 400] for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    Q = spec.max_drafts + 1
    L = length_bucket(1, graphs.max_model_len)
    out = {"graphs_before": len(graphs.graphs), "captures": []}
    for B in args.batches:
        sizes = [t for t in verify_row_sizes(B, Q) if (B, L, t) not in graphs.graphs]
        for i, T in enumerate(sizes):
            prof = cProfile.Profile() if i == 0 else None
            if prof is not None:
                prof.enable()
            marks = timed_capture(graphs, B, L, Q, spec.capture, T)
            row = {"B": B, "L": L, "T": T, "ms": marks}
            if prof is not None:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
                row["profile"] = s.getvalue()
                print(s.getvalue(), flush=True)
            out["captures"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
