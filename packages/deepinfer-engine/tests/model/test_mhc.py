"""Block-level mHC wiring (docs/model.md §A.2 vs docs/model.md §C.2): V4 collapses each sub-layer with its own pre; V4.1
(delayed) uses the previous sub-layer's pre, stream 0 at layer 0, and returns the FFN pre for the next layer."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.block import Block
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.mhc import apply_hc_mix, hc_post, hc_pre
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from equality import init_random_


def _ctx(a, n):
    cache, bt = ModelCache.allocate_dense(a, [n], dtype=torch.float32)
    return ForwardContext.build(ForwardBatch.single(torch.arange(3, 3 + n), block_table=bt[0]), cache)


@pytest.mark.parametrize("cfg,delayed", [(tiny_v4_config, False), (tiny_v41_config, True)])
def test_block_collapse_rule(cfg, delayed):
    a = ModelArgs.from_config_dict(cfg())
    blk = init_random_(Block(a, a.plan(0), torch.float32), seed=3)
    n = 5
    r = torch.randn(n, a.hc_mult, a.hidden_size, generator=torch.Generator().manual_seed(4))
    pre_prev = torch.rand(n, a.hc_mult, generator=torch.Generator().manual_seed(5)) + 0.1
    for prev in (None, pre_prev) if delayed else (None,):
        got, got_pre = blk(r, _ctx(a, n), prev)
        ctx = _ctx(a, n)  # fresh cache: the reference run below must see the same (empty) window history
        pa, qa, ca = apply_hc_mix(blk, "hc_attn", r, a)
        x = (r[:, 0] if prev is None else hc_pre(r, prev)) if delayed else hc_pre(r, pa)
        r1 = hc_post(blk.attn(blk.attn_norm(x), ctx), r, qa, ca)
        pf, qf, cf = apply_hc_mix(blk, "hc_ffn", r1, a)
        x = hc_pre(r1, pa if delayed else pf)
        want = hc_post(blk.ffn(blk.ffn_norm(x), ctx.batch.input_ids), r1, qf, cf)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_pre, pf)
