"""DSpark verification policies replayed offline over recorded rounds of the trained testbed.

    python scripts/dspark_policy_replay.py record --prompts 128 --rounds 80 --temperature 0 --out rounds.pkl
    python scripts/dspark_policy_replay.py replay rounds.pkl --curve-json policies.json [--floor-ms 3] [--json F]
    python scripts/dspark_policy_replay.py features train.pkl test.pkl   (rounds recorded at T > 0)

`record` runs the testbed (`.cache/dspark-testbed`, built by `scripts/dspark_testbed.py build`) on the CPU with
verify_all and keeps, per round in which every request verified all N drafts, the survivals `[B, N]` and each
request's accepted count `a`. With counter-based draws a policy that verifies m drafts of a request accepts
min(m, a) of them, at T = 0 and at T > 0 alike (the uniforms are keyed by position, not by what is verified), so
every non-anticipating policy can be replayed exactly on the same rounds.

`replay` prices each policy's rounds by a latency curve: the cost policy's batch curve of the same batch size from
a `bench_dspark_policies.py --json` run on the target device (`latency_after.by_batch`, its overhead, and
`--floor-ms` for the host's launch floor), with the engine's ragged row buckets. Per policy: verified drafts and
emitted tokens per round, the modeled round time and the modeled tokens/s (emitted tokens over modeled seconds).
The times are a model of the device, not a measurement; the tokens are exact. Policies: verify_all, thresholds,
the lagged cost count (the budget searched on the survivals of `lag` rounds before, on one round in `every`:
the engine's rounds with sampled rows), the carried survival cutoff (`cost_cutoff`, the engine's greedy rounds;
read from an earlier round, so unbiased at T > 0 too) and at T = 0 cost chosen in the round, with the engine's
online survival calibration.

`features` asks whether the sampled drafts' own probabilities rank drafts better than the Confidence Head alone:
a round recorded at T > 0 also keeps each draft's confidence c_j and the probability q_j its draft distribution
gave it. A logistic fit of the conditional acceptance on (1, logit c_j, log q_j, j, [j = 0] log q_j) over the
first recording's rounds is applied to the second's: a threshold on survivals built from it, against one on the
head's own survivals, by the share of verified drafts cut at 97% of verify_all's tokens and the tokens kept at a
30% cut. A draft's own q_j depends on the draft, so a choice of whether to verify it must not read it (at T > 0
that biases the output: the rejected mass no longer matches the residual distribution); the exact score reads
the fitted acceptance of the drafts before it and the head's c_j for itself.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def record(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_dspark_policies import _testbed, ensure_calibration, prompt_sets, request_params
    from deepinfer_engine import LLM, SamplingParams

    ckpt, tb, count = Path(args.ckpt), _testbed(), args.prompts
    ensure_calibration(ckpt, tb)
    prompts = prompt_sets(ckpt, tb, [args.seed], count, 16)[0]
    llm = LLM(str(ckpt), speculative_config={"method": "dspark", "policy": "verify_all"}, device="cpu",
              max_num_seqs=count, enable_prefix_caching=False, async_scheduling=False)
    dec = llm.engine.runner.spec
    rounds: list[tuple[np.ndarray, np.ndarray]] = []
    update = dec.stats.update

    def keep(accepted, verified, survival=None, **kw):  # a full round of the whole batch, every draft verified
        if survival is not None and len(accepted) == count and all(v == dec.block_size for v in verified):
            rounds.append((np.asarray(survival, dtype=np.float32).copy(), np.asarray(accepted, dtype=np.int64)))
        return update(accepted, verified, survival=survival, **kw)

    dec.stats.update = keep
    features: list[tuple[np.ndarray, np.ndarray]] = []
    if args.temperature > 0:  # per kept round: confidences and the drafts' own probabilities
        begin, pending = dec.begin, []

        def begin_with_features(*a, **kw):
            rnd = begin(*a, **kw)
            p = rnd.proposal
            if p is not None and p.draft_probs is not None and p.confidence is not None:
                q = torch.gather(p.draft_probs, 2, p.draft_ids[:, :, None])[:, :, 0]
                pending.append((np.asarray(rnd.survival_host).copy(), p.confidence.float().cpu().numpy().copy(),
                                q.float().cpu().numpy().copy()))
            return rnd

        def keep_features(*a, **kw):
            n = len(rounds)
            out = keep(*a, **kw)
            if len(rounds) > n:  # the round kept: its proposal's features, matched by its survivals
                while pending and not np.array_equal(pending[0][0].astype(np.float32), rounds[-1][0]):
                    pending.pop(0)
                if not pending:
                    raise SystemExit("record: a kept round's proposal was not seen")
                features.append(pending.pop(0)[1:])
            return out

        dec.begin, dec.stats.update = begin_with_features, keep_features
    sp = SamplingParams(max_tokens=(args.rounds + 8) * (dec.block_size + 1), temperature=args.temperature,
                        ignore_eos=True, seed=args.seed)
    llm._add(llm._admit(prompts, request_params(sp, count)))
    while len(rounds) < args.rounds:
        llm.engine.step_outputs()
    Path(args.out).write_bytes(pickle.dumps({"temperature": args.temperature, "rounds": rounds,
                                             "features": features[: len(rounds)]}))
    print(f"{len(rounds)} rounds of {count} requests; accepted drafts per request {np.mean([a.mean() for _, a in rounds]):.3f}")


def _curve(path: str, batch: int, temperature: float, floor_ms: float, overhead_ms: float | None):
    """The cost policy's batch curve of `batch` requests in a policies bench JSON (the run at `temperature` when
    the file has one: its overhead differs)."""
    from deepinfer_dspark import LatencyModel

    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["policy"] == "cost" and r["prompts"] == batch]
    if not rows:
        raise SystemExit(f"{path}: no cost run of {batch} requests")
    row = next((r for r in rows if r.get("temperature") == temperature), rows[0])
    c = row["latency_after"]["by_batch"][str(batch)]
    lat = LatencyModel(c["sizes"], [t / 1e3 for t in c["measured_ms"]], noise=c["noise_ms"] / 1e3)
    lat.observe_overhead((c["overhead_ms"] if overhead_ms is None else overhead_ms) / 1e3)
    if floor_ms > 0:
        lat.observe_floor(floor_ms / 1e3)
    return lat


def replay(args: argparse.Namespace) -> dict[str, Any]:
    from deepinfer_dspark import (
        StepPadding,
        SurvivalCalibration,
        VerifyPolicy,
        allocate,
        allocate_above,
        cost_budget,
        cost_cutoff,
        schedule_verification,
    )

    rec = pickle.loads(Path(args.rounds).read_bytes())
    rounds, greedy = rec["rounds"], rec["temperature"] == 0
    batch, width = rounds[0][0].shape
    lat = _curve(args.curve_json, batch, rec["temperature"], args.floor_ms, args.overhead_ms)
    # the engine's ragged verify buckets of a full graph batch (worker/cuda_graph.py `verify_row_sizes`)
    pad = StepPadding(batch, tuple(sorted({-(-batch * k // 2) for k in range(2, 2 * (width + 1) + 1)})), ragged=True)
    m = np.full(batch, width)

    def run(choose: Callable[[int, np.ndarray, Any, dict], np.ndarray]) -> dict[str, float]:
        cal, state, out = SurvivalCalibration(), {}, []
        for i, (s, a) in enumerate(rounds):
            counts = np.asarray(choose(i, s, cal, state))
            verified = int(counts.sum())
            out.append((verified, batch + int(np.minimum(counts, a).sum()),
                        lat.predict(int(pad.bucketed(np.asarray([batch + verified]))[0]))))
            if i % 4 == 0:  # the engine's CALIBRATE_EVERY
                cal.update(s, m, a, np.full(batch, greedy))
        out = out[args.skip:]
        v, t, sec = (np.asarray([o[k] for o in out], dtype=np.float64) for k in range(3))
        return {"verified": v.mean(), "tokens": t.mean(), "ms": 1e3 * sec.mean(), "tokens_per_s": t.sum() / sec.sum()}

    def price(cal):
        return lambda values: cal.map(values, greedy)

    def threshold(t: float):
        pol = VerifyPolicy(kind="threshold", threshold=t)
        return lambda i, s, cal, st: schedule_verification(pol, m, survival=s).numpy()

    def lagged(lag: int, every: int):
        def choose(i, s, cal, st):
            j = i - lag
            if j < 0:
                return m
            if j % every == 0 or "k" not in st:
                st["k"] = cost_budget(rounds[j][0], m, lat, exact=False, deterministic=True, padding=pad,
                                      price=price(cal))
            return allocate(s, m, st["k"]).numpy()
        return choose

    def cutoff(lag: int, every: int):  # the engine's greedy rounds: a carried survival cutoff
        def choose(i, s, cal, st):
            j = i - lag
            if j < 0:
                return m
            if j % every == 0 or "c" not in st:
                st["c"] = cost_cutoff(rounds[j][0], m, lat, padding=pad, price=price(cal))
            return allocate_above(s, m, st["c"]).numpy()
        return choose

    def in_round(i, s, cal, st):
        return schedule_verification(VerifyPolicy(kind="cost"), m, survival=s, latency=lat, padding=pad,
                                     deterministic=True, price=price(cal)).numpy()

    policies: dict[str, Callable] = {"verify_all": lambda i, s, cal, st: m}
    policies.update({f"threshold {t:g}": threshold(t) for t in args.thresholds})
    policies.update({f"cost lagged {lag}, every {e}": lagged(lag, e) for lag in (1, 4) for e in (1, 4)})
    if greedy:  # at T > 0 a round's own survivals choosing its global K would bias the output
        policies["cost in the round"] = in_round
    # a cutoff read from an earlier round is non-anticipating at any temperature
    policies.update({f"cost cutoff, lag {lag}, every {e}": cutoff(lag, e) for lag, e in ((1, 1), (1, 4))})
    res = {name: run(choose) for name, choose in policies.items()}
    best = max(r["tokens_per_s"] for name, r in res.items() if name.startswith("threshold"))
    print(f"{len(rounds)} rounds of {batch} requests, T = {rec['temperature']:g} (first {args.skip} skipped); "
          f"modeled time: {args.curve_json}, floor {args.floor_ms} ms")
    print(f"{'policy':28} {'verified':>9} {'tokens':>8} {'ms':>7} {'tok/s':>8} {'/best thr':>9}")
    for name, r in res.items():
        r["over_best_threshold"] = r["tokens_per_s"] / best
        print(f"{name:28} {r['verified']:9.1f} {r['tokens']:8.1f} {r['ms']:7.2f} {r['tokens_per_s']:8.0f} "
              f"{r['over_best_threshold']:9.3f}")
    return {"rounds": len(rounds), "batch": batch, "temperature": rec["temperature"], "floor_ms": args.floor_ms,
            "policies": res}


def _features(c: np.ndarray, q: np.ndarray) -> np.ndarray:
    """`[B, N, 5]` (1, logit c, log q, position, [position 0] log q) of a round's drafts."""
    c = np.clip(c.astype(np.float64), 1e-6, 1 - 1e-6)
    lq = np.log(np.clip(q.astype(np.float64), 1e-9, 1.0))
    pos = np.broadcast_to(np.arange(c.shape[1], dtype=np.float64)[None, :], c.shape)
    return np.stack([np.ones_like(c), np.log(c) - np.log1p(-c), lq, pos, lq * (pos == 0)], -1)


