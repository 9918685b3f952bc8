"""LLM(data_parallel_size=2, enable_expert_parallel=True) inside a real `torchrun` world: every process is one
rank serving its own prompts (SPMD), in lock-step with the other; greedy output equals the single-process
engine, also when one rank has nothing to do in a call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from deepinfer_engine import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # three Python processes: ~1 min on 2 busy cores

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7]]
ONE = [0, 5, 6, 7, 8, 9]

SCRIPT = """
import json, os, sys
from deepinfer_engine import LLM, SamplingParams

ckpt, out_dir, prompts, one = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
rank = int(os.environ["RANK"])
sp = SamplingParams(temperature=0, max_tokens=4)
with LLM(ckpt, data_parallel_size=2, enable_expert_parallel=True, device="cpu", dtype="float32", page_size=4) as llm:
    mine = [o.outputs[0].token_ids for o in llm.generate(prompts[rank::2], sp, use_tqdm=False)]
    # rank 1 has nothing in this call: it steps with empty MoE steps until rank 0 is done
    second = [o.outputs[0].token_ids for o in llm.generate([one] if rank == 0 else [], sp, use_tqdm=False)]
try:  # closed: refused with a typed error before anything is queued
    llm.generate([one], sp, use_tqdm=False)
    closed = "generated"
except Exception as e:
    closed = f"{type(e).__name__}: {e}"
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"mine": mine, "second": second, "closed": closed}, f)
"""


def test_torchrun_world_serves_each_ranks_prompts_like_one_process(tiny_ckpt, tmp_path) -> None:
    ckpt = tiny_ckpt("v41")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(ckpt), str(tmp_path), json.dumps(PROMPTS), json.dumps(ONE)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    # both ends of stderr: a rank that aborts says why first, the launcher's summary comes last
    err = proc.stderr if len(proc.stderr) <= 8000 else proc.stderr[:4000] + "\n[...]\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, err
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=4)
    ref = LLM(str(ckpt), device="cpu", dtype="float32", page_size=4)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp, use_tqdm=False)]
    want_one = ref.generate([ONE], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got[0]["mine"] == want[0::2] and got[1]["mine"] == want[1::2]
    assert got[0]["second"] == [want_one] and got[1]["second"] == []
    for r in range(2):
        assert got[r]["closed"].startswith("RankFailedError") and "engine is closed" in got[r]["closed"], got[r]
