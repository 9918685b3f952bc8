"""Decode steps through the ModelRunner make no host synchronization (gpu marker).

Guarded under `torch.cuda.set_sync_debug_mode("error")` (any synchronizing CUDA call raises): the runner's
batch building (`InputBatch.prepare`) and the whole model forward of every pure-decode step after two warm-up
decode steps (the first calls move RoPE tables, compile Triton kernels, allocate pinned blocks).
The first test lifts the guard inside the MoE layers and leaves the sampler out; the second one covers a whole
engine decode step (MoE and sampler included) and counts exactly one synchronization, the sampled-id read.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from engine_testing import make_tiny_checkpoint, unguard_moe

pytestmark = pytest.mark.gpu

WARMUP_DECODE_STEPS = 2


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_decode_forward_and_batch_building_make_no_host_sync(tmp_path, monkeypatch, arch: str) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch=arch, seed=0)
    # the eager forward (graphs replay a captured one: test_cuda_graph_cuda.py)
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_num_seqs=4, enforce_eager=True, async_scheduling=False)
    runner = llm.engine.runner
    counts = {"decode": 0, "guarded": 0}

    def guarded(fn, is_decode):
        def call(*args, **kw):
            on = is_decode(*args) and counts["decode"] >= WARMUP_DECODE_STEPS
            if on:
                torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return call

    def decode_chunks(chunks, *_):
        return all(c.num_tokens == 1 for c in chunks)

    def decode_batch(batch, *_):
        return batch.num_tokens == batch.num_seqs

    monkeypatch.setattr(runner.input_batch, "prepare", guarded(runner.input_batch.prepare, decode_chunks))
    forward = guarded(runner.model, decode_batch)

    def model(batch, cache):
        out = forward(batch, cache)
        if decode_batch(batch):
            counts["guarded"] += counts["decode"] >= WARMUP_DECODE_STEPS
            counts["decode"] += 1
        return out

    monkeypatch.setattr(runner, "model", model)
    unguard_moe(monkeypatch)
    prompts = [[5 + i for i in range(n)] for n in (7, 12, 3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert counts["guarded"] >= 4, counts  # decode steps really ran under the guard


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_engine_decode_step_reads_the_host_once(tmp_path, arch: str) -> None:
    """A whole engine decode step (scheduling, batch building, forward with the MoE, sampling) makes exactly one
    host synchronization: the read of the sampled ids."""
    import warnings

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch=arch, seed=0)
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=False)  # the synchronous loop
    eng = llm.engine
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=8, ignore_eos=True, seed=1)
    for i, n in enumerate((7, 12, 3)):
        eng.add_request(f"r{i}", [5 + j for j in range(n)], sp)
    decode_steps = 0
    while decode_steps < 2 + WARMUP_DECODE_STEPS:  # prefill, then warm-up decode steps
        before = eng.total.prefill_tokens
        eng.step()
        decode_steps += eng.total.prefill_tokens == before
    for _ in range(3):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