def fit_acceptance(rounds: list, features: list) -> np.ndarray:
    """Logistic weights of a draft's conditional acceptance (drafts reached: all before it accepted) on
    `_features`, by Newton's method."""
    xs, ys = [], []
    for (_, a), (c, q) in zip(rounds, features):
        depth = np.arange(c.shape[1])[None, :]
        reached = depth <= a[:, None]
        xs.append(_features(c, q)[reached])
        ys.append((depth < a[:, None])[reached])
    x, y = np.concatenate(xs), np.concatenate(ys).astype(np.float64)
    w = np.zeros(x.shape[1])
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        step = np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(w.size), x.T @ (p - y))
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return w


def frontier(scores: list[np.ndarray], accepted: list[np.ndarray]) -> dict[str, float]:
    """A survival threshold swept over `[B, N]` scores (each request verifies its prefix at or above it) on rounds
    whose accepted drafts are `accepted`: the largest share of verified drafts cut while keeping >= 97% of
    verify_all's tokens, and the tokens kept at the smallest cut >= 30%."""
    full = sum(a.size + a.sum() for a in accepted)
    drafts = sum(s.size for s in scores)
    points = []
    for t in np.concatenate([np.linspace(0.0, 0.3, 301), np.linspace(0.3, 1.0, 71)[1:]]):
        ver = tok = 0
        for s, a in zip(scores, accepted):
            m = np.logical_and.accumulate(s >= t, axis=1).sum(1)
            ver, tok = ver + m.sum(), tok + a.size + np.minimum(m, a).sum()
        points.append((1.0 - ver / drafts, tok / full))
    return {"cut_at_97": max((c for c, k in points if k >= 0.97), default=0.0),
            "tokens_at_30": min(((c, k) for c, k in points if c >= 0.30), default=(0.0, 0.0))[1]}


