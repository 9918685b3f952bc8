"""Confidence Head check on a device: per block position, the survival the drafter predicted for the verified
drafts against the realised acceptance (`AcceptanceStats` survival calibration), on the trained testbed under
verify_all (every position verified).

    python scripts/dspark_confidence_check.py --device cuda                      # CUDA graphs (the default)
    python scripts/dspark_confidence_check.py --device cuda --no-fused-round     # draft pass graphed, sampling eager
    python scripts/dspark_confidence_check.py --device cuda --enforce-eager      # every step eagerly

The draft ids, and so the acceptance, do not depend on the confidences, so the configurations of one device must
print the same acceptance and the same predictions; a gap means the confidences of one path are wrong while
verification stays exact (the fused draft round's freed STS divisors were found this way, docs/perf.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from deepinfer_engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, the engine's auto elsewhere")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-fused-round", action="store_true",
                    help="CUDA graphs for the draft pass, but the Markov sampling and confidence eagerly")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1000)
    args = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("bench_dspark_policies", ROOT / "scripts" / "bench_dspark_policies.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tb = bench._testbed()
    bench.ensure_calibration(args.ckpt, tb)
    prompts = bench.prompt_sets(args.ckpt, tb, [args.seed], args.prompts, 16)[0]
    kw = dict(device=args.device, dtype=args.dtype or ("float32" if args.device == "cpu" else "auto"),
              max_num_seqs=args.prompts, enable_prefix_caching=False,
              speculative_config={"method": "dspark", "policy": "verify_all"})
    if args.device != "cpu":
        kw.update(enforce_eager=args.enforce_eager, kv_cache_memory_bytes=1 << 30, async_scheduling=False)
    llm = LLM(str(args.ckpt), **kw)
    dec = llm.engine.runner.spec
    if args.no_fused_round:
        dec.drafter.proposal_runner = None
    sp = bench.request_params(SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature,
                                             ignore_eos=True, seed=args.seed), len(prompts))
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: graph captures
    dec.reset_stats()
    llm.generate(prompts, sp, use_tqdm=False)
    st = dec.stats
    out = {"device": args.device, "dtype": kw["dtype"], "enforce_eager": args.enforce_eager,
           "fused_round": not args.no_fused_round, "temperature": args.temperature,
           "tau": round(st.mean_accepted_length, 4), "survival_calibration": st.survival_calibration,
           "acceptance_by_position": [round(x, 4) for x in st.acceptance_by_position()],
           "predicted_by_position": [round(x, 4) for x in st.predicted_acceptance_by_position() or []]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
