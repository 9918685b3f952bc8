"""Print where each host synchronization of an engine decode step happens (torch sync debug mode 'warn').

    python scripts/find_syncs.py [--model DIR] [--batch 4] [--steps 2]

Default model: the tiny V4.1 checkpoint written into a temp dir. Each distinct call site is printed once, with the
count of steps it synchronized in and the innermost project frames of its stack.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import warnings

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    ns = p.parse_args()
    from deepinfer_engine import LLM, SamplingParams

    model = ns.model
    if model is None:
        from deepinfer_engine.model.writer import make_checkpoint

        model = str(make_checkpoint(tempfile.mkdtemp() + "/ck", "v41", "tiny", 0))
    llm = LLM(model, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 28)
    eng = llm.engine
    sp = SamplingParams(max_tokens=ns.steps + 3, temperature=0.0, ignore_eos=True)
    for i in range(ns.batch):
        eng.add_request(f"r{i}", [0] + list(range(100, 140)), sp)
    while True:  # prefill
        before = eng.total.prefill_tokens
        eng.step()
        if eng.total.prefill_tokens == before:
            break
    sites: collections.Counter = collections.Counter()
    stacks: dict[str, str] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/packages/" in f.filename or "/scripts/" in f.filename]
        key = " <- ".join(f"{f.filename.split('/packages/')[-1]}:{f.lineno}" for f in frames[-4:][::-1])
        sites[key] += 1
        stacks.setdefault(key, "".join(traceback.format_list(frames[-6:])))

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(ns.steps):
        eng.step()
    torch.cuda.set_sync_debug_mode("default")
    print(f"{sum(sites.values())} synchronizations in {ns.steps} decode steps, {len(sites)} call sites")
    for key, n in sites.most_common():
        print(f"--- {n}x {key}\n{stacks[key]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
