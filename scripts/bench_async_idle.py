"""Device idle time between decode steps with asynchronous scheduling off and on.

    python scripts/bench_async_idle.py --model DIR [--device cuda] [--batch 1,32] [--input-len 1024]
        [--steps 16] [--output-json F] [--engine-option key=value ...]
    python scripts/bench_async_idle.py --make v41:layers-4:32 --make-dir /tmp/ck/v41-l4-e32 ...   (writes the
        checkpoint first when the directory has none: arch:preset[:routed experts])

Runs through the public `LLM` API (engine `add_request` / `step`) with `async_scheduling` False, then True, on
the same checkpoint, prompts and sampling. Two markers per forward: one recorded when the runner calls the model
(or replays a captured CUDA graph), one after the sampler returns; on CUDA they are CUDA events on the compute stream (device timeline), on CPU host
clock readings (the CPU is the device: the same code path runs, but nothing can overlap). For consecutive pure
decode steps (every sequence feeds one token) of the measured batch:
  idle ms  = start marker of step k+1 - end marker of step k: the time the device waits between the sampler of one
             step and the first launch of the next (scheduling, the id read, stop checks, detokenization, batch
             building; with async scheduling only what cannot overlap);
  busy ms  = end marker - start marker of one step (forward + sampler on the device);
  ms/step  = wall time per decode step, tok/s = B / ms/step.
Medians over the measured steps; the first `--warmup` decode steps of each batch are skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from profile_step import engine_options  # scripts/ is on sys.path when a script runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (or use --make)")
    p.add_argument("--make", help="arch:preset[:experts], e.g. v41:layers-4:32: write a random checkpoint first")
    p.add_argument("--make-dir", help="where --make writes (reused when it already holds a config.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16, help="decode steps measured per batch")
    p.add_argument("--warmup", type=int, default=2, help="decode steps skipped per batch")
    p.add_argument("--modes", default="off,on", help="async_scheduling modes to run, in order")
    p.add_argument("--output-json")
    p.add_argument("--engine-option", action="append", default=[], help="extra LLM option key=value (JSON value)")
    return p.parse_args(argv)


def _checkpoint(ns: argparse.Namespace) -> str:
    if ns.model:
        return ns.model
    if not ns.make or not ns.make_dir:
        raise SystemExit("give --model DIR, or --make arch:preset[:experts] with --make-dir DIR")
    out = Path(ns.make_dir)
    if not (out / "config.json").exists():
        from deepinfer_engine.model.writer import make_checkpoint

        arch, preset, *experts = ns.make.split(":")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        make_checkpoint(out, arch, preset, 0, n_routed_experts=int(experts[0]) if experts else None, device=device)
    return str(out)


class _Markers:
    """Start / end markers of every forward, on the device timeline where there is one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[list[Any]] = []  # [num_seqs, decode?, start, end]

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def install(self, runner: Any) -> None:
        model, sampler = runner.model, runner.sampler

        def forward(batch, cache):
            self.steps.append([batch.num_seqs, batch.num_tokens == batch.num_seqs, self.mark(), None])
            return model(batch, cache)

        graphs = getattr(runner, "cuda_graphs", None)
        if graphs is not None:  # decode steps replay a captured graph instead of calling the model
            replay = graphs.run

            def run(batch, shape):
                self.steps.append([batch.num_seqs, batch.num_tokens == batch.num_seqs, self.mark(), None])
                logits = replay(batch, shape)
                if logits is None:  # not capturable: the runner calls the model eagerly, which marks again
                    self.steps.pop()
                return logits

            graphs.run = run

        def sample(logits, sbatch):
            out = sampler(logits, sbatch)
            if self.steps and self.steps[-1][3] is None:
                self.steps[-1][3] = self.mark()
            return out

        runner.model, runner.sampler = forward, sample


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 128000) - 1
    return [[0] + [rng.randint(3, hi) for _ in range(length - 1)] for _ in range(n)]


def measure(llm: Any, markers: _Markers, batch: int, input_len: int, steps: int, warmup: int) -> dict[str, Any]:
    from deepinfer_engine import SamplingParams

    eng = llm.engine
    vocab = int(getattr(eng.args, "vocab_size", 129280))
    sp = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(batch, input_len, 7 + batch, vocab)):
        eng.add_request(f"idle-{batch}-{i}", ids, sp)
    markers.steps.clear()
    walls: list[tuple[int, float]] = []  # (number of forwards so far, wall seconds of the step call)
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        walls.append((len(markers.steps), time.perf_counter() - t0))
    if markers.cuda:
        torch.cuda.synchronize()
    rows = markers.steps
    decode = [k for k, r in enumerate(rows) if r[1] and r[0] == batch and r[3] is not None]
    decode = decode[warmup : warmup + steps + 1]
    idle = [markers.ms(rows[a][3], rows[b][2]) for a, b in zip(decode, decode[1:]) if b == a + 1]
    busy = [markers.ms(rows[k][2], rows[k][3]) for k in decode]
    # wall time of the engine calls that launched the measured decode forwards
    launched = {k + 1 for k in decode}
    wall = [w for n, w in walls if n in launched]
    step_ms = statistics.median(wall) * 1e3 if wall else float("nan")
    return {"batch": batch, "decode_steps": len(busy), "idle_ms_median": statistics.median(idle) if idle else None,
            "idle_ms_mean": statistics.fmean(idle) if idle else None,
            "busy_ms_median": statistics.median(busy) if busy else None, "step_ms_median": step_ms,
            "tok_per_s": batch / step_ms * 1e3 if wall else None}


def run_mode(model: str, opts: dict[str, Any], on: bool, ns: argparse.Namespace) -> list[dict[str, Any]]:
    from deepinfer_engine import LLM

    llm = LLM(model, **opts, async_scheduling=on)
    markers = _Markers(llm.engine.runner.device)
    markers.install(llm.engine.runner)
    measure(llm, markers, 1, min(ns.input_len, 16), 2, 0)  # warm-up: allocations, kernel compilation
    rows = [measure(llm, markers, int(b), ns.input_len, ns.steps, ns.warmup) for b in ns.batch.split(",") if b]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    model = _checkpoint(ns)
    opts = {"device": ns.device, "dtype": ns.dtype, **engine_options(ns.engine_option)}
    results = [(mode, run_mode(model, opts, mode == "on", ns)) for mode in ns.modes.split(",") if mode]
    device = "cuda" if (ns.device == "auto" and torch.cuda.is_available()) or ns.device.startswith("cuda") else "cpu"
    print(f"async scheduling idle between decode steps: {model}, input {ns.input_len}, {device}")
    print(f"{'B':>4} {'async':>5} {'idle ms':>8} {'busy ms':>8} {'ms/step':>8} {'tok/s':>8}")
    for mode, rows in results:
        for r in rows:
            idle = "-" if r["idle_ms_median"] is None else f"{r['idle_ms_median']:.3f}"
            busy = "-" if r["busy_ms_median"] is None else f"{r['busy_ms_median']:.2f}"
            tps = "-" if r["tok_per_s"] is None else f"{r['tok_per_s']:.1f}"
            print(f"{r['batch']:>4} {mode:>5} {idle:>8} {busy:>8} {r['step_ms_median']:>8.2f} {tps:>8}")
    if ns.output_json:
        info = {"model": model, "options": opts, "input_len": ns.input_len, "steps": ns.steps,
                "torch": torch.__version__, "device": device,
                "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                "results": [{"async_scheduling": mode == "on", "rows": rows} for mode, rows in results]}
        Path(ns.output_json).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
