"""Where the device waits in a steady-state DSpark round: GPU idle time per round, attributed to the host phase that
was running while the device had nothing queued.

    python scripts/spec_timeline.py [--ckpt .cache/dspark-testbed] [--prompts 256] [--temperature 1 0]
        [--policy verify_all cost] [--skip 6] [--steps 12] [--out-dir DIR]

One engine with speculation (the cost policy's start-up profile; other policies switched in as the benchmark does),
a full batch in steady state (`bench_dspark_policies._steady`), and one torch profile per (temperature, policy) with
every phase of `spec_round_time.PHASES` (and `step`, one engine step) as a `record_function` range. From the trace:
the union of the device's kernel / copy / memset intervals over the window's steps is its busy time; the rest of
the window is idle, and each idle microsecond goes to the innermost host phase open at that moment ("(none)": host
work outside every named phase). A synchronous round whose device idles for a large share of its wall time is
host-bound: work cut from the device then changes little, and the idle phases are what to move off the critical
path. `--out-dir` also keeps each chrome trace (gzip) and the table as JSON.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dspark_policies import (  # noqa: E402
    _steady,
    _testbed,
    apply_policy,
    ensure_calibration,
    prompt_sets,
    request_params,
)
from phase_timer import wrap_phases  # noqa: E402
from spec_round_time import PHASES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP = ("step", "deepinfer_engine.llm_engine", "LLMEngine", "step_outputs")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _ranged(name: str, fn: Any) -> Any:
    """fn inside a `record_function` range named after its phase."""

    @functools.wraps(fn)
    def ranged(*a: Any, **kw: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*a, **kw)

    return ranged


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def idle_by_phase(trace: dict, skip: int, names: set[str]) -> dict[str, Any]:
    """The window's steps (after `skip`): wall, device busy, and device idle split by the innermost open phase."""
    ev = trace["traceEvents"]
    ann = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"] in names]
    steps = sorted((e for e in ann if e["name"] == "step"), key=lambda e: e["ts"])[skip:]
    if not steps:
        raise SystemExit("spec_timeline: no step ranges in the window; raise --steps")
    t0, t1 = steps[0]["ts"], max(s["ts"] + s["dur"] for s in steps)
    dev = _union([(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS
                  and e["ts"] + e["dur"] > t0 and e["ts"] < t1])
    busy = sum(min(e, t1) - max(s, t0) for s, e in dev)
    gaps, cur = [], t0
    for s, e in dev:
        if s > cur:
            gaps.append((cur, min(s, t1)))
        cur = max(cur, e)
        if cur >= t1:
            break
    if cur < t1:
        gaps.append((cur, t1))
    # host phases on the engine's thread nest, so the innermost open range is the latest-starting one
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ann if e["ts"] + e["dur"] > t0 and e["ts"] < t1),
                  key=lambda r: (r[0], -r[1]))
    idle: dict[str, float] = {}
    for gs, ge in gaps:
        points = sorted({gs, ge, *(t for s, e, _ in host for t in (s, e) if gs < t < ge)})
        for a, b in zip(points, points[1:]):
            mid = 0.5 * (a + b)
            name = "(none)"
            for s, e, n in host:
                if s > mid:
                    break
                if e > mid and n != "step":
                    name = n
            idle[name] = idle.get(name, 0.0) + (b - a)
    n = len(steps)
    return {"steps": n, "wall_us_per_step": (t1 - t0) / n, "busy_us_per_step": busy / n,
            "idle_us_per_step": (t1 - t0 - busy) / n,
            "idle_by_phase_us_per_step": {k: v / n for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}}


