"""The DSpark draft-context insertion through the runner's graph path (`CudaGraphRunner.run_insert`: a fixed-shape
`dspark.StaticInsert` of B sequences x Q = N + 1 rows per batch bucket), on CPU with the capture replaced by an
eager run of the same fixed-shape insertion (eager_graphs.EagerReplayGraphs), against the eager variable-shape
insertion, on the tiny V4.1 checkpoint (fp32): the same draft ring rows (every kept position of every sequence,
and every other row of the request slots), the same next draft passes and greedy drafts, for rounds mixing kept
lengths 0, 1 (no draft accepted), partial and N + 1 (every draft accepted) in buckets with padding rows and
padding sequences (support/insert_rounds.py). The runner declines (and counts) the steps it must leave to the
eager path, reading the prefix cache's armed captures without consuming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.errors import InputError
from deepinfer_engine.model import dspark
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.static_step import StaticDecodeStep
from eager_graphs import EagerReplayGraphs
from insert_rounds import insert_cache, insert_rounds

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("v41"), torch.float32).eval()


def test_fixed_shape_insertion_writes_the_eager_rings_and_drafts(model) -> None:
    cache, bt = insert_cache(model, CPU)
    graphs = EagerReplayGraphs(model, cache, max_num_seqs=4, max_model_len=256)
    rounds = insert_rounds(model, graphs, bt, CPU, tol=1e-5)
    N = int(model.args.dspark_block_size)
    keeps = {k for r in rounds for k in r["keep"]}
    assert {0, 1, N + 1} <= keeps and keeps - {0, 1, N + 1}  # nothing, no draft, every draft, partial
    st = graphs.stats
    assert st.insert_replays == len(rounds) and st.insert_eager_steps == 0, st
    assert st.insert_captures == 2 and sorted(st.insert_shapes) == [(1, N + 1), (4, N + 1)], st


def test_insert_runner_declines_what_it_cannot_replay(model) -> None:
    """Steps the runner leaves to the eager insertion return False and count as eager; armed prefix-cache captures
    (either kind) are left armed for the eager insertion to serve."""
    a = model.args
    cache, _ = insert_cache(model, CPU)
    graphs = EagerReplayGraphs(model, cache, max_num_seqs=4, max_model_len=256)
    Q = int(a.dspark_block_size) + 1
    feats = {lid: torch.randn(16, a.hidden_size) for lid in a.dspark_target_layer_ids}

    def run(ctx, lens):
        firsts = list(np.cumsum(lens) - np.asarray(lens))
        return graphs.run_insert(ctx, list(range(len(lens))), lens, firsts, feats, Q)

    assert run([0], [Q + 1]) is False  # a prefill chunk keeping more than Q rows
    assert run([4] * 5, [1] * 5) is False  # more sequences than the largest bucket
    assert run([int(a.max_position_embeddings) - Q + 1], [1]) is False  # padded rows past the model's positions
    for name in ("draft_captures", "captures"):
        armed = {1: [(6, 3)]}
        setattr(cache, name, armed)
        assert run([4, 5], [2, 1]) is False
        assert getattr(cache, name) == {1: [(6, 3)]}, name  # read, not consumed
        setattr(cache, name, {})
    graphs.failed[("insert", 2, Q)] = "RuntimeError: capture failed"
    assert run([4, 5], [2, 1]) is False
    assert graphs.stats.insert_eager_steps == 6 and graphs.stats.insert_replays == 0 and not graphs.graphs
    assert run([4], [2]) is True and graphs.stats.insert_replays == 1  # bucket 1 still captures and replays


def test_fixed_shape_insertion_needs_masked_padding_rows(model) -> None:
    """A fixed-shape step whose padding rows would write the sequences' own rings is refused (StaticInsert's
    docstring: such rows can overwrite a row the next draft pass reads once Q = slack + 2)."""
    cache, _ = insert_cache(model, CPU)
    step = StaticDecodeStep(cache, 2, int(model.args.max_position_embeddings), CPU, tokens=3)
    feats = torch.zeros(6, len(model.args.dspark_target_layer_ids) * model.args.hidden_size)
    with pytest.raises(InputError, match="write_padding"):
        dspark.insert_context(model, None, cache, feats, static=step)
