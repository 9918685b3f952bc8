"""DSpark verification policies through the engine (`LLM(..., speculative_config=...)`) on the trained testbed:
mean accepted length, verified draft tokens per step and tokens/s per policy, over several held-out prompt sets.

    python scripts/bench_dspark_policies.py --ckpt .cache/dspark-testbed --json policies.json

One engine load with speculation (policy switched between runs) and one without (the plain-decoding baseline).
The checkpoint is the one `scripts/dspark_testbed.py build` writes, with its Confidence Head calibration beside the
weights (`dspark_confidence.safetensors`, `dspark_sts.json`; the engine reads both). The prefix cache is off (the
same prompts run once per policy).
The cost policy's latency curve is the engine's own: the target forward timed at start-up on this device and
corrected online. Prints a table (mean and min..max over prompt sets) and, with --json, the per-run rows, the
profiled curve (raw medians, non-decreasing fit, noise, flat), the per-round host timing of the speculative
steps (draft pass / verify step / bookkeeping / the rest of the step) and the CUDA-graph counts of both engines.
`--sync-report N` adds, per policy, short speculative runs of N prompts: the synchronising calls per round and per
source line (torch's sync debug mode, CUDA) and the torch ops launched outside the graphed forwards per round.
`--async-scheduling both` loads each engine twice, with synchronous and with asynchronous scheduling
(`async_scheduling=False / True`), and times plain decoding and every policy in both (rows "NAME+async");
`--prompts 32 128` runs both batch sizes on the same engines (max_num_seqs = the largest).
`--steady 48` times a window of 48 engine steps with the whole batch decoding instead of whole generate calls: a
saturated server's throughput, (requests x mean accepted length) / round time, where a closed batch's time follows
its slowest request. With several batch sizes or temperatures, the run ends with cost against each rival over every
cell and repeat (`suite_comparison`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]


def _testbed():
    spec = importlib.util.spec_from_file_location("dspark_testbed", ROOT / "scripts" / "dspark_testbed.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dspark_testbed"] = mod
    spec.loader.exec_module(mod)
    return mod


def ensure_calibration(ckpt: Path, tb) -> dict:
    """The Confidence Head calibration beside the weights (`dspark_confidence.safetensors` + `dspark_sts.json`,
    written by the testbed build; fitted here for a checkpoint built before it existed)."""
    if not (ckpt / "dspark_confidence.safetensors").exists() or not (ckpt / "dspark_sts.json").exists():
        cfg = {**tb.BUILD_DEFAULTS, **json.loads((ckpt / "testbed.json").read_text())["settings"]}
        tb.calibrate_confidence(ckpt, cfg)
    return json.loads((ckpt / "dspark_sts.json").read_text())


def prompt_sets(ckpt: Path, tb, seeds: list[int], count: int, length: int) -> list[list[list[int]]]:
    out = []
    for s in seeds:
        rows = tb.sequences(tb.tokenize(tb.corpus_sentences(s, 30 * count), ckpt / "tokenizer.json"), length)
        out.append([r.tolist() for r in rows[:count]])
    return out


def run_order(count: int, seed: int, repeat: int) -> list[int]:
    """The order in which repeat `repeat` times its `count` runs (plain, then each policy: indices 0 .. count - 1),
    shuffled by a generator seeded from (seed, repeat): reproducible, and no policy keeps one position in every
    repeat. With a fixed order, cost ran last and right after threshold 0.5 in every repeat, and whatever the host
    does on that schedule (a slow spell lasts about one run on the H200) fell on the same policy each time."""
    import random

    from deepinfer_engine.engine import mix_seed

    order = list(range(count))
    random.Random(mix_seed(seed, repeat)).shuffle(order)
    return order


def request_params(sp: Any, count: int) -> list:
    """One SamplingParams per request, each with its own seed derived from sp's (`mix_seed(seed, i)`; sp may
    already be a list). A seed is per request (the same seed gives the same uniforms at the same positions), so one
    seed shared by the whole batch would make every request draw the same uniforms: at temperature 1 the batch is
    then one random path replicated, and its acceptance and calibration read that path's luck (on the testbed,
    position-1 acceptance 0.85-0.89 with one shared seed against 0.757 with a seed per request, the same 0.76 the
    analytic acceptance gives)."""
    from deepinfer_engine.engine import mix_seed

    params = list(sp) if isinstance(sp, list) else [sp] * count
    return [p if p.seed is None else p.replace(seed=mix_seed(p.seed, i)) for i, p in enumerate(params)]


def output_lengths(count: int, longest: int, spread: float, seed: int) -> list[int]:
    """`count` output lengths drawn uniformly from [max(1, round((1 - spread) * longest)), longest]."""
    import random

    if not 0.0 <= spread <= 1.0:
        raise SystemExit(f"--length-spread: expected a fraction in [0, 1], found {spread}")
    rng = random.Random(seed)
    return [rng.randint(max(1, round((1.0 - spread) * longest)), longest) for _ in range(count)]


def latency_info(lat) -> dict:
    return {"sizes": list(lat.sizes), "ms": [round(t * 1e3, 3) for t in lat.seconds],
            "measured_ms": None if lat.measured is None else [round(t * 1e3, 3) for t in lat.measured],
            "noise_ms": round(lat.noise * 1e3, 3), "overhead_ms": round(lat.overhead * 1e3, 3),
            "floor_ms": round(lat.floor * 1e3, 3), "flat": lat.flat()}


def graph_info(llm) -> dict | None:
    g = llm.engine.runner.cuda_graphs
    if g is None:
        return None
    st = g.stats
    return {"captures": st.captures, "replays": st.replays, "eager_steps": st.eager_steps,
            "verify_captures": st.verify_captures, "verify_replays": st.verify_replays,
            "verify_eager_steps": st.verify_eager_steps, "verify_padded": st.verify_padded,
            "draft_captures": st.draft_captures,
            "draft_replays": st.draft_replays, "capture_s": round(st.capture_s, 3),
            "pool_bytes": g.pool_bytes(), "output_bytes": g.output_bytes(),
            "failed": {str(k): v for k, v in g.failed.items()}}


def reprofile(llm):
    """The engine's start-up latency profile (`build_spec_decoder`), timed again on a warm engine: (T(Q), {batch
    bucket: its curve})."""
    from deepinfer_engine.worker.spec_profile import profile_cost_curves

    eng = llm.engine
    return profile_cost_curves(eng.runner.model, eng.runner.cache, eng.runner.cuda_graphs, eng.config,
                    eng.runner.spec.block_size, eng.runner.cache.num_pages, eng.runner.device)


# the forwards a CUDA graph replays (model/model.py, model/dspark.py): their ops are launched by the replay, not
# one by one, so the host report counts the torch ops launched outside them
_GRAPHED = {("model.py", "forward"), ("model.py", "forward_features"), ("dspark.py", "draft_block")}


class _OpCounter(TorchDispatchMode):
    """Counts the torch ops (views included) launched outside the graphed forwards, per source file of the project
    (the innermost deepinfer frame); `inside` counts those of the graphed forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: dict[str, int] = {}
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, where = sys._getframe(1), None
        while frame is not None:
            path = frame.f_code.co_filename
            name = os.path.basename(path)
            if "deepinfer" in path and "site-packages/torch" not in path:
                if (name, frame.f_code.co_name) in _GRAPHED and "deepinfer_engine/model" in path:
                    self.inside += 1
                    break
                where = where or name
            frame = frame.f_back
        else:
            key = where or "?"
            self.outside[key] = self.outside.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def sync_report(llm, prompts, sp) -> dict:
    """Per speculative round of one generation: the synchronising CUDA calls per source line (torch's sync debug
    mode warns on each; CUDA only) and the torch ops launched outside the graphed forwards, per file (a second run
    under a dispatch mode; on the CPU nothing is graphed, so `graphed_ops` are the forwards' eager ops)."""
    import collections
    import warnings

    spec = llm.engine.runner.spec
    cuda = llm.engine.runner.device.type == "cuda"
    counts: collections.Counter = collections.Counter()
    out: dict[str, Any] = {}
    if cuda:
        spec.reset_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.generate(prompts, sp, use_tqdm=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                counts[f"{Path(w.filename).name}:{w.lineno}"] += 1
        steps = max(spec.stats.steps, 1)
        out = {"spec_rounds": spec.stats.steps, "total": sum(counts.values()),
               "syncs_per_round": round(sum(counts.values()) / steps, 2),
               "per_round": {k: round(v / steps, 2) for k, v in counts.most_common()}}
    spec.reset_stats()
    mode = _OpCounter()
    with mode:
        llm.generate(prompts, sp, use_tqdm=False)
    steps = max(spec.stats.steps, 1)
    out.update({"op_rounds": spec.stats.steps, "eager_ops_per_round": round(sum(mode.outside.values()) / steps, 1),
                "eager_ops_by_file": {k: round(v / steps, 1) for k, v in
                                      sorted(mode.outside.items(), key=lambda kv: -kv[1])},
                "graphed_ops_per_round": round(mode.inside / steps, 1)})
    return out


def _steady(llm, prompts, sp, skip: int, steps: int) -> tuple[int, float, list[list[int]], float]:
    """(decode tokens, seconds, outputs so far, CUDA-graph capture seconds within them) of `steps` engine steps after `skip` untimed ones, every request
    still running (sp.max_tokens must outlast them): a full batch in steady state, as a saturated server runs,
    with neither the prompts' prefill nor the batch's tail (where the slowest request sets the time) in the
    window. The requests are dropped afterwards."""
    eng = llm.engine
    ids = llm._add(llm._admit(prompts, sp if isinstance(sp, list) else [sp] * len(prompts)))
    outs: dict[str, list[int]] = {}
    try:
        for _ in range(skip):
            eng.step_outputs()
        spec = eng.runner.spec
        if spec is not None:
            spec.reset_stats()
        if eng.runner.device.type == "cuda":
            torch.cuda.synchronize()
        graphs = eng.runner.cuda_graphs
        cap0 = graphs.stats.capture_s if graphs is not None else 0.0
        pre0, dec0 = eng.total.prefill_tokens, eng.total.decode_tokens
        t0 = time.perf_counter()
        for _ in range(steps):
            for o in eng.step_outputs().request_outputs:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        if eng.runner.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if eng.total.prefill_tokens != pre0 or not eng.has_unfinished_requests():
            raise SystemExit("--steady: a prefill step or a finished request fell inside the timed window; "
                             "raise --steady-skip or --new-tokens")
        cap = (graphs.stats.capture_s if graphs is not None else 0.0) - cap0
        return eng.total.decode_tokens - dec0, dt, [outs.get(i, []) for i in ids], cap
    finally:
        eng.discard([i for i in ids if isinstance(i, str)])


def run(llm, prompts, sp, steady: tuple[int, int] | None = None) -> tuple[float, dict | None, list[list[int]]]:
    """(tokens/s, statistics, outputs) of one generate. A CUDA graph captured during the run (lazily, on the
    first step of a shape the warm runs did not meet: the cost policy's row buckets follow its online curve) is
    a one-time cost of seconds against runs of a fraction of a second: its time is taken out of the run's wall
    time and reported as `capture_s`. steady (skip, steps): only a window of steps with the batch full
    (`_steady`)."""
    spec = llm.engine.runner.spec
    graphs = llm.engine.runner.cuda_graphs
    if spec is not None:
        spec.reset_stats()
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    # the previous run's garbage collected now, untimed: a full collection inside a run of about a second took
    # about 110 ms with the start-up heap unfrozen (docs/perf.md, "Host work of a speculative round")
    gc.collect()
    cap0 = graphs.stats.capture_s if graphs is not None else 0.0
    log0 = len(graphs.stats.capture_log) if graphs is not None else 0
    if steady is not None:
        n, dt, toks, cap_window = _steady(llm, prompts, sp, *steady)
        captured = (graphs.stats.capture_s if graphs is not None else 0.0) - cap0
        dt -= cap_window  # a capture in the skipped steps was never in the window's time
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if llm.engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        captured = (graphs.stats.capture_s if graphs is not None else 0.0) - cap0
        dt = time.perf_counter() - t0 - captured
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        toks = [list(o.outputs[0].token_ids) for o in outs]
    st = None
    if spec is not None:
        timing = spec.timing.as_dict()
        if spec.timing.rounds:  # the run's wall time per round: the three parts, the scheduler and the prefill steps
            timing["wall_per_round_ms"] = 1e3 * dt / spec.timing.rounds
        st = {**spec.stats.as_dict(), "timing": timing, "wall_s": dt, "capture_s": captured,
              "captured": [] if graphs is None else [[k, list(s), round(t, 3)] for k, s, t in
                                                     graphs.stats.capture_log[log0:]]}
    return n / dt, st, toks


def warm_up(llm, prompts, sp, runs: int, extra: int, setup: Any = None, steady: tuple[int, int] | None = None) -> int:
    """`runs` untimed runs, then up to `extra` more while the last one captured a CUDA graph: a shape first met
    late in a run (a longer length bucket, a row bucket the cost policy's online curve moved to) would otherwise be
    captured inside a timed run. setup: called before each run, as before a timed one (a policy's fresh curve).
    Returns the number of runs made."""
    graphs = llm.engine.runner.cuda_graphs
    made, captured = 0, False
    while made < runs or (captured and made < runs + extra):
        before = graphs.stats.capture_s if graphs is not None else 0.0
        if setup is not None:
            setup()
        run(llm, prompts, sp, steady)
        made += 1
        captured = graphs is not None and graphs.stats.capture_s > before
    return made


def apply_policy(dec: Any, pol: Any, curve: str | None, profiled: Any) -> Any:
    """Set the decoder's policy for one run: fresh copies of the profiled curves (T(Q) and the batch buckets',
    `profiled` = (T(Q), {bucket: curve}); corrected online during the run) for "profile", T(Q) alone for
    "profile-tq", a fixed affine curve for "BASE,SLOPE", none otherwise. A "+no-ahead" suffix turns the decoder's
    draft-ahead off for the run (`SpecDecoder.draft_ahead`; otherwise it is as the engine built it). Returns the
    curves of a profiled run."""
    from deepinfer_dspark import LatencyModel

    curve, _, flag = (curve or "").partition("+")
    # the engine turns draft-ahead on exactly when verify steps replay CUDA graphs (`build_spec_decoder`)
    dec.draft_ahead = dec.graph_rows is not None and flag != "no-ahead"
    curve = curve or None
    if curve in ("profile", "profile-tq"):
        lat = profiled[0].fresh()
        by_batch = {b: c.fresh() for b, c in profiled[1].items()} if curve == "profile" else {}
        dec.set_policy(pol, lat, online_latency=True, batch_latency=by_batch)
        return lat, by_batch
    if curve is not None:
        base, slope = (float(x) for x in curve.split(","))
        dec.set_policy(pol, LatencyModel.affine(base, slope, 8192), online_latency=False)
    else:
        dec.set_policy(pol)
    return None


def curves_info(curves) -> dict:
    """T(Q) and the batch buckets' curves (`apply_policy`'s pair) as JSON."""
    lat, by_batch = curves
    return {**latency_info(lat), "by_batch": {b: latency_info(c) for b, c in sorted(by_batch.items())}}


def main(argv: list[str] | None = None) -> int:
    from deepinfer_dspark import VerifyPolicy
    from deepinfer_engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, nargs="+", default=[64],
                    help="prompts per set (several: each batch size on the same engines)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engines' batch limit (default: the largest prompt count). Fewer than the prompts keeps "
                         "a queue: a finished request's slot goes to a waiting one, so the batch stays full until "
                         "the queue drains, as in serving, and a run's time follows the mean accepted length rather "
                         "than its slowest request")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--steady", type=int, default=0, metavar="STEPS",
                    help="time only STEPS engine steps with the whole batch decoding (after --steady-skip untimed "
                         "ones; every request gets enough max_tokens to outlast them): the throughput of a saturated "
                         "server, where a run's time follows the mean accepted length, not its slowest request "
                         "(0 = whole generate calls)")
    ap.add_argument("--steady-skip", type=int, default=4)
    ap.add_argument("--ahead-ab", action="store_true",
                    help="also run verify_all and cost with draft-ahead off (rows NAME[no-ahead]): the next round's "
                         "drafts launched in the round instead of at the previous round's read")
    ap.add_argument("--cost-variants", nargs="*", choices=("global", "tq", "sync"), default=[],
                    help="more cost-policy runs: global (exact=False: the argmax over row buckets at every "
                         "temperature; with sampling it anticipates the drafts, so its outputs are not exact: a "
                         "measurement of what the bucket argmax gains over the early-stop search, not a setting to "
                         "serve with); tq (every step priced by the T(Q) curve alone, without the batch buckets' "
                         "curves: what those curves change); sync (the search on each round's own survivals, in the "
                         "round, instead of the engine's lagged cutoff)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1000, 2000, 3000], help="held-out corpus seeds")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="0: every request decodes --new-tokens; F in (0, 1]: request i decodes a length drawn "
                         "uniformly from [(1 - F) * new_tokens, new_tokens] (seeded by the prompt set), so the batch "
                         "shrinks during a run as it does in serving")
    ap.add_argument("--threshold", type=float, nargs="+", default=[0.2])
    ap.add_argument("--affine", nargs="*", default=[], metavar="BASE,SLOPE",
                    help="extra cost-policy runs with a fixed T(Q) = BASE + SLOPE * Q (seconds; no online correction): "
                         "the policy as it would act on a device with that per-token cost")
    ap.add_argument("--no-profile", action="store_true", help="skip the cost run with the profiled curve")
    ap.add_argument("--heads", choices=("shipped", "checkpoint", "raw"), default="shipped",
                    help="Confidence Head calibration: shipped greedy head + STS sets (what the engine loads), the "
                         "checkpoint's head alone with its STS sets, or the raw checkpoint head")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, the engine's auto elsewhere)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA: no CUDA graphs (decode, verify and draft passes all run eagerly)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per policy and prompt set, round-robin over the policies; the median is reported")
    ap.add_argument("--warm-runs", type=int, default=1,
                    help="untimed runs of the same requests before each timed run (plain and every policy), so "
                         "that CUDA-graph captures and kernel compiles of its step shapes are not timed")
    ap.add_argument("--extra-warm-runs", type=int, default=3,
                    help="more untimed runs, at most this many, while the last one still captured a CUDA graph")
    ap.add_argument("--reprofile", action="store_true",
                    help="after the runs, time the start-up latency profile again on the warm engine")
    ap.add_argument("--async-scheduling", choices=("default", "off", "on", "both"), default="default",
                    help="the engines' scheduling: the engine's default (CUDA: asynchronous for plain decoding, "
                         "synchronous with speculation), synchronous, asynchronous (async_scheduling=True), or both "
                         "(each engine loaded twice; rows of the asynchronous engines are named NAME+async)")
    ap.add_argument("--kv-cache-bytes", default=None,
                    help="cache bytes per engine (default: 1GiB on CUDA, where the engine's default would give the "
                         "first engine 90%% of the free memory; the engine's default elsewhere)")
    ap.add_argument("--sync-report", type=int, default=0, metavar="PROMPTS",
                    help="per policy, a speculative run of this many prompts: synchronising calls per round (CUDA) "
                         "and torch ops launched outside the graphed forwards per round (0 = off)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tb = _testbed()
    if not (args.ckpt / "testbed.json").exists():
        raise SystemExit(f"{args.ckpt}: no testbed checkpoint; run scripts/dspark_testbed.py build --out {args.ckpt}")
    sts = ensure_calibration(args.ckpt, tb)
    biggest = max(args.prompts)
    sets = prompt_sets(args.ckpt, tb, args.seeds, biggest, args.prompt_len)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    cache_bytes = args.kv_cache_bytes or ("1GiB" if cuda else None)
    if cache_bytes is not None:
        from deepinfer_engine.config import parse_bytes

        cache_bytes = parse_bytes(cache_bytes)
    # no prefix cache: every policy reruns the same prompts, and a hit skips the prompt rows that fill the draft
    # rings (docs/prefix_cache.md), which would lower acceptance from the second run on
    common = dict(device=args.device, dtype=args.dtype or ("float32" if args.device == "cpu" else "auto"),
                  max_num_seqs=args.max_num_seqs or biggest, num_cpu_threads=args.threads, enable_prefix_caching=False,
                  enforce_eager=True if args.enforce_eager else None, kv_cache_memory_bytes=cache_bytes)
    common = {k: v for k, v in common.items() if v is not None}
    modes = {"default": [None], "off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    plains, specs, decs, curves = {}, {}, {}, {}
    for mode in modes:
        sched = {} if mode is None else {"async_scheduling": mode}
        plains[mode] = LLM(str(args.ckpt), **sched, **common)
        t_load = time.perf_counter()
        specs[mode] = LLM(str(args.ckpt), speculative_config={"method": "dspark", "policy": "cost"}, **sched, **common)
        print(f"speculative engine loaded in {time.perf_counter() - t_load:.1f} s (the cost policy's profile included)",
              flush=True)
        dec = decs[mode] = specs[mode].engine.runner.spec
        if args.heads != "shipped":  # compare: the checkpoint's head alone (with its STS sets), or uncalibrated
            dec.drafter.set_heads(**tb.shipped_heads(args.ckpt, args.heads))
        prof = curves[mode] = (dec.latency.fresh(), {b: c.fresh() for b, c in dec.batch_latency.items()})
        print(f"profiled T(Q){' async' if mode else ''}: " + json.dumps(curves_info(prof)), flush=True)
    spec_llm, dec, profiled = specs[modes[0]], decs[modes[0]], curves[modes[0]]
    policies = [("verify_all", VerifyPolicy(kind="verify_all"), None)]
    policies += [(f"threshold[{t}]", VerifyPolicy(kind="threshold", threshold=t), None) for t in args.threshold]
    if not args.no_profile:
        policies.append(("cost", VerifyPolicy(kind="cost", lagged=True), "profile"))  # as the engine runs it
        variants = {"global": (VerifyPolicy(kind="cost", exact=False), "profile"),
                    "tq": (VerifyPolicy(kind="cost", lagged=True), "profile-tq"),
                    "sync": (VerifyPolicy(kind="cost"), "profile")}
        policies += [(f"cost[{v}]", *variants[v]) for v in args.cost_variants]
    policies += [(f"cost[{a}]", VerifyPolicy(kind="cost", lagged=True), a) for a in args.affine]
    if args.ahead_ab:  # the same policies with the next round's drafts launched in `begin` instead
        policies += [("verify_all[no-ahead]", VerifyPolicy(kind="verify_all"), "+no-ahead")]
        if not args.no_profile:
            policies.append(("cost[no-ahead]", VerifyPolicy(kind="cost", lagged=True), "profile+no-ahead"))
    # warm-up at the measured batch size and both modes: Triton compiles per shape, and the first run would pay it
    for temp in args.temperature:
        warm = request_params(SamplingParams(max_tokens=12, temperature=temp, ignore_eos=True, seed=7), len(sets[0]))
        for mode in modes:
            plains[mode].generate(sets[0], warm, use_tqdm=False)
            specs[mode].generate(sets[0], warm, use_tqdm=False)
    # what the engines hold from start-up stays alive for the whole benchmark: out of the collector's reach, a
    # full collection scans only what the runs allocate (what a long-running server does after start-up)
    gc.collect()
    gc.freeze()
    rows = []
    suffix = {None: "", False: "", True: "+async"}
    for temp in args.temperature:
        for count in args.prompts:
            for si, full in enumerate(sets):
                prompts = full[:count]
                new_tokens = args.new_tokens
                if args.steady:  # no request may finish inside the window (a round emits up to block + 1 tokens)
                    new_tokens = max(new_tokens, (args.steady_skip + args.steady + 1) * (dec.block_size + 1))
                sp = SamplingParams(max_tokens=new_tokens, temperature=temp, ignore_eos=True,
                                    seed=args.seeds[si])
                if args.length_spread > 0 and not args.steady:  # mixed output lengths: the batch thins out as requests finish
                    sp = [sp.replace(max_tokens=n) for n in output_lengths(count, args.new_tokens, args.length_spread,
                                                                           args.seeds[si])]
                sp = request_params(sp, count)  # a seed per request (`request_params`)
                steady = (args.steady_skip, args.steady) if args.steady else None
                for mode in modes:
                    warm_up(plains[mode], prompts, sp, args.warm_runs, args.extra_warm_runs, steady=steady)
                    for _name, pol, curve in policies:
                        # untimed runs of the same requests first: each policy verifies its own numbers of
                        # drafts, so it meets (batch, length, drafts) step shapes whose CUDA graphs / Triton
                        # kernels the others did not compile, and the first run would pay that (measured:
                        # seconds per policy)
                        warm_up(specs[mode], prompts, sp, args.warm_runs, args.extra_warm_runs,
                             setup=functools.partial(apply_policy, decs[mode], pol, curve, curves[mode]),
                             steady=steady)
                # timed runs round-robin over plain and the policies (and the scheduling modes), `--repeats`
                # times: one run is a fraction of a second, so clock and host noise between runs would otherwise
                # decide the ranking; each repeat in its own order (`run_order`)
                timed: dict[str, list] = {}
                ref = None
                for rep in range(args.repeats):
                    for mode in modes:
                        for i in run_order(1 + len(policies), args.seeds[si], rep):
                            if i == 0:
                                tps, _, out = run(plains[mode], prompts, sp, steady)
                                ref = ref or out  # the synchronous plain run when there is one
                                timed.setdefault("plain" + suffix[mode], []).append((tps, None, None, None))
                                continue
                            name, pol, curve = policies[i - 1]
                            lat = apply_policy(decs[mode], pol, curve, curves[mode])
                            timed.setdefault(name + suffix[mode], []).append((*run(specs[mode], prompts, sp, steady), lat))
                all_tps = {name: [t[0] for t in runs] for name, runs in timed.items()}
                for mode in modes:
                    pname = "plain" + suffix[mode]
                    rows.append({"policy": pname, "temperature": temp, "seed": args.seeds[si], "prompts": count,
                                 "async": mode, "tokens_per_s": statistics.median(all_tps[pname]),
                                 "tokens_per_s_all": all_tps[pname]})
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                          flush=True)
                for mode, (name, _pol, _curve) in [(m, p) for m in modes for p in policies]:
                    name = name + suffix[mode]
                    runs = sorted(timed[name], key=lambda t: t[0])
                    tps, st, out, lat = runs[len(runs) // 2]  # the median run (its own timing and curve)
                    rows.append({"policy": name, "temperature": temp, "seed": args.seeds[si], "prompts": count,
                                 "async": mode,
                                 "tokens_per_s": statistics.median(all_tps[name]), "tokens_per_s_all": all_tps[name],
                                 "mean_accepted_length": st["mean_accepted_length"],
                                 "verified_per_request_step": st["num_verified_tokens"] / max(1, st["request_steps"]),
                                 "verified_per_step": st["verified_tokens_per_step"], "steps": st["steps"],
                                 "verification_efficiency": st["verification_efficiency"],
                                 "survival_calibration": st["survival_calibration"],
                                 "survival_reliability": st.get("survival_reliability"),
                                 "predicted_acceptance_by_position": st["predicted_acceptance_by_position"],
                                 "acceptance_by_position": st["acceptance_by_position"],
                                 "num_verified_tokens": st["num_verified_tokens"],
                                 "num_accepted_tokens": st["num_accepted_tokens"],
                                 "matches_plain": out == ref if temp == 0 and not args.steady else None,
                                 "timing": st["timing"], "wall_s": st["wall_s"],
                                 "capture_s_timed": [round(t[1]["capture_s"], 3) for t in timed[name]],
                                 "captured_timed": [t[1]["captured"] for t in timed[name]],
                                 "latency_after": None if lat is None else curves_info(lat)})
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                          flush=True)
                if args.json:  # partial results survive a run that is cut short
                    args.json.write_text(json.dumps({"partial": True, "latency": curves_info(profiled),
                                                     "rows": rows}, default=str) + "\n")
    table = summarize(rows)
    print(format_table(table, spec_llm))
    suite = suite_comparison(rows)
    for rival, (g, lo, hi, wins, n) in suite.items():
        print(f"cost against {rival} over every (prompts, temperature, set) cell and repeat: geometric mean of the "
              f"tokens/s ratios {g:.3f} (95% bootstrap {lo:.3f}-{hi:.3f}), cost ahead in {wins} of {n}", flush=True)
    graphs = {f"{kind}{' async' if mode else ''}": graph_info(llm)
              for mode in modes for kind, llm in (("plain", plains[mode]), ("spec", specs[mode]))}
    print("cuda graphs: " + json.dumps(graphs), flush=True)
    reprofiled = None
    if args.reprofile:  # the same start-up profile on the warm engine (no request holds cache rows now)
        reprofiled = curves_info(reprofile(spec_llm))
        print("re-profiled curves after the runs: " + json.dumps(reprofiled), flush=True)
    syncs = None
    if args.sync_report:
        syncs = {}
        for temp in args.temperature:
            sp = SamplingParams(max_tokens=16, temperature=temp, ignore_eos=True, seed=1)
            for name, pol, curve in policies:
                apply_policy(dec, pol, curve, profiled)
                syncs[f"{temp}/{name}"] = sync_report(spec_llm, sets[0][: args.sync_report], sp)
                print(f"host report T={temp} {name}: " + json.dumps(syncs[f"{temp}/{name}"]), flush=True)
    import platform

    versions = {"torch": torch.__version__, "python": platform.python_version(),
                "kernel_backend": os.environ.get("DEEPINFER_KERNEL_BACKEND", "auto")}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name()
    if args.json:
        args.json.write_text(json.dumps({"settings": {**vars(args), "ckpt": str(args.ckpt), "json": None, "sts": sts,
                                                      "latency": curves_info(profiled),
                                                      "device": str(spec_llm.engine.runner.device),
                                                      "versions": versions},
                                         "rows": rows, "summary": table, "suite": suite, "cuda_graphs": graphs,
                                         "syncs": syncs,
                                         "reprofiled": reprofiled},
                                        indent=2, default=str) + "\n")
    return 0


def suite_comparison(rows: list[dict], subject: str = "cost", resamples: int = 4000) -> dict[str, tuple]:
    """cost against each other speculative policy over the whole run: per rival, (geometric mean of cost's tokens/s
    over the rival's in the same cell and repeat, 95% bootstrap interval of it, repeats cost was ahead, repeats).
    Several batch sizes and temperatures in one run are the load a server sees over a day, where a fixed threshold
    set for one of them is mis-set for another."""
    import math
    import random

    cells: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if "mean_accepted_length" in r:  # speculative rows only
            key = (r["prompts"], r["temperature"], r["seed"], r["async"])
            cells.setdefault(key, {})[r["policy"]] = r["tokens_per_s_all"]
    out = {}
    rivals = sorted({p for c in cells.values() for p in c if p != subject})
    rng = random.Random(0)
    for rival in rivals:
        logs = [math.log(a / b) for c in cells.values() if subject in c and rival in c
                for a, b in zip(c[subject], c[rival])]
        if not logs:
            continue
        boots = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
        out[rival] = (math.exp(statistics.fmean(logs)), math.exp(boots[int(0.025 * resamples)]),
                      math.exp(boots[int(0.975 * resamples) - 1]), sum(x > 0 for x in logs), len(logs))
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per (prompts, temperature, policy): mean and min / max over prompt sets; verified and tau relative to
    verify_all, tokens/s relative to plain decoding, both of the same scheduling mode (NAME+async: asynchronous).
    `survival_calibration`: the drafts the survivals predicted accepted over those accepted (1: the Confidence Head
    is calibrated where the policy verified; a GPU run reading corrupted confidences showed itself here).
    `vs_verify_all_paired`: per prompt set, the median over repeats of the run's tokens/s over verify_all's run of
    the same repeat (the runs of one repeat follow each other, so a slow spell of the machine hits both; the spread
    between repeats was larger than the gaps between policies on the H200). `first_in`: (repeats in which the
    policy had the most tokens/s of the speculative policies of its scheduling mode, repeats), summed over prompt
    sets: the question "which policy is fastest" asked of every repeat instead of the medians."""
    out = []
    keys = sorted({(r.get("prompts", 0), r["temperature"], r["policy"]) for r in rows},
                  key=lambda k: (k[0], k[1], not k[2].startswith("plain"), k[2]))
    for count, temp, pol in keys:
        same = [r for r in rows if r.get("prompts", 0) == count and r["temperature"] == temp]
        rs = [r for r in same if r["policy"] == pol]
        mode = "+async" if pol.endswith("+async") else ""
        base = {r["seed"]: r for r in same if r["policy"] == "verify_all" + mode}
        plain = {r["seed"]: r for r in same if r["policy"] == "plain" + mode}
        entry = {"prompts": count, "temperature": temp, "policy": pol, "sets": len(rs)}
        for f in ("tokens_per_s", "mean_accepted_length", "verified_per_request_step", "verified_per_step",
                  "survival_calibration"):
            vals = [r[f] for r in rs if r.get(f) is not None]
            if vals:
                entry[f] = (statistics.fmean(vals), min(vals), max(vals))
        for f in ("draft_ms", "verify_ms", "finish_ms", "wall_per_round_ms"):
            vals = [r["timing"][f] for r in rs if f in r.get("timing", {})]
            if vals:
                entry[f] = (statistics.fmean(vals), min(vals), max(vals))
        if plain:
            ratio = [r["tokens_per_s"] / plain[r["seed"]]["tokens_per_s"] for r in rs if r["seed"] in plain]
            entry["vs_plain"] = (statistics.fmean(ratio), min(ratio), max(ratio))
        if not pol.startswith("plain") and base:
            tau = [r["mean_accepted_length"] / base[r["seed"]]["mean_accepted_length"] for r in rs]
            ver = [r["num_verified_tokens"] / base[r["seed"]]["num_verified_tokens"] - 1 for r in rs]
            entry["tau_vs_verify_all"] = (statistics.fmean(tau), min(tau), max(tau))
            paired = [statistics.median(a / b for a, b in zip(r["tokens_per_s_all"], base[r["seed"]]["tokens_per_s_all"]))
                      for r in rs if "tokens_per_s_all" in r]
            if paired:
                entry["vs_verify_all_paired"] = (statistics.fmean(paired), min(paired), max(paired))
            entry["verified_vs_verify_all"] = (statistics.fmean(ver), min(ver), max(ver))
        if not pol.startswith("plain"):
            entry["first_in"] = _first_in(rs, [r for r in same if not r["policy"].startswith("plain")
                                               and r["policy"].endswith("+async") == bool(mode)])
        if any(r.get("matches_plain") is False for r in rs):
            entry["greedy_mismatch"] = True
        out.append(entry)
    return out


def _first_in(mine: list[dict], rivals: list[dict]) -> tuple[int, int]:
    """(repeats in which a run of `mine` had the most tokens/s among `rivals` of its prompt set, repeats)."""
    wins = total = 0
    for r in mine:
        runs = [x["tokens_per_s_all"] for x in rivals if x["seed"] == r["seed"] and "tokens_per_s_all" in x]
        for i, tps in enumerate(r.get("tokens_per_s_all", [])):
            total += 1
            wins += all(tps >= other[i] for other in runs if i < len(other))
    return wins, total


def format_table(table: list[dict], llm) -> str:
    def f(e, key, fmt, pct=False):
        if key not in e:
            return "-"
        m, lo, hi = e[key]
        if pct:
            return f"{m * 100:+.0f}% ({lo * 100:+.0f}..{hi * 100:+.0f})"
        return f"{m:{fmt}} ({lo:{fmt}}..{hi:{fmt}})"

    lines = [f"DSpark policies on {llm.engine.runner.device} (mean (min..max) over prompt sets; vs plain and vs all "
             "within the same scheduling mode)",
             f"{'P':>4} {'T':>3} {'policy':<28} {'tokens/s':>24} {'vs plain':>20} {'vs all, paired':>20} "
             f"{'tau':>20} {'tau vs all':>20} "
             f"{'verified/req-step':>20} {'verified vs all':>20} {'predicted/accepted':>20} {'first in':>9} "
             f"{'ms/round draft+verify+rest':>28}"]
    for e in table:
        lines.append(f"{e['prompts']:>4} {e['temperature']:>3g} {e['policy']:<28} {f(e, 'tokens_per_s', '.1f'):>24} "
                     f"{f(e, 'vs_plain', '.3f'):>20} {f(e, 'vs_verify_all_paired', '.3f'):>20} "
                     f"{f(e, 'mean_accepted_length', '.2f'):>20} {f(e, 'tau_vs_verify_all', '.3f'):>20} "
                     f"{f(e, 'verified_per_request_step', '.2f'):>20} {f(e, 'verified_vs_verify_all', '', True):>20} "
                     f"{f(e, 'survival_calibration', '.3f'):>20} "
                     + (f"{e['first_in'][0]:>5}/{e['first_in'][1]:<3} " if "first_in" in e else f"{'-':>9} ")
                     + (f"{e['draft_ms'][0]:>9.1f}+{e['verify_ms'][0]:.1f}+{e['finish_ms'][0]:.1f}" if "draft_ms" in e
                        else f"{'-':>9}")
                     + ("  GREEDY MISMATCH" if e.get("greedy_mismatch") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
