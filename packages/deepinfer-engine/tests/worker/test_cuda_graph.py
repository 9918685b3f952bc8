"""The pure-Python parts of the decode CUDA graphs: batch / length buckets and which steps qualify (CPU)."""

from __future__ import annotations

import pytest
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.worker.cuda_graph import (
    MIN_LEN_BUCKET,
    decode_shape,
    graph_batch_sizes,
    length_bucket,
    pick_bucket,
)
from deepinfer_engine.worker.sampler import Sampler


def test_batch_buckets():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    with pytest.raises(ConfigError, match="max_num_seqs 0"):
        graph_batch_sizes(0)
    sizes = graph_batch_sizes(100)
    assert [pick_bucket(n, sizes) for n in (1, 3, 8, 9, 65, 100, 101)] == [1, 4, 8, 16, 100, 100, None]


def test_length_buckets():
    assert length_bucket(1, 10_000) == MIN_LEN_BUCKET
    assert length_bucket(MIN_LEN_BUCKET + 1, 10_000) == 2 * MIN_LEN_BUCKET
    assert length_bucket(1025, 10_000) == 2048
    assert length_bucket(1025, 1100) == 1100  # capped to max_model_len, still >= the need
    assert length_bucket(1101, 1100) is None


def test_which_steps_replay():
    sizes = graph_batch_sizes(8)
    assert decode_shape((1, 1, 1), (5, 300, 7), [0, 1, 2], sizes, 4096) == (4, 512)
    assert decode_shape((1, 2), (5, 9), [0, 2], sizes, 4096) is None  # a prefill chunk in the step
    assert decode_shape((1, 1), (5, 9), [0, 0, 1], sizes, 4096) is None  # prompt logprobs: extra logit rows
    assert decode_shape((1, 1), (5, 9), [1, 0], sizes, 4096) is None
    assert decode_shape((1,) * 9, (3,) * 9, list(range(9)), sizes, 4096) is None  # past the largest bucket
    assert decode_shape((), (), [], sizes, 4096) is None


class _RecordingGraphs:
    """Stands in for CudaGraphRunner at the runner's hook: the real bucket rule; 'replays' run the eager model on
    the step's batch (or decline, like a shape whose capture failed); their greedy ids come from the sampler."""

    def __init__(self, model, cache, *, declines: bool) -> None:
        self.model, self.cache, self.declines = model, cache, declines
        self.asked: list[tuple[int, int]] = []
        self.ran = 0

    def shape_of(self, batch, logit_rows):
        return decode_shape(batch.query_lens, batch.host.ctx_lens, logit_rows, graph_batch_sizes(4), 4096)

    def run(self, batch, shape):
        self.asked.append(shape)
        if self.declines:
            return None
        self.ran += 1
        self.logits = self.model(batch, self.cache)
        return self.logits

    def greedy_ids(self, num_seqs):  # a real decode graph computes them inside the replay, as the sampler does
        return Sampler().greedy(self.logits.float())[:num_seqs]


@pytest.mark.parametrize("declines", [False, True])
def test_runner_routes_decode_steps_to_the_graphs(fake_model, make_fake_engine, declines: bool) -> None:
    from deepinfer_engine.llm import LLM
    from deepinfer_engine.sampling_params import SamplingParams

    prompts = [[5, 6, 7], [9] * 11, [3, 4]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM.from_engine(make_fake_engine(fake_model)).generate(
        prompts, sp, use_tqdm=False)]  # fmt: skip
    eng = make_fake_engine(fake_model)
    graphs = _RecordingGraphs(fake_model, eng.runner.cache, declines=declines)
    eng.runner.cuda_graphs = graphs
    got = [o.outputs[0].token_ids for o in LLM.from_engine(eng).generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert graphs.asked and all(s == (4, MIN_LEN_BUCKET) for s in graphs.asked)  # 3 decoding -> bucket 4
    assert graphs.ran == (0 if declines else len(graphs.asked))
