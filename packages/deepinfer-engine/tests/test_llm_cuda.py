"""`LLM(device="cuda")` on the tiny V4.1 / V4 checkpoints against `LLM(device="cpu")` (gpu marker; the CPU test_llm.py
covers CUDA == dense recompute with preemption and batch-independent sampling on V4.1).

- fp32: greedy token ids on CUDA == greedy token ids on CPU for every prompt (both engines chunk the prompts
  over several steps with the same options).
- bf16 (the CUDA default dtype): every request generates max_tokens valid ids, and the first generated token
  equals the fp32 one on at least 3 of the 5 prompts (bf16 noise may flip a near-tied argmax, see
  tests/model/test_model_cuda.py for the logits tolerances).
"""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams
from engine_testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 119)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {a: make_tiny_checkpoint(tmp_path_factory.mktemp(f"llm_cuda_{a}") / "ckpt", arch=a) for a in ("v41", "v4")}


def _greedy(ckpt, device: str, dtype: str) -> list[list[int]]:
    # an explicit small cache: the CUDA default would take 90% of the free GPU memory for a 40 MB model
    llm = LLM(str(ckpt), device=device, dtype=dtype, page_size=8, num_kv_pages=64, max_num_seqs=4,
              max_num_batched_tokens=12, max_model_len=64)
    assert str(llm.engine.runner.device).startswith(device)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_cuda_greedy_equals_cpu_greedy(ckpts, arch: str) -> None:
    cpu = _greedy(ckpts[arch], "cpu", "float32")
    gpu = _greedy(ckpts[arch], "cuda", "float32")
    assert gpu == cpu


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_cuda_bf16_generates(ckpts, arch: str) -> None:
    ref = _greedy(ckpts[arch], "cpu", "float32")
    got = _greedy(ckpts[arch], "cuda", "bfloat16")
    assert all(len(t) == MAX_TOKENS and all(0 <= i < 129280 for i in t) for t in got)
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= 3, (got, ref)
