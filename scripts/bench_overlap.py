"""Decode step with side streams (model/overlap.py) on vs off, in one process over one loaded model (GPU).

    python scripts/bench_overlap.py --model DIR [--batch 1,64] [--input-len 1024] [--steps 16] [--rounds 2]
        [--output-json F]

Rounds alternate on / off (each round recaptures the CUDA graphs with the setting), so host or clock drift hits
both alike. Per round and batch size: the median engine decode step and its graph replayed alone (`forward_s`),
beside the bytes bound from the copy bandwidth measured in the same run (`bench.decode_roofline`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-json")
    ns = p.parse_args(argv)
    from deepinfer_engine import LLM
    from deepinfer_engine.bench import decode_roofline
    from deepinfer_engine.worker.cuda_graph import CudaGraphRunner

    batches = [int(b) for b in ns.batch.split(",") if b]
    llm = LLM(ns.model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches))
    runner = llm.engine.runner
    model, old = runner.model, runner.cuda_graphs
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for rnd in range(ns.rounds):
        for mode in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
            model.set_overlap(mode == "on")
            runner.cuda_graphs = CudaGraphRunner(model, old.cache, device=old.device, max_num_seqs=max(old.batch_sizes),
                                                 max_model_len=old.max_model_len)  # fmt: skip
            r = decode_roofline(llm, batch_sizes=batches, input_len=ns.input_len, steps=ns.steps)
            results[mode].append(r)
            for row in r["rows"]:
                print(f"round {rnd} overlap {mode:3s} B={row['batch_size']:3d}: step {row['step_s'] * 1e3:.3f} ms, "
                      f"forward {row.get('forward_s', float('nan')) * 1e3:.3f} ms, "
                      f"{row['fraction_of_bound'] * 100:.1f}% of the bytes bound "
                      f"(copy {r['copy_bandwidth_Bps'] / 1e9:,.1f} GB/s)", flush=True)
    print("| B | step on / off ms (median of rounds) | forward on / off ms | of bound on / off |")
    print("|---|---|---|---|")
    def med(mode: str, key: str, i: int) -> float:
        return statistics.median(r["rows"][i].get(key, float("nan")) for r in results[mode])

    for i, b in enumerate(batches):
        print(f"| {b} | {med('on', 'step_s', i) * 1e3:.3f} / {med('off', 'step_s', i) * 1e3:.3f} | "
              f"{med('on', 'forward_s', i) * 1e3:.3f} / {med('off', 'forward_s', i) * 1e3:.3f} | "
              f"{med('on', 'fraction_of_bound', i) * 100:.1f}% / {med('off', 'fraction_of_bound', i) * 100:.1f}% |")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
