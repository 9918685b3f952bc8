"""Kernel launches, host synchronizations and GPU busy time per decode step of the engine, from a torch profile.

    python scripts/profile_step.py --model DIR [--batch 1,32] [--input-len 1024] [--steps 8] [--output-json F]
        [--label NAME] [--engine-option key=value ...]

Runs through the public `LLM` API only (engine `add_request` / `step`), so the same script profiles any version
of the engine (run it with another tree on PYTHONPATH for a before/after pair). Per batch size: one warm-up batch,
then B random prompts of input-len tokens are prefilled and `steps` pure decode steps (no prefill token in the
step) are profiled. Counted per step from the profiler's CPU-side CUDA runtime events: kernel launches
(cudaLaunchKernel / cuLaunchKernel / cudaLaunchKernelExC), host synchronizations (cudaStreamSynchronize,
cudaDeviceSynchronize, cudaEventSynchronize, and blocking cudaMemcpy), graph replays (cudaGraphLaunch); GPU busy = summed device-kernel time over
the wall time of the profiled steps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH = ("cudaGraphLaunch", "cuGraphLaunch")  # one replay of a captured step (its kernels are not launches)
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--label", default="")
    p.add_argument("--output-json")
    p.add_argument("--engine-option", action="append", default=[], help="extra LLM option key=value (JSON value)")
    return p.parse_args(argv)


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """`--engine-option key=value` pairs -> LLM options (values parsed as JSON where they are JSON)."""
    out: dict[str, Any] = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randint(3, 127999) for _ in range(length - 1)] for _ in range(n)]


def _add(llm: Any, tag: str, batch: int, input_len: int, steps: int, seed: int) -> None:
    from deepinfer_engine import SamplingParams

    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(batch, input_len, seed)):
        llm.engine.add_request(f"profile-{tag}-{i}", ids, sp)


def _step_until_decode(eng: Any) -> None:
    """Step until the prompts are prefilled (the last prefill step samples every first token)."""
    while True:
        before = eng.total.prefill_tokens
        eng.step()
        if eng.total.prefill_tokens == before or not eng.has_unfinished_requests():
            return


def profile_batch(llm: Any, batch: int, input_len: int, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    _add(llm, "warmup", batch, input_len, 2, seed=1)  # compiles, allocations
    while eng.has_unfinished_requests():
        eng.step()
    # chunked prefill: the first prompts decode while later ones prefill; enough tokens that every request still
    # decodes in the profiled steps
    prefill_steps = -(-batch * input_len // int(llm.config.scheduler.max_num_batched_tokens)) + 1
    _add(llm, "main", batch, input_len, steps + prefill_steps + 1, seed=2)
    _step_until_decode(eng)  # the first decode step ran inside (it may share the step with the last prefill)
    torch.cuda.synchronize()
    wall: list[float] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t_start = time.perf_counter()
        n = 0
        while eng.has_unfinished_requests() and n < steps:
            t0 = time.perf_counter()
            eng.step()  # ends with the step's own read of the sampled ids: no extra synchronize here
            wall.append(time.perf_counter() - t0)
            n += 1
        torch.cuda.synchronize()
        total_wall = time.perf_counter() - t_start
    while eng.has_unfinished_requests():
        eng.step()
    launches = syncs = graphs = 0
    kernel_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
        elif e.name in LAUNCH:
            launches += 1
        elif e.name in GRAPH:
            graphs += 1
        elif e.name in SYNC:
            syncs += 1
    return {"batch": batch, "steps": n, "step_ms_median": statistics.median(wall) * 1e3,
            "kernel_launches_per_step": launches / n, "host_syncs_per_step": syncs / n,
            "graph_launches_per_step": graphs / n,
            "gpu_busy_fraction": kernel_us / 1e6 / total_wall}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from deepinfer_engine import LLM

    opts = {"device": "cuda", "dtype": "bfloat16", **engine_options(ns.engine_option)}
    llm = LLM(ns.model, **opts)
    rows = [profile_batch(llm, int(b), ns.input_len, ns.steps) for b in ns.batch.split(",") if b]
    print(f"{ns.label or 'engine'}: {ns.model}, input {ns.input_len}")
    print(f"{'B':>4} {'ms/step':>9} {'launches':>9} {'graphs':>6} {'syncs':>6} {'GPU busy':>9}")
    for r in rows:
        print(f"{r['batch']:>4} {r['step_ms_median']:>9.2f} {r['kernel_launches_per_step']:>9.0f} "
              f"{r['graph_launches_per_step']:>6.1f} {r['host_syncs_per_step']:>6.1f} "
              f"{r['gpu_busy_fraction'] * 100:>8.1f}%")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"label": ns.label, "model": ns.model, "options": opts,
                                                    "torch": torch.__version__,
                                                    "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
