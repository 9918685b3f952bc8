"""The DSpark stages' parallel pass over a fixed-shape step (static_step.py with N tokens per sequence, the form
the engine's CUDA graph captures) gives the exact pass's base logits and hidden rows (CPU, fp32, no graph): three
sequences with contexts shorter than, equal to and past the stage window, in a bucket of 4 (one padding
sequence reading the scratch slot). Tolerance: max|Δ| / max|ref| <= 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.dspark import draft_block, draft_block_ids, insert_context, target_features
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_dspark_config
from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep
from equality import init_random_, max_rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


def _compare(model: Transformer) -> None:
    a = model.args
    N, W = a.dspark_block_size, a.sliding_window
    lens = [3, W, W + 7]  # the anchor positions: context below, at and past the window
    cache, bt = ModelCache.allocate_dense(a, [n + N + 8 for n in lens], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    tids = tuple(a.dspark_target_layer_ids)
    for slot, n in enumerate(lens):  # target prefill and draft context of positions < n
        ids = torch.randint(3, a.vocab_size, (n,), generator=gen)
        batch = ForwardBatch.single(ids, slot=slot, block_table=bt[slot])
        out = model.forward_features(batch, cache, capture=tids)
        insert_context(model, batch, cache, target_features(out.features, tids))
    anchors = torch.randint(3, a.vocab_size, (len(lens),), generator=gen)
    ids = draft_block_ids(anchors, N, a.dspark_noise_token_id)
    pos = torch.cat([torch.arange(n, n + N) for n in lens])
    tables = np.full((len(lens), 1), -1, dtype=np.int32)
    batch = ForwardBatch(
        input_ids=ids, positions=pos, query_lens=(N,) * len(lens), slots=tuple(range(len(lens))),
        block_tables=torch.from_numpy(tables), logits_indices=torch.zeros(1, dtype=torch.int64),
        host=StepHost(ctx_lens=tuple(lens), input_ids=ids.numpy(), block_tables=tables),
    )  # fmt: skip
    ref = draft_block(model, batch, cache)
    step = StaticDecodeStep(cache, 4, a.max_position_embeddings, "cpu", tokens=N)
    step.fill(DecodeFacts.of(batch, N))
    got = draft_block(model, None, cache, static=step)
    T = len(lens) * N
    assert got.base_logits.shape[0] == 4 * N
    assert max_rel_err(got.base_logits[:T], ref.base_logits) <= TOL
    assert max_rel_err(got.hidden[:T], ref.hidden) <= TOL


def test_static_draft_pass_equals_exact_v41(make_tiny_v41_model):
    _compare(make_tiny_v41_model(2))


def test_static_draft_pass_equals_exact_v4_0731():
    args = ModelArgs.from_config_dict(tiny_v4_dspark_config())
    _compare(init_random_(Transformer(args, torch.float32), seed=2).eval())
