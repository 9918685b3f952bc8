"""Side streams on the GPU (gpu marker): decode-sized steps with the shared experts and the Engram projections on
side streams give bit-identical logits to the single-stream forward (the same kernels on the same inputs; only the
launch order across streams differs), eagerly and inside CUDA graphs; a 300-token prefill stays single-stream."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.loader import load_model
from equality import run_batched, run_chunked

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("v41"), dtype=torch.bfloat16, device="cuda")


def test_eager_steps_with_side_streams_equal_one_stream(model) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (300,), generator=g)
    chunks = [300 - 12] + [1] * 6 + [6]
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in (13, 5, 22, 9)]
    model.set_overlap(False)
    try:
        ref, ref_b = run_chunked(model, ids, chunks), run_batched(model, seqs, seed=2)
    finally:
        model.set_overlap(True)
    got, got_b = run_chunked(model, ids, chunks), run_batched(model, seqs, seed=2)
    assert model._streams is not None  # the decode-sized steps did run on side streams
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(got_b, ref_b))


def test_graphs_with_side_streams_equal_eager_without(tiny_ckpt) -> None:
    path = str(tiny_ckpt("v41"))
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((7, 12, 3, 30, 17))]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 6, 9, 4, 10)]

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    eager = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8, enforce_eager=True)
    eager.engine.runner.model.set_overlap(False)
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8)
    assert run(llm) == run(eager)
    assert llm.engine.runner.cuda_graphs.stats.replays > 0 and llm.engine.runner.model._streams is not None
