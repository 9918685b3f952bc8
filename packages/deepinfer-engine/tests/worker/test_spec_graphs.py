"""Speculative steps through the fixed-shape (graph) path of the engine, on CPU: the runner's verify hook
(`CudaGraphRunner.verify_shape_of` / `run_verify`) with the capture replaced by the same StaticDecodeStep forward
run eagerly on every "replay", so that the padded (B, L, Q) shapes, the gather of the real rows, the captured
features / final streams handed to the drafters and the rollback of padding rows are exercised without a GPU.
Greedy speculation through it equals plain greedy decoding token for token (DSpark on V4.1 and V4-0731, MTP on
V4, every verification policy on V4.1: mixed verify lengths per step), and verify steps really took that path.
The bucket rules of verify steps are checked on their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.static_step import StaticDecodeStep
from deepinfer_engine.model.writer import make_checkpoint
from deepinfer_engine.worker.cuda_graph import (
    CudaGraphRunner,
    _Graph,
    graph_batch_sizes,
    verify_shape,
    verify_token_sizes,
)

PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 20)), [0, 11, 12, 13, 14, 15, 16, 17, 18]]  # mixed lengths


class _EagerReplay:
    """Stands in for a captured graph: each replay reruns the fixed-shape forward and writes its outputs into the
    tensors the capture returned (a graph's replay rewrites its output buffers in place)."""

    def __init__(self, forward, outputs) -> None:
        self.forward, self.outputs = forward, outputs

    def replay(self) -> None:
        out = self.forward()
        self.outputs.logits.copy_(out.logits)
        self.outputs.hidden.copy_(out.hidden)
        for lid, f in self.outputs.features.items():
            f.copy_(out.features[lid])


class StaticEagerGraphs(CudaGraphRunner):
    """CudaGraphRunner on CPU whose 'captures' run the static forward eagerly (test harness only)."""

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(model, cache, device="cuda", max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.device = torch.device("cpu")  # the constructor only checks the device type; nothing was allocated

    def _capture(self, B, L, Q=1, *, capture=None):
        assert capture is not None, "only verify steps run in a speculative engine"
        step = StaticDecodeStep(self.cache, B, L, self.device, tokens=Q)
        out = self._forward(step, capture)
        g = _Graph(step=step, graph=_EagerReplay(lambda: self._forward(step, capture), out), logits=out.logits,
                   hidden=out.hidden, features=dict(out.features), capture=tuple(capture))
        self.graphs[(B, L, Q)] = g
        self.stats.verify_captures += 1
        self.stats.verify_shapes.append((B, L, Q))
        return g


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("specgraphs")
    return {"v41": make_checkpoint(root / "v41", "v41", "tiny", 0),
            "v4-0731": make_checkpoint(root / "v4d", "v4", "tiny-dspark", 0),
            "v4": make_checkpoint(root / "v4", "v4", "tiny", 0)}


def _llm(path: Path, **kw) -> LLM:
    page = 4 if path.name == "v41" else 8  # a multiple of every compress ratio
    return LLM(str(path), device="cpu", dtype="float32", page_size=page, max_num_seqs=4, **kw)


def _ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _with_static_graphs(llm: LLM) -> StaticEagerGraphs:
    eng = llm.engine
    graphs = StaticEagerGraphs(eng.runner.model, eng.runner.cache, max_num_seqs=4, max_model_len=eng.max_model_len)
    eng.runner.cuda_graphs = graphs
    return graphs


@pytest.mark.parametrize(("name", "method", "policies"), [
    ("v41", "dspark", ("verify_all", "threshold", "cost")),
    ("v4-0731", "dspark", ("verify_all",)),
    ("v4", "mtp", ("verify_all",)),
])
def test_greedy_speculation_through_static_steps_equals_plain_greedy(ckpts, name, method, policies) -> None:
    from deepinfer_dspark import LatencyModel, VerifyPolicy

    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = PROMPTS if name == "v41" else PROMPTS[:3]
    plain = _ids(_llm(ckpts[name]).generate(prompts, sp, use_tqdm=False))
    llm = _llm(ckpts[name], speculative_config={"method": method}, enable_prefix_caching=False)
    graphs = _with_static_graphs(llm)
    spec = llm.engine.runner.spec
    for policy in policies:
        spec.policy = VerifyPolicy(kind=policy)
        spec.latency = LatencyModel.affine(0.01, 0.001, 64) if policy == "cost" else spec.latency
        spec.online_latency = False
        before = graphs.stats.verify_replays
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == plain, (name, policy)
        assert graphs.stats.verify_replays > before, (name, policy)
    st = graphs.stats
    assert st.verify_captures == len(set(st.verify_shapes)) and st.verify_eager_steps > 0  # prefill steps: eager
    assert max(q for _, _, q in st.verify_shapes) == spec.max_drafts + 1 >= 2, st.verify_shapes
    assert spec.stats.num_accepted_tokens >= 0 and spec.stats.request_steps > 0


def test_verify_buckets():
    assert verify_token_sizes(1) == (1,)
    assert verify_token_sizes(2) == (1, 2)
    assert verify_token_sizes(6) == (1, 2, 4, 6)
    sizes, toks = graph_batch_sizes(8), verify_token_sizes(6)
    # verify chunks of 1 + m rows beside one-token decode chunks: padded to the longest, L covers the padding
    assert verify_shape((3, 1, 6), (5, 300, 7), list(range(10)), sizes, toks, 4096) == (4, 512, 6)
    assert verify_shape((2, 1), (254, 9), [0, 1, 2], sizes, toks, 4096) == (2, 256, 2)
    assert verify_shape((2, 1), (255, 9), [0, 1, 2], sizes, toks, 4096) == (2, 512, 2)
    assert verify_shape((1, 1), (5, 9), [0, 1], sizes, toks, 4096) == (2, 256, 1)
    assert verify_shape((7, 1), (5, 9), list(range(8)), sizes, toks, 4096) is None  # more rows than k + 1
    assert verify_shape((3, 4), (5, 9), [2, 3, 4, 5, 6], sizes, toks, 4096) is None  # a prefill chunk: last row
    assert verify_shape((2, 1), (5, 9), [0, 0, 1, 2], sizes, toks, 4096) is None  # prompt logprobs
    assert verify_shape((1,) * 9, (3,) * 9, list(range(9)), sizes, toks, 4096) is None  # past the largest bucket
    assert verify_shape((2,), (4095,), [0, 1], sizes, toks, 4096) is None  # padding past max_model_len
    assert verify_shape((), (), [], sizes, toks, 4096) is None
