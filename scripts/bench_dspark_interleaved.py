"""DSpark verification policies compared round by round inside one steady window of one engine.

    python scripts/bench_dspark_interleaved.py [--ckpt .cache/dspark-testbed] [--device cuda] [--prompts 32 128 256]
        [--temperature 1 0] [--threshold 0.2 0.5] [--cycles 96] [--warm-cycles 16] [--skip 4] [--json F]

`bench_dspark_policies.py` times whole runs of one policy each, and on the H200 the runs of one cell spread by
20-40% from host noise (slow spells of about a run), more than the policies differ (1-5%). Here the batch stays
full and every cycle runs ONE round of each policy, in a seeded order per cycle (`run_order`): a slow spell hits
neighbouring rounds of every policy alike, and the comparison pairs the rounds of one cycle. Per policy: the
tokens its rounds emitted per second of those rounds; cost's tokens/s over each rival's, with a 95% bootstrap
that resamples whole cycles.

Only the policy object is switched between rounds (`SpecDecoder.policy`): the latency curves and their online
correction are shared, and the cost policy's lagged budget comes from its own previous round, one cycle earlier
(`SpecDecoder.set_policy` would drop it). So at T > 0 cost runs a budget two or more rounds old: non-anticipating as
the one-round lag is, but staler than in a run of cost alone (at T = 0 its survival cutoff likewise). A round's time
is the engine step's wall time (the scheduler, the round and its bookkeeping, the output processing); the draft pass
launched at its end for the next round does the same work whatever policy comes next; no sync separates the rounds,
so each round's time runs from the previous step's return to its own. Cycles in which a CUDA graph was captured are
dropped, and so are cycles with a stall: a round over STALL_FACTOR times the cell's median round (one 200 ms round,
a one-off the policy does not cause, outweighed 95 others of 20 ms in a ratio of sums on the H200), whichever policy
it hit.
Each round also records the drafts it verified, its policy's host seconds after the drafts' read (`SpecTiming`
policy + lagged search), whether the device decided its counts (`SpecDecoder.decide_on_device`, off in the engine),
the rows its verify step ran (the graph's row bucket, from `SpecTiming.by_rows`) and the host seconds that planned
and enqueued a decision on the device before the read (`SpecTiming.decide_s`: overlapped with the draft pass while
the device drafts, round time where it has finished), and the policy's other host work, which the policy window does
not hold: the warm-up call while the device drafts (`warm_s`), the deferred statistics and calibration update after
the next draft pass's launch (`deferred_s`), and the lagged search's share of the policy seconds (`lag_s`). Per
cell, `by_rows` sets each row bucket's measured round time (every policy's rounds, and cost's alone) beside the cost
policy's price of that bucket at the window's end (`LatencyModel.predict` of the cell's batch curve): whether the
rows the cost policy adds inside a bucket, or by filling the next one, cost what its curve says.
After the cells, `sweep` sums up each rival over them: the geometric mean of cost's ratio, its range, and the cells
won, tied and lost at 95%. A threshold is one setting for every load a server meets, so the question is whether
any fixed rival beats cost anywhere, and whether cost beats each of them somewhere; the sweep should span the loads
where verifying every draft is free (a few requests) to those where it is not.
`--device-decision` adds, for each policy but verify_all, a rival NAME[device] that decides on the device while it
drafts: the decision on the device against the host's, paired by cycle like the policies; cost[device] is then
also compared with the host's rivals (`paired_device`, and its own sweep). `--control` adds
"cost (again)", the same policy a second time: the spread of cost's ratio against it is what the bench reads
between identical policies (an A/A comparison; the bootstrap over cycles treats cycles as independent, while the
text each policy's rounds decode differs, and its difficulty drifts slowly).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dspark_policies import _testbed, ensure_calibration, prompt_sets, request_params, run_order  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STALL_FACTOR = 5.0


def interleaved(llm: Any, policies: list[tuple[str, Any]], prompts: list[list[int]], sp: list, *, skip: int,
                warm_cycles: int, cycles: int, seed: int) -> dict[str, Any]:
    """Rounds of every policy in a full batch of `prompts` (module docstring): {"rounds": {name: [[tokens, seconds,
    cycle, verified drafts, policy host seconds, decided on the device (0 / 1), verify rows (0: none), host seconds
    of the device decision's plan and launch, warm-up seconds, deferred seconds, lagged-search seconds], ...]},
    "dropped": cycles dropped for a capture, "stalled": cycles dropped for a stall}. A name ending in "[device]"
    decides on the device, the others on the host. The requests are dropped afterwards."""
    eng = llm.engine
    dec = eng.runner.spec
    graphs = eng.runner.cuda_graphs
    cuda = eng.runner.device.type == "cuda"
    ids = llm._add(llm._admit(prompts, sp))
    rounds: dict[str, list[list[float]]] = {name: [] for name, _ in policies}
    cycles_got: list[list[tuple]] = []
    dropped = 0
    try:
        for _ in range(skip):  # the prompts' prefill and the first rounds
            eng.step_outputs()
        if cuda:
            torch.cuda.synchronize()
        # a round's time: from the previous step's return to its own (no sync between rounds: the draft pass a
        # round launches for the next one overlaps the host's bookkeeping, as in a run of one policy)
        last = time.perf_counter()
        for c in range(-warm_cycles, cycles):
            cap0 = graphs.stats.capture_s if graphs is not None else 0.0
            pre0 = eng.total.prefill_tokens
            got = []
            for i in run_order(len(policies), seed, c + warm_cycles):
                name, pol = policies[i]
                dec.policy = pol  # the policy only (module docstring)
                dec.decide_on_device = name.endswith("[device]")
                tok0, ver0 = eng.total.decode_tokens, dec.stats.num_verified_tokens
                host0, decided0, plan0 = dec.timing.policy_s + dec.timing.lag_s, dec.timing.decided, dec.timing.decide_s
                other0 = (dec.timing.warm_s, dec.timing.deferred_s, dec.timing.lag_s)
                seen0 = {r: c for r, (c, _) in dec.timing.by_rows.items()}
                eng.step_outputs()
                now = time.perf_counter()
                rows = next((r for r, (c, _) in dec.timing.by_rows.items() if c > seen0.get(r, 0)), 0)
                got.append((name, eng.total.decode_tokens - tok0, now - last, dec.stats.num_verified_tokens - ver0,
                            dec.timing.policy_s + dec.timing.lag_s - host0, dec.timing.decided - decided0, rows,
                            dec.timing.decide_s - plan0, dec.timing.warm_s - other0[0],
                            dec.timing.deferred_s - other0[1], dec.timing.lag_s - other0[2]))
                last = now
            if eng.total.prefill_tokens != pre0 or not eng.has_unfinished_requests():
                raise SystemExit("interleaved: a prefill step or a finished request fell inside the window; raise "
                                 "--new-tokens")
            if c < 0:
                continue
            if graphs is not None and graphs.stats.capture_s > cap0:
                dropped += 1
                continue
            cycles_got.append([(c, *g) for g in got])
    finally:
        eng.discard([i for i in ids if isinstance(i, str)])
    times = sorted(g[3] for cyc in cycles_got for g in cyc)
    limit = STALL_FACTOR * times[len(times) // 2] if times else math.inf
    stalled = 0
    for cyc in cycles_got:
        if max(g[3] for g in cyc) > limit:
            stalled += 1
            continue
        for c, name, tokens, seconds, *rest in cyc:
            rounds[name].append([tokens, seconds, c, *rest])
    return {"rounds": rounds, "dropped": dropped, "stalled": stalled}


def compare(rounds: dict[str, list[list[float]]], subject: str = "cost", resamples: int = 2000) -> dict[str, Any]:
    """Per policy: rounds, tokens, seconds, tokens/s over its rounds. Per rival of `subject`: subject's tokens/s
    over the rival's, both over the cycles they share, with a 95% bootstrap that resamples cycles (a cycle keeps
    its rounds together, so the pairing survives), and the cycles in which subject's round had the higher rate.
    Ratios of sums, not a mean of per-round ratios: a round's accepted tokens vary far more than its time."""
    out: dict[str, Any] = {"policies": {}, "paired": {}}
    for name, rs in rounds.items():
        tok, sec = sum(r[0] for r in rs), sum(r[1] for r in rs)
        out["policies"][name] = {"rounds": len(rs), "tokens": tok, "seconds": sec,
                                 "tokens_per_s": tok / sec if sec > 0 else None}
        if rs and len(rs[0]) > 4:
            out["policies"][name].update(verified_per_round=sum(r[3] for r in rs) / len(rs),
                                         policy_ms_per_round=1e3 * sum(r[4] for r in rs) / len(rs),
                                         ms_per_round=1e3 * sec / len(rs))
        if rs and len(rs[0]) > 5:
            out["policies"][name]["decided_on_device"] = sum(r[5] for r in rs) / len(rs)
        for i, key in ((7, "plan"), (8, "warm"), (9, "deferred"), (10, "lag")):
            if rs and len(rs[0]) > i:
                out["policies"][name][f"{key}_ms_per_round"] = 1e3 * sum(r[i] for r in rs) / len(rs)
    if subject not in rounds:
        return out
    mine = {int(r[2]): (r[0], r[1]) for r in rounds[subject]}
    rng = random.Random(0)
    for rival, rs in rounds.items():
        if rival == subject:
            continue
        pairs = [(mine[int(r[2])], (r[0], r[1])) for r in rs if int(r[2]) in mine]
        if not pairs or not all(a[1] > 0 and b[1] > 0 for a, b in pairs):
            continue

        def ratio(sample: list) -> float:
            ta, sa, tb, sb = (sum(x) for x in zip(*((a[0], a[1], b[0], b[1]) for a, b in sample)))
            return (ta / sa) / (tb / sb) if tb > 0 else math.inf

        boots = sorted(ratio(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
        out["paired"][rival] = {"ratio": ratio(pairs), "low": boots[int(0.025 * resamples)],
                                "high": boots[int(0.975 * resamples) - 1],
                                "ahead": sum(a[0] / a[1] > b[0] / b[1] for a, b in pairs), "cycles": len(pairs)}
    return out


def sweep(cells: list[dict[str, Any]], key: str = "paired") -> dict[str, dict[str, Any]]:
    """Per rival over the cells that pair it (`cell[key]`, `compare`'s "paired"): the geometric mean of the
    subject's ratio, its range, and the cells where the 95% interval lies above 1 (won), below 1 (lost) or holds 1
    (tied). A deployment sets one threshold for every load and temperature it meets, so the policy to prefer is
    the one that no fixed rival beats anywhere and that beats each rival somewhere, not the winner of one cell."""
    out: dict[str, dict[str, Any]] = {}
    rivals = dict.fromkeys(r for c in cells for r in c.get(key, {}))
    for rival in rivals:
        got = [c[key][rival] for c in cells if rival in c.get(key, {})]
        ratios = [g["ratio"] for g in got]
        out[rival] = {"cells": len(got), "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                      "min": min(ratios), "max": max(ratios), "won": sum(g["low"] > 1 for g in got),
                      "lost": sum(g["high"] < 1 for g in got), "tied": sum(g["low"] <= 1 <= g["high"] for g in got)}
    return out


def by_rows(rounds: dict[str, list[list[float]]], curve: Any, subject: str = "cost") -> list[dict[str, Any]]:
    """Per verify row bucket of the cell: its rounds and mean round milliseconds over every policy and over
    `subject`'s alone, beside `curve.predict(rows)` (the cost policy's price of a step of that bucket; None without
    a curve). A bucket the curve prices like its neighbour but whose rounds take longer is rows the policy thinks
    free."""
    out = []
    every = [r for rs in rounds.values() for r in rs if len(r) > 6 and r[6]]
    for rows in sorted({int(r[6]) for r in every}):
        mine = [r for r in rounds.get(subject, []) if len(r) > 6 and int(r[6]) == rows]
        alls = [r for r in every if int(r[6]) == rows]
        out.append({"rows": rows, "rounds": len(alls), "ms": 1e3 * sum(r[1] for r in alls) / len(alls),
                    f"{subject}_rounds": len(mine),
                    f"{subject}_ms": 1e3 * sum(r[1] for r in mine) / len(mine) if mine else None,
                    "curve_ms": 1e3 * curve.predict(rows) if curve is not None else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--threshold", type=float, nargs="*", default=[0.2, 0.5])
    ap.add_argument("--skip", type=int, default=4, help="untimed steps first (the prompts' prefill)")
    ap.add_argument("--warm-cycles", type=int, default=16,
                    help="untimed cycles: CUDA graphs of every policy's row buckets are captured here")
    ap.add_argument("--cycles", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=0,
                    help="tokens per request (default: enough for every round of the window)")
    ap.add_argument("--device-decision", action="store_true",
                    help="add NAME[device] for each policy but verify_all: its decision on the device while it drafts")
    ap.add_argument("--control", action="store_true", help="add the cost policy a second time (an A/A comparison)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from deepinfer_dspark import StepPadding, VerifyPolicy
    from deepinfer_engine import LLM, SamplingParams
    from deepinfer_engine.worker.cuda_graph import pick_bucket

    tb = _testbed()
    if not (args.ckpt / "testbed.json").exists():
        raise SystemExit(f"{args.ckpt}: no testbed; run scripts/dspark_testbed.py build --out {args.ckpt}")
    ensure_calibration(args.ckpt, tb)
    biggest = max(args.prompts)
    prompts_all = prompt_sets(args.ckpt, tb, [args.seed], biggest, args.prompt_len)[0]
    opts: dict[str, Any] = dict(device=args.device, max_num_seqs=biggest, enable_prefix_caching=False,
                                async_scheduling=False)
    if args.device != "cpu":
        opts["kv_cache_memory_bytes"] = 1 << 30
    llm = LLM(str(args.ckpt), speculative_config={"method": "dspark", "policy": "cost"}, **opts)
    dec = llm.engine.runner.spec
    policies = [("verify_all", VerifyPolicy(kind="verify_all"))]
    policies += [(f"threshold[{t}]", VerifyPolicy(kind="threshold", threshold=t)) for t in args.threshold]
    policies.append(("cost", VerifyPolicy(kind="cost", lagged=True)))  # as the engine runs it
    if args.device_decision:
        policies += [(f"{name}[device]", pol) for name, pol in policies if pol.kind != "verify_all"]
    if args.control:
        policies.append(("cost (again)", policies[[n for n, _ in policies].index("cost")][1]))
    rounds_per_request = args.skip + len(policies) * (args.warm_cycles + args.cycles) + 1
    new_tokens = args.new_tokens or rounds_per_request * (dec.block_size + 1)
    report: dict[str, Any] = {"device": str(llm.engine.runner.device), "torch": torch.__version__,
                              "settings": {k: str(v) for k, v in vars(args).items()}, "cells": []}
    for temp in args.temperature:
        for count in args.prompts:
            sp = request_params(SamplingParams(max_tokens=new_tokens, temperature=temp, ignore_eos=True,
                                               seed=args.seed), count)
            got = interleaved(llm, policies, prompts_all[:count], sp, skip=args.skip, warm_cycles=args.warm_cycles,
                              cycles=args.cycles, seed=args.seed)
            # the curve that priced this cell's steps, chosen as the engine chooses it (`SpecDecoder.padding`: the
            # graph batch bucket of the step's sequences; `latency_for`: that bucket's curve)
            bucket = pick_bucket(count, sorted(dec.graph_rows)) if dec.graph_rows else None
            curve = dec.latency_for(None if bucket is None else StepPadding(bucket, dec.graph_rows[bucket], ragged=True))
            cell = {"prompts": count, "temperature": temp, "dropped_cycles": got["dropped"],
                    "stalled_cycles": got["stalled"], **compare(got["rounds"]),
                    "by_rows": by_rows(got["rounds"], curve), "rounds": got["rounds"]}
            if args.device_decision:  # the decision on the device as the subject, against the host's rivals
                cell["paired_device"] = {r: v for r, v in compare(got["rounds"], "cost[device]")["paired"].items()
                                         if not r.endswith("[device]") and r != "cost"}
            report["cells"].append(cell)
            kept = args.cycles - got["dropped"] - got["stalled"]
            print(f"P={count} T={temp:g}: {kept} cycles ({got['dropped']} dropped for a capture, {got['stalled']} "
                  "for a stall)", flush=True)
            for name, p in cell["policies"].items():
                pair = cell["paired"].get(name)
                vs = (f"cost / it {pair['ratio']:.3f} ({pair['low']:.3f}-{pair['high']:.3f}), cost ahead in "
                      f"{pair['ahead']} of {pair['cycles']}") if pair else ""
                print(f"  {name:<22} {p['tokens_per_s'] or 0:>10,.0f} tok/s  {p.get('ms_per_round', 0):6.2f} ms "
                      f"{p.get('verified_per_round', 0):7.1f} verified {p.get('policy_ms_per_round', 0):5.3f} ms "
                      f"policy {p.get('decided_on_device', 0):4.0%} on device "
                      f"(+{p.get('plan_ms_per_round', 0):5.3f} ms plan; of it lag {p.get('lag_ms_per_round', 0):5.3f}; "
                      f"warm {p.get('warm_ms_per_round', 0):5.3f}, deferred {p.get('deferred_ms_per_round', 0):5.3f})"
                      f"  {vs}", flush=True)
            if "paired_device" in cell:
                print("  cost[device] / it: " + ", ".join(f"{r} {v['ratio']:.3f} ({v['low']:.3f}-{v['high']:.3f})"
                                                          for r, v in cell["paired_device"].items()), flush=True)
            for b in cell["by_rows"]:
                mine = f"{b['cost_ms']:6.2f} ms" if b["cost_ms"] is not None else "     -   "
                price = f"{b['curve_ms']:6.2f} ms" if b["curve_ms"] is not None else "-"
                print(f"  rows {b['rows']:>5}: {b['rounds']:4d} rounds {b['ms']:6.2f} ms; cost's {b['cost_rounds']:4d} "
                      f"rounds {mine}; cost's curve {price}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(report) + "\n")
    keys = [("cost", "paired")] + ([("cost[device]", "paired_device")] if args.device_decision else [])
    report["sweep"] = {subject: sweep(report["cells"], key) for subject, key in keys}
    print(f"over the {len(report['cells'])} cells (geometric mean, range; cells won / tied / lost at 95%):")
    for subject, rivals in report["sweep"].items():
        for rival, v in rivals.items():
            print(f"  {subject} / {rival:<22} {v['geomean']:.3f} ({v['min']:.3f}-{v['max']:.3f}); "
                  f"{v['won']} / {v['tied']} / {v['lost']} of {v['cells']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
