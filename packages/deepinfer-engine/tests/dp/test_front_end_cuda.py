"""The data-parallel engine on one GPU: a world of 1 rank on NCCL (spawned, expert-parallel dispatch through its
throughput and low-latency paths, EPLB with redundant experts rebalancing mid-run) gives the single-process
engine's greedy output, and leaves no process behind."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.writer import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
GREEDY = SamplingParams(temperature=0, max_tokens=5)
# float32: combine receives each routed expert output in the activation dtype; in fp32 that is the one-process sum
# up to summation order (bf16 would round every expert output before the weighted sum)
OPTS = {"device": "cuda", "dtype": "float32", "page_size": 4}


def _ids(outs) -> list[list[int]]:
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(_dead(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("extra", [{}, {"enable_eplb": True, "num_redundant_experts": 2, "eplb_window_size": 2,
                                       "eplb_step_interval": 2}])
def test_world_of_one_on_nccl_equals_single_process(tmp_path, extra) -> None:
    ckpt = str(make_checkpoint(tmp_path / "ckpt", "v41", "tiny", 0))
    ref = LLM(ckpt, **OPTS)
    want = _ids(ref.generate(PROMPTS, GREEDY, use_tqdm=False))
    del ref  # its cache holds most of the free GPU memory; the rank sizes its own from what is free
    gc.collect()
    torch.cuda.empty_cache()
    with LLM(ckpt, data_parallel_size=1, enable_expert_parallel=True, **OPTS, **extra) as llm:
        core = llm.engine.core
        pids = core.pids
        assert core.backend == "nccl"
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        stats = core.dp_stats()
        assert stats["steps_by_kind"].get("decode", 0) >= 4  # the low-latency path ran
        if extra:
            assert stats["eplb_rearrangements"] >= 2
    assert _gone(pids)
