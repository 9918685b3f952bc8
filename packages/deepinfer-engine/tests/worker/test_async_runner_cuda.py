"""Asynchronous scheduling on CUDA (gpu marker): launching a decode step makes no host synchronization.

Under `torch.cuda.set_sync_debug_mode("error")` (a synchronizing CUDA call raises) around `execute_async` of every
pure-decode step after two warm-up decode steps: batch building, the device gather of the placeholder ids, the
forward, the sampler and the copies of the sampled ids to pinned memory. (V4.1 waits for the previous step's ids
on an event for its host-side Engram hashing; an event wait is not one of the calls the debug mode flags, the
point here is that nothing else waits.) As in test_model_runner_cuda.py the guard is lifted inside the MoE
layers, which are not this module's. The outputs equal the synchronous engine's.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from engine_testing import make_tiny_checkpoint, unguard_moe

pytestmark = pytest.mark.gpu

WARMUP_DECODE_STEPS = 2


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_async_decode_launch_makes_no_host_sync(tmp_path, monkeypatch, arch: str) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch=arch, seed=0)
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (7, 12, 3)]
    sp = SamplingParams(temperature=0.7, top_k=50, max_tokens=8, ignore_eos=True, seed=1)
    ref = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=False).generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=True)
    runner = llm.engine.runner
    launch = runner.execute_async
    counts = {"decode": 0, "guarded": 0}

    def guarded(sched):
        decode = bool(sched.chunks) and all(c.num_tokens == 1 for c in sched.chunks)
        on = decode and counts["decode"] >= WARMUP_DECODE_STEPS
        counts["decode"] += decode
        counts["guarded"] += on
        if on:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(runner, "execute_async", guarded)
    unguard_moe(monkeypatch)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert counts["guarded"] >= 3, counts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
