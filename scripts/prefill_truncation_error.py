"""How far compact prefill truncation lands from a full prefill on the tiny-width model with the real V4.1 layer
topology (40 layers, window 128, decoder = layers 20..39), fp32 on CPU, random weights.

    python scripts/prefill_truncation_error.py [--prompt-len 400,1000] [--keep 140,1000,2541] [--prompts 8]
        [--steps 8] [--chunk 0] [--seed 5] [--output-json FILE]

Per (prompt length, KEEP): over --prompts random prompts, the first token's logit error (max |Δ| / max |ref|),
how often its argmax agrees with the full prefill's, and how many of --steps greedy tokens agree (the whole
continuation up to the first disagreement). --chunk N prefills in chunks of N tokens (0 = one chunk).
Random weights say how the error propagates through the layers, not how a trained model's outputs move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "deepinfer-engine" / "tests" / "support"))

from equality import max_rel_err  # noqa: E402
from truncation_runs import generate, prompt, real_topology_model  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=_ints, default=[400, 1000])
    ap.add_argument("--keep", type=_ints, default=[140, 1000, 2541])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--output-json", type=Path)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    model = real_topology_model(ns.seed)
    rows = []
    for P in ns.prompt_len:
        chunks = [P] if ns.chunk <= 0 else [min(ns.chunk, P - s) for s in range(0, P, ns.chunk)]
        refs = []
        for i in range(ns.prompts):
            ids = prompt(P, 1000 + i)
            refs.append((ids, *generate(model, ids, [P], "off", steps=ns.steps)))
        for keep in ns.keep:
            if keep >= P:
                continue  # nothing dropped: compact is a full prefill
            t0 = time.perf_counter()
            errs, first_agree, cont = [], 0, []
            for ids, ref_first, ref_toks, _ in refs:
                first, toks, _ = generate(model, ids, chunks, "compact", keep, steps=ns.steps)
                errs.append(max_rel_err(first, ref_first))
                first_agree += int(toks[0] == ref_toks[0]) if toks else int(first.argmax() == ref_first.argmax())
                same = 0
                while same < len(toks) and toks[same] == ref_toks[same]:
                    same += 1
                cont.append(same)
            row = {"prompt_len": P, "keep": keep, "prompts": ns.prompts, "logit_err_median": statistics.median(errs),
                   "logit_err_max": max(errs), "first_token_agree": first_agree,
                   "greedy_prefix_mean": statistics.mean(cont), "steps": ns.steps,
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(f"prompt {P:>5}  keep {keep:>5}  logit err median {row['logit_err_median']:.3g} max "
                  f"{row['logit_err_max']:.3g}  first token {first_agree}/{ns.prompts}  greedy prefix "
                  f"{row['greedy_prefix_mean']:.2f}/{ns.steps}", flush=True)
    if ns.output_json:
        ns.output_json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
