"""How far `prefix_replay=approximate` drifts from a run without the prefix cache (and that `exact` does not).

    python scripts/prefix_replay_divergence.py [--arch v41|v4] [--cases 12] [--max-tokens 8] [--seed 0]

Writes a random tiny checkpoint (make_checkpoint "tiny", seed 0) into a temp dir, then for each case generates a
64-token random prompt A and a prompt B that shares A's first 24..63 tokens, on three engines (prefix cache off,
approximate, exact), B right after A so that B hits A's cached pages. Prints, per mode, the first-token
agreement with the uncached run, the greedy token agreement, the length of the identical output prefix, and the
|difference| of the log-probability the cached run gives the uncached run's first token. Greedy, CPU, fp32.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
from pathlib import Path

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.writer import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="v41", choices=("v41", "v4"))
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    ck = make_checkpoint(Path(tempfile.mkdtemp()) / "ckpt", ns.arch, "tiny", 0)
    sp = SamplingParams(temperature=0, max_tokens=ns.max_tokens, logprobs=5, ignore_eos=True)
    rng = random.Random(ns.seed)
    cases = []
    for _ in range(ns.cases):
        a = [0] + [rng.randint(3, 120000) for _ in range(63)]
        b = a[: rng.randint(24, 63)] + [rng.randint(3, 120000) for _ in range(rng.randint(1, 12))]
        cases.append((a, b))
    res = {}
    for mode in ("off", "approximate", "exact"):
        kw = {"enable_prefix_caching": False} if mode == "off" else {"prefix_replay": mode}
        llm = LLM(str(ck), device="cpu", dtype="float32", **kw)
        outs = []
        for a, b in cases:
            llm.generate([a], sp.replace(logprobs=None), use_tqdm=False)
            outs.append(llm.generate([b], sp, use_tqdm=False)[0])
        res[mode] = outs
    for mode in ("approximate", "exact"):
        first = agree = total = 0
        same, dlp, hits = [], [], []
        for o, r in zip(res[mode], res["off"]):
            t, u = o.outputs[0].token_ids, r.outputs[0].token_ids
            first += t[0] == u[0]
            agree += sum(x == y for x, y in zip(t, u))
            total += len(u)
            k = 0
            while k < len(u) and t[k] == u[k]:
                k += 1
            same.append(k)
            top = dict(o.outputs[0].logprobs[0].top)
            ref = r.outputs[0].logprobs[0]
            dlp.append(abs(top[ref.token_id] - ref.logprob) if ref.token_id in top else math.nan)
            hits.append((o.num_cached_tokens, o.metrics.num_replayed_tokens))
        known = sorted(x for x in dlp if not math.isnan(x))
        print(f"{ns.arch} {mode}: first token {first}/{len(cases)}, tokens {agree}/{total}, identical output "
              f"prefix {same}, |dlogprob| of the uncached first token median {known[len(known) // 2]:.4f} max "
              f"{known[-1]:.4f} (not in top-5: {len(dlp) - len(known)}), (cached, replayed) {hits}")


if __name__ == "__main__":
    main()