def features_report(args: argparse.Namespace) -> dict[str, Any]:
    train, test = (pickle.loads(Path(p).read_bytes()) for p in (args.train, args.test))
    for name, rec in (("train", train), ("test", test)):
        if not rec.get("features") or len(rec["features"]) != len(rec["rounds"]):
            raise SystemExit(f"features: the {name} recording has no draft features (record it at T > 0)")
    w = fit_acceptance(train["rounds"], train["features"])
    accepted = [a for _, a in test["rounds"]]

    def exact(c: np.ndarray, q: np.ndarray) -> np.ndarray:
        fitted = 1.0 / (1.0 + np.exp(-_features(c, q) @ w))
        before = np.concatenate([np.ones((c.shape[0], 1)), np.cumprod(fitted, 1)[:, :-1]], 1)
        return before * c  # the drafts before j by their fitted acceptance, draft j by the head alone

    out = {"weights": w.tolist(), "rounds": len(accepted),
           "head": frontier([np.cumprod(c, 1) for c, _ in test["features"]], accepted),
           "fitted, exact": frontier([exact(c, q) for c, q in test["features"]], accepted),
           "fitted, reading each draft's own q (biased at T > 0)": frontier(
               [np.cumprod(1.0 / (1.0 + np.exp(-_features(c, q) @ w)), 1) for c, q in test["features"]], accepted)}
    print(f"weights (1, logit c, log q, position, [position 0] log q): {np.round(w, 3).tolist()}; "
          f"{len(accepted)} test rounds")
    for name in ("head", "fitted, exact", "fitted, reading each draft's own q (biased at T > 0)"):
        r = out[name]
        print(f"  {name:52} cut at >= 97% tokens {100 * r['cut_at_97']:5.1f}%; tokens at a 30% cut "
              f"{100 * r['tokens_at_30']:5.1f}%")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record verify_all rounds of the testbed on the CPU")
    rec.add_argument("--ckpt", default=str(ROOT / ".cache" / "dspark-testbed"))
    rec.add_argument("--prompts", type=int, default=128)
    rec.add_argument("--rounds", type=int, default=80)
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--seed", type=int, default=1000)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="replay the policies over recorded rounds")
    rep.add_argument("rounds")
    rep.add_argument("--curve-json", required=True, help="a bench_dspark_policies.py --json output")
    rep.add_argument("--floor-ms", type=float, default=0.0)
    rep.add_argument("--overhead-ms", type=float, default=None, help="default: the curve's own")
    rep.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    rep.add_argument("--skip", type=int, default=8, help="rounds left out at the start (the calibration warms up)")
    rep.add_argument("--json", default=None)
    fea = sub.add_parser("features", help="the drafts' own probabilities against the head, on T > 0 recordings")
    fea.add_argument("train")
    fea.add_argument("test")
    fea.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.command == "record":
        record(args)
        return 0
    out = replay(args) if args.command == "replay" else features_report(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
