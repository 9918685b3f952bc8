"""Host time of one decode step of the engine: what the Python side spends per `engine.step()` besides the forward
itself and the wait for the previous step's ids.

    python scripts/host_step_time.py [--model DIR] [--device auto|cpu|cuda] [--batch 1,8] [--input-len 64]
        [--steps 40] [--warmup 4] [--profile N] [--output-json F] [--engine-option key=value ...]

Runs the public `LLM` API (default: the embedded tiny model, `model=None`) and times every pure decode step
(each sequence feeds one token) of a batch of greedy requests:
  step ms = wall time of the `engine.step()` call;
  fwd ms  = wall time of the forward call inside it (the model call, or the CUDA graph replay call: on CUDA only
            the launches / replay call, the kernels run asynchronously), on CPU the whole forward compute and the
            sampler's calls (their reductions over the vocabulary are the CPU's device work);
  wait ms = time blocked reading the previous step's sampled ids back (AsyncOutput; asynchronous scheduling);
  host ms = step - fwd - wait (input building, plan arrays, copies, sampler launches, scheduling, outputs).
On CPU the forward is the device work, so host ms is the engine's own overhead; on CUDA with graphs fwd is the
graph fill + replay call, so host + fwd is the host time of the step. Medians over the measured steps.
`--profile N` also prints the N most expensive functions (cumulative) of a cProfile of the measured steps, the
model's eager forward left out (a graph replay's fill and launch are host work and stay in).
`--phases` adds, per batch size, the median µs per measured step spent inside each of the engine's host phases
(`PHASES`: wall-clock wrappers around those methods, ~1 µs each, so unlike cProfile they do not inflate the Python
work); the phases nest (`launch` holds `prepare`, `resolve`, `graph_run`, which holds `host_step`, `fill`,
`replay`), each is inclusive.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from phase_timer import PhaseTimer  # this script's folder is on sys.path
from profile_step import engine_options  # the --engine-option parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="decode steps measured per batch")
    p.add_argument("--warmup", type=int, default=4, help="decode steps skipped per batch")
    p.add_argument("--profile", type=int, default=0, help="print the N top functions of a cProfile")
    p.add_argument("--output-json")
    p.add_argument("--sort", default="cumulative", help="cProfile order: cumulative | tottime")
    p.add_argument("--phases", action="store_true", help="time the engine's host phases per step (PHASES)")
    p.add_argument("--engine-option", action="append", default=[], help="extra LLM option key=value (JSON value)")
    return p.parse_args(argv)


class _Clock:
    """Accumulates the wall time of the wrapped calls since the last `take()`."""

    def __init__(self) -> None:
        self.fwd = 0.0
        self.wait = 0.0
        self.decode = False  # the latest forward was a pure decode step
        self.prof: cProfile.Profile | None = None  # enabled while a measured step runs: paused inside the model

    def take(self) -> tuple[float, float]:
        out = (self.fwd, self.wait)
        self.fwd = self.wait = 0.0
        return out

    def install(self, runner: Any) -> None:
        model = runner.model

        def forward(batch, cache):
            self.decode = batch.num_tokens == batch.num_seqs
            prof = self.prof
            if prof is not None:  # the profile is of the host work: not of the model's forward
                prof.disable()
            t0 = time.perf_counter()
            try:
                return model(batch, cache)
            finally:
                self.fwd += time.perf_counter() - t0
                if prof is not None:
                    prof.enable()

        runner.model = forward
        if runner.device.type == "cpu":  # there the sampler's reductions over the vocabulary are device work too
            runner.sampler = _TimedSampler(runner.sampler, self)
        graphs = getattr(runner, "cuda_graphs", None)
        if graphs is not None:
            replay = graphs.run

            def run(batch, shape):
                self.decode = True
                t0 = time.perf_counter()
                try:
                    return replay(batch, shape)
                finally:
                    self.fwd += time.perf_counter() - t0

            graphs.run = run

    def install_wait(self) -> Any:
        from deepinfer_engine.worker.async_output import AsyncOutput

        orig = AsyncOutput._wait

        def _wait(out):
            t0 = time.perf_counter()
            try:
                return orig(out)
            finally:
                self.wait += time.perf_counter() - t0

        AsyncOutput._wait = _wait
        return orig


# (name, module, class, method) of the host phases `--phases` times; inclusive wall time per call
PHASES = (
    ("schedule", "deepinfer_engine.core.scheduler", "Scheduler", "schedule"),
    ("update", "deepinfer_engine.core.scheduler", "Scheduler", "update_from_output"),
    ("launch", "deepinfer_engine.worker.model_runner", "ModelRunner", "launch"),
    ("inputs_update", "deepinfer_engine.worker.input_batch", "InputBatch", "update"),
    ("prepare", "deepinfer_engine.worker.input_batch", "InputBatch", "prepare"),
    ("resolve", "deepinfer_engine.worker.async_runner", "AsyncModelRunner", "_resolve_placeholders"),
    ("batch", "deepinfer_engine.model.forward_batch", "ForwardBatch", "__post_init__"),
    ("shape_of", "deepinfer_engine.worker.cuda_graph", "CudaGraphRunner", "shape_of"),
    ("graph_run", "deepinfer_engine.worker.cuda_graph", "CudaGraphRunner", "run"),
    ("host_step", "deepinfer_engine.model.model", "Transformer", "host_step"),
    ("check_tables", "deepinfer_engine.model.static_step", "StaticDecodeStep", "check_tables"),
    ("fill", "deepinfer_engine.model.static_step", "StaticDecodeStep", "fill"),
    ("replay", "torch.cuda.graphs", "CUDAGraph", "replay"),
    ("sampler", "deepinfer_engine.worker.sampler", "Sampler", "__call__"),
    ("async_output", "deepinfer_engine.worker.async_output", "AsyncOutput", "__init__"),
    ("read_back", "deepinfer_engine.worker.async_output", "AsyncOutput", "result"),
    ("collect", "deepinfer_engine.worker.model_runner", "ModelRunner", "collect"),
    ("outputs", "deepinfer_engine.output_processor", "OutputProcessor", "process"),
)


class _TimedSampler:
    """The runner's sampler with its calls' wall time added to the clock's forward time (CPU runs)."""

    def __init__(self, sampler: Any, clock: _Clock) -> None:
        self.sampler, self.clock = sampler, clock
        self.kernel_backend = sampler.kernel_backend

    def _timed(self, fn: Any, *a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.clock.fwd += time.perf_counter() - t0

    def __call__(self, logits: Any, batch: Any) -> Any:
        return self._timed(self.sampler, logits, batch)

    def greedy(self, logits: Any) -> Any:
        return self._timed(self.sampler.greedy, logits)


def measure(llm: Any, clock: _Clock, batch: int, input_len: int, steps: int, warmup: int,
            prof: cProfile.Profile | None, phases: PhaseTimer | None = None) -> dict[str, Any]:
    from deepinfer_engine import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=warmup + steps + 3, temperature=0.0, ignore_eos=True)
    vocab = int(getattr(eng.args, "vocab_size", 1000))
    for i in range(batch):
        ids = [(7 * i + 13 * k) % (vocab - 3) + 3 for k in range(input_len)]
        eng.add_request(f"host-{batch}-{i}", ids, sp)
    rows: list[tuple[float, float, float]] = []
    per_phase: list[dict[str, float]] = []
    seen = 0
    while eng.has_unfinished_requests():
        clock.take()
        if phases is not None:
            phases.take()
        clock.decode = False
        before = eng.total.prefill_tokens
        measuring = seen >= warmup and len(rows) < steps
        if prof is not None and measuring:
            clock.prof = prof
            prof.enable()
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if prof is not None and measuring:
            prof.disable()
            clock.prof = None
        fwd, wait = clock.take()
        decode = clock.decode and eng.total.prefill_tokens == before and len(eng.scheduler.running) == batch
        if not decode:
            continue
        seen += 1
        if measuring:
            rows.append((dt, fwd, wait))
            if phases is not None:
                per_phase.append(phases.take()[0])
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    def med(k: int) -> float:
        return statistics.median(r[k] for r in rows) * 1e3 if rows else float("nan")

    host = [(r[0] - r[1] - r[2]) * 1e3 for r in rows]
    return {"batch": batch, "steps": len(rows), "step_ms": med(0), "fwd_ms": med(1), "wait_ms": med(2),
            "host_ms": statistics.median(host) if host else float("nan"),
            "host_ms_min": min(host) if host else float("nan"),
            "phases_us": {name: statistics.median(p.get(name, 0.0) for p in per_phase) * 1e6
                          for name, *_ in PHASES} if per_phase else None}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from deepinfer_engine import LLM

    opts = {"device": ns.device, "dtype": ns.dtype, **engine_options(ns.engine_option)}
    llm = LLM(ns.model, **opts)
    clock = _Clock()
    clock.install(llm.engine.runner)
    clock.install_wait()
    phases = None
    if ns.phases:
        phases = PhaseTimer(PHASES)
        phases.install()
    measure(llm, clock, 1, 8, 3, 0, None)  # warm-up: allocations, compilation, graph captures of B = 1
    prof = cProfile.Profile() if ns.profile else None
    results = [measure(llm, clock, int(b), ns.input_len, ns.steps, ns.warmup, prof, phases)
               for b in ns.batch.split(",") if b]
    device = str(llm.engine.runner.device)
    print(f"host time per decode step: {ns.model or 'default tiny model'}, input {ns.input_len}, {device}, "
          f"async_scheduling={llm.config.scheduler.async_scheduling}")
    print(f"{'B':>4} {'steps':>5} {'step ms':>8} {'fwd ms':>8} {'wait ms':>8} {'host ms':>8} {'host min':>8}")
    for r in results:
        print(f"{r['batch']:>4} {r['steps']:>5} {r['step_ms']:>8.3f} {r['fwd_ms']:>8.3f} {r['wait_ms']:>8.3f} "
              f"{r['host_ms']:>8.3f} {r['host_ms_min']:>8.3f}")
    if phases is not None:
        print("host phases, median µs per measured step (inclusive; launch holds prepare / resolve / graph_run, which "
              "holds host_step / fill / replay):")
        rows = [r for r in results if r.get("phases_us")]
        print(f"{'phase':>14} " + " ".join(f"{'B=' + str(r['batch']):>10}" for r in rows))
        for name, *_ in PHASES:
            print(f"{name:>14} " + " ".join(f"{r['phases_us'][name]:>10.1f}" for r in rows))
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(ns.sort).print_stats(ns.profile)
        print(s.getvalue())
    if ns.output_json:
        info = {"model": ns.model, "options": opts, "device": device, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None, "results": results}
        Path(ns.output_json).write_text(json.dumps(info, indent=2))
    del llm
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
