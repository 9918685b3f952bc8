"""Greedy sampling inside the decode graph (CPU, through the eager-replay harness): a plain greedy decode step
takes its ids from the argmax captured with the graph (the sampler runs nothing), other steps sample the graph's
logits; outputs equal graphs off token for token, synchronous and asynchronous runners alike."""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams
from eager_graphs import EagerReplayGraphs

PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 14))]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("v41")


def _run(path, graphs: bool, async_on: bool, params: list[SamplingParams]) -> tuple[list[list[int]], dict]:
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, max_num_seqs=4, async_scheduling=async_on)
    runner = llm.engine.runner
    calls = {"sampler": 0, "greedy": 0}
    if graphs:
        runner.cuda_graphs = EagerReplayGraphs(runner.model, runner.cache, max_num_seqs=4,
                                               max_model_len=llm.engine.max_model_len)
    sampler = runner.sampler
    call, greedy = sampler.__call__, sampler.greedy

    class Counting:
        kernel_backend = sampler.kernel_backend

        def __call__(self, *a):
            calls["sampler"] += 1
            return call(*a)

        def greedy(self, *a):
            calls["greedy"] += 1
            return greedy(*a)

    runner.sampler = Counting()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    if graphs:
        calls["replays"] = runner.cuda_graphs.stats.replays
        # every decode graph writes its logits into the leading rows of the runner's one decode buffer
        shared = runner.cuda_graphs._outputs["decode.logits"]
        assert shared.shape[0] == 4 and runner.cuda_graphs.graphs
        assert {g.logits.data_ptr() for g in runner.cuda_graphs.graphs.values()} == {shared.data_ptr()}
    return [list(o.outputs[0].token_ids) for o in outs], calls


@pytest.mark.parametrize("async_on", [False, True])
def test_plain_greedy_steps_take_the_graphs_argmax(ckpt, async_on: bool) -> None:
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(PROMPTS)
    want, _ = _run(ckpt, False, async_on, sp)
    got, calls = _run(ckpt, True, async_on, sp)
    assert got == want
    assert calls["replays"] >= 3  # decode steps replayed...
    assert calls["sampler"] == 0  # ...and no step built a sampling batch (plain greedy: ids from the graph)
    assert calls["greedy"] < calls["replays"]  # only the eager (prefill) steps ran the argmax outside a graph


def test_mixed_sampling_samples_the_graphs_logits(ckpt) -> None:
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, max_tokens=6, ignore_eos=True, seed=3),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)]
    want, _ = _run(ckpt, False, True, sp)
    got, calls = _run(ckpt, True, True, sp)
    assert got == want
    assert calls["replays"] >= 3 and calls["sampler"] >= calls["replays"]