def host_profile(llm: Any, prompts: list, sp: Any, skip: int, steps: int, top: int) -> str:
    """cProfile of a steady window (printed and returned): own time, then deepinfer's inclusive time."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    orig = llm.engine.step_outputs

    def profiled() -> Any:
        pr.enable()
        try:
            return orig()
        finally:
            pr.disable()

    llm.engine.step_outputs = profiled
    try:
        _steady(llm, prompts, sp, skip, steps)
    finally:
        del llm.engine.step_outputs
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats("deepinfer", top)
    print(buf.getvalue(), flush=True)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--policy", nargs="+", default=["verify_all", "cost"], choices=("verify_all", "threshold", "cost"))
    ap.add_argument("--threshold", type=float, default=0.2)
    ap.add_argument("--skip", type=int, default=6, help="untimed steps before the window (prefill, first rounds)")
    ap.add_argument("--steps", type=int, default=12, help="steps in the profiled window")
    ap.add_argument("--engine-option", action="append", default=[], help="extra LLM option key=value (JSON value)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="after each trace, a cProfile of another window: the N functions with the most own time "
                         "and the N deepinfer functions with the most inclusive time (the host work the idle "
                         "phases hold)")
    ap.add_argument("--no-cost-profile", action="store_true",
                    help="load without the cost policy's start-up latency profile (a fixed affine curve: faster; "
                         "the cost policy then prices steps by that line)")
    ap.add_argument("--out-dir", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("spec_timeline: needs a CUDA device (the device timeline is what it reads)")

    from deepinfer_dspark import VerifyPolicy
    from deepinfer_engine import LLM, SamplingParams

    tb = _testbed()
    ensure_calibration(args.ckpt, tb)
    prompts = prompt_sets(args.ckpt, tb, [args.seed], args.prompts, args.prompt_len)[0]
    extra = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.engine_option)}
    spec_cfg: dict[str, Any] = {"method": "dspark", "policy": "cost"}
    if args.no_cost_profile:
        spec_cfg["latency"] = "affine:0.003,0.000002"
    llm = LLM(str(args.ckpt), speculative_config=spec_cfg, device="cuda",
              max_num_seqs=args.prompts, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30, **extra)
    dec = llm.engine.runner.spec
    profiled = (dec.latency.fresh(), {b: c.fresh() for b, c in dec.batch_latency.items()})
    pols = {"verify_all": (VerifyPolicy(kind="verify_all"), None),
            "threshold": (VerifyPolicy(kind="threshold", threshold=args.threshold), None),
            "cost": (VerifyPolicy(kind="cost", lagged=True), "profile")}
    wrap_phases((*PHASES, STEP), _ranged)
    tokens = (args.skip + args.steps + 2) * (dec.block_size + 1)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "prompts": args.prompts, "skip": args.skip, "steps": args.steps, "runs": {}}
    names = {p[0] for p in PHASES} | {"step"}
    tmp = Path(tempfile.mkdtemp())
    for temp in args.temperature:
        sp = request_params(SamplingParams(max_tokens=tokens, temperature=temp, ignore_eos=True, seed=args.seed),
                            len(prompts))
        for pname in args.policy:
            pol, curve = pols[pname]
            for _ in range(2):  # compiles, captures and the lagged policy's first shapes
                apply_policy(dec, pol, curve, profiled)
                _steady(llm, prompts, sp, args.skip, args.steps)
            apply_policy(dec, pol, curve, profiled)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                n, dt, _, _ = _steady(llm, prompts, sp, args.skip, args.steps)
                torch.cuda.synchronize()
            path = tmp / f"trace_{pname}_T{temp:g}.json"
            prof.export_chrome_trace(str(path))
            res = idle_by_phase(json.loads(path.read_text()), args.skip, names)
            res.update(tok_s=n / dt, tau=dec.stats.as_dict().get("mean_accepted_length"), timing=dec.timing.as_dict())
            report["runs"][f"{pname} T={temp:g}"] = res
            print(f"\n{pname}, T={temp:g}: {res['wall_us_per_step']:,.0f} µs per step, device busy "
                  f"{res['busy_us_per_step']:,.0f}, idle {res['idle_us_per_step']:,.0f} "
                  f"({res['idle_us_per_step'] / res['wall_us_per_step']:.0%}); {res['tok_s']:,.0f} tok/s under the profiler, "
                  f"tau {res['tau']}", flush=True)
            for k, v in res["idle_by_phase_us_per_step"].items():
                if v >= 20:
                    print(f"    idle {v:>8,.0f} µs  in {k}")
            if args.cprofile:
                res["cprofile"] = host_profile(llm, prompts, sp, args.skip, args.steps, args.cprofile)
            if args.out_dir:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                with path.open("rb") as src, gzip.open(args.out_dir / (path.name + ".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
    if args.out_dir:
        (args.out_dir / "spec_timeline.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
