"""Where a DSpark speculative round's time goes, on the trained testbed: host phases and device work per round.

    python scripts/spec_round_time.py [--ckpt .cache/dspark-testbed] [--device cuda] [--prompts 32]
        [--temperature 0 1] [--policy cost] [--new-tokens 48] [--repeats 3] [--profile] [--output-json F]

Runs `LLM(..., speculative_config={"method": "dspark", "policy": ...})` (synchronous scheduling, the speculative
default) over the testbed's held-out prompts and reports, per round, the median over `--repeats` runs of the
inclusive wall time spent inside each phase (`PHASES`: wall-clock wrappers around the engine's methods, ~1 µs
each). Phases nest: `begin` (the draft pass and the policy) holds `propose` (`draft_block` = the draft stages'
forward, `sample_block` = the Markov loop and confidence; `propose_block` = both as one graph replay) and `policy` (`schedule_verification`; `begin`'s
remainder holds the host read of the drafts); `launch_verify` holds `verify`; `collect_verify` holds `insert_context` (the draft rings'
update from the step's target features: `ic_stages` the stages' part, which holds `ic_project_kv` and `ic_write`;
`ic_context` counts every `ForwardContext.build`, the eager forwards' included). Phases that wait for the device (the read of the drafts, the read of the
verification result) hold the device work queued before them.
`--profile` adds a torch profile of one run: CUDA kernel launches, graph launches, host syncs and summed kernel
time per round, and the top device kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dspark_policies import _testbed, ensure_calibration, prompt_sets, request_params  # noqa: E402
from phase_timer import PhaseTimer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# (name, module, owner (a class, or None for a module-level function), attribute); inclusive wall time per call
PHASES = (
    ("schedule_step", "deepinfer_engine.core.scheduler", "Scheduler", "schedule"),
    ("update", "deepinfer_engine.core.scheduler", "Scheduler", "update_from_output"),
    ("launch", "deepinfer_engine.worker.model_runner", "ModelRunner", "launch"),
    ("begin", "deepinfer_engine.worker.spec_decode", "SpecDecoder", "begin"),
    ("propose", "deepinfer_engine.worker.spec_decode", None, "propose"),
    ("propose_block", "deepinfer_engine.model.dspark_drafter", "StageDrafter", "propose_block"),
    ("draft_block", "deepinfer_engine.model.dspark_drafter", "StageDrafter", "draft_block"),
    ("sample_block", "deepinfer_dspark.propose", None, "sample_block"),
    ("policy", "deepinfer_engine.worker.spec_decode", None, "schedule_verification"),
    ("prepare", "deepinfer_engine.worker.input_batch", "InputBatch", "prepare"),
    ("verify_forward", "deepinfer_engine.worker.cuda_graph", "CudaGraphRunner", "run_verify"),
    ("launch_verify", "deepinfer_engine.worker.spec_decode", "SpecDecoder", "launch_verify"),
    ("verify", "deepinfer_engine.worker.spec_decode", None, "verify"),
    ("collect", "deepinfer_engine.worker.model_runner", "ModelRunner", "collect"),
    ("collect_verify", "deepinfer_engine.worker.spec_decode", "SpecDecoder", "collect_verify"),
    ("insert_context", "deepinfer_engine.worker.spec_decode", "SpecDecoder", "insert_context"),
    ("ic_stages", "deepinfer_engine.model.dspark", None, "insert_context"),
    ("ic_context", "deepinfer_engine.model.forward_batch", "ForwardContext", "build"),
    ("ic_project_kv", "deepinfer_engine.model.attention", "Attention", "project_kv"),
    ("ic_write", "deepinfer_engine.model.attention", "Attention", "write_window"),
    ("outputs", "deepinfer_engine.output_processor", "OutputProcessor", "process"),
)


def one_run(llm: Any, prompts: list[list[int]], sp: Any, phases: PhaseTimer) -> dict[str, Any]:
    spec = llm.engine.runner.spec
    spec.reset_stats()
    spec.timing.rounds = 0
    cuda = llm.engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    phases.take()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sums, calls = phases.take()
    rounds = max(spec.timing.rounds, 1)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": wall, "tok_s": tokens / wall, "rounds": spec.timing.rounds, "steps": calls.get("launch", 0),
            "us_per_round": {k: 1e6 * v / rounds for k, v in sums.items()},
            "calls_per_round": {k: v / rounds for k, v in calls.items()},
            "tau": spec.stats.as_dict().get("mean_accepted_length")}


def profile_run(llm: Any, prompts: list[list[int]], sp: Any, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    spec = llm.engine.runner.spec
    spec.reset_stats()
    spec.timing.rounds = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
    rounds = max(spec.timing.rounds, 1)
    launches = graphs = syncs = 0
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        n = e.name
        if n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
        elif n in ("cudaGraphLaunch", "cuGraphLaunch"):
            graphs += 1
        elif n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"):
            syncs += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(n[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    total = sum(v[1] for v in kernels.values())
    topk = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"rounds": spec.timing.rounds, "launches_per_round": launches / rounds, "graphs_per_round": graphs / rounds,
            "syncs_per_round": syncs / rounds, "kernel_us_per_round": total / rounds,
            "top": [{"kernel": k, "calls_per_round": v[0] / rounds, "us_per_round": v[1] / rounds} for k, v in topk]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "dspark-testbed")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--policy", default="cost", choices=("cost", "verify_all", "threshold"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--engine-option", action="append", default=[], help="extra LLM option key=value (JSON value)")
    ap.add_argument("--unfused", action="store_true",
                    help="draft rounds take the pass's graph + the eager sampling (no fused proposal graph)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)

    from deepinfer_engine import LLM, SamplingParams

    tb = _testbed()
    if not (args.ckpt / "testbed.json").exists():
        raise SystemExit(f"{args.ckpt}: no testbed; run scripts/dspark_testbed.py build --out {args.ckpt}")
    ensure_calibration(args.ckpt, tb)
    prompts = prompt_sets(args.ckpt, tb, [args.seed], args.prompts, args.prompt_len)[0]
    extra = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.engine_option)}
    opts: dict[str, Any] = dict(device=args.device, max_num_seqs=args.prompts, enable_prefix_caching=False, **extra)
    if args.device != "cpu":
        opts.setdefault("kv_cache_memory_bytes", 1 << 30)
    llm = LLM(str(args.ckpt), speculative_config={"method": "dspark", "policy": args.policy}, **opts)
    if args.unfused:
        llm.engine.runner.spec.drafter.proposal_runner = None
    phases = PhaseTimer(PHASES)
    phases.install()
    report: dict[str, Any] = {"device": str(llm.engine.runner.device), "torch": torch.__version__,
                              "prompts": args.prompts, "policy": args.policy, "unfused": args.unfused, "runs": {}}
    for temp in args.temperature:
        sp = request_params(SamplingParams(max_tokens=args.new_tokens, temperature=temp, ignore_eos=True,
                                           seed=args.seed), len(prompts))
        for _ in range(2):  # compiles and captures for this temperature's shapes
            one_run(llm, prompts, sp, phases)
        runs = [one_run(llm, prompts, sp, phases) for _ in range(args.repeats)]
        names = sorted({k for r in runs for k in r["us_per_round"]}, key=[p[0] for p in PHASES].index)
        med = {k: statistics.median(r["us_per_round"].get(k, 0.0) for r in runs) for k in names}
        calls = {k: statistics.median(r["calls_per_round"].get(k, 0.0) for r in runs) for k in names}
        wall = statistics.median(1e6 * r["wall_s"] / max(r["rounds"], 1) for r in runs)
        entry = {"tok_s": statistics.median(r["tok_s"] for r in runs), "wall_us_per_round": wall,
                 "rounds": runs[-1]["rounds"], "steps": runs[-1]["steps"], "tau": runs[-1]["tau"],
                 "us_per_round": med, "calls_per_round": calls}
        print(f"\nT={temp}: {entry['tok_s']:,.0f} tok/s, {entry['rounds']} rounds in {entry['steps']} steps, "
              f"tau {entry['tau']}, wall {wall:,.0f} µs per round (prefill steps included)")
        print(f"  {'phase':<16}{'µs/round':>10}{'calls/round':>13}")
        for k in names:
            print(f"  {k:<16}{med[k]:>10,.0f}{calls[k]:>13.2f}")
        if args.profile and llm.engine.runner.device.type == "cuda":
            entry["profile"] = prof = profile_run(llm, prompts, sp, args.top)
            print(f"  profile: {prof['launches_per_round']:.0f} kernel launches, {prof['graphs_per_round']:.1f} graph "
                  f"launches, {prof['syncs_per_round']:.1f} host syncs, {prof['kernel_us_per_round']:,.0f} µs of "
                  "kernels per round")
            for t in prof["top"]:
                print(f"    {t['us_per_round']:>8,.1f} µs {t['calls_per_round']:>6.1f}x  {t['kernel']}")
        report["runs"][str(temp)] = entry
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
