"""Per-forward batched cache plans (RingPlan / PagedPlan / check_block_tables) against hand-computed layouts."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_engine.errors import CapacityError
from deepinfer_engine.model.cache import ModelCache, check_block_tables
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext


def _ctx(ctx_lens, query_lens, slots, block_tables, page_size=8, ratios=None):
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, query_lens)])
    batch = ForwardBatch(
        input_ids=torch.zeros(pos.shape[0], dtype=torch.int64), positions=pos, query_lens=tuple(query_lens),
        slots=tuple(slots), block_tables=block_tables, logits_indices=torch.zeros(1, dtype=torch.int64),
    )  # fmt: skip
    cache = ModelCache(
        page_size=page_size, num_slots=4, num_pages=8, slack=0, swa={}, comp_state={}, compressed_kv={},
        index_keys={}, ratios=ratios or {}, token_ring=None,
    )  # fmt: skip
    return ForwardContext.build(batch, cache)


def test_ring_plan_gathers_history_then_writes_last_rows():
    # slot 2 holds positions 0..3 (value = 10 + position), ring of 4 rows; slot 0 is new
    ring = torch.zeros(4, 4, 1)
    ring[2, :, 0] = torch.tensor([10.0, 11, 12, 13])
    ctx = _ctx([4, 0], [6, 2], [2, 0], torch.zeros(2, 1, dtype=torch.int32))
    fresh = torch.tensor([14.0, 15, 16, 17, 18, 19, 0, 1])[:, None]  # seq 0: positions 4..9, seq 1: 0..1
    plan = ctx.ring_plan(4, (3, 3), write=True)
    pool = plan.gather(ring, fresh)
    assert plan.num_hist == 3  # seq 0: positions 1..3; seq 1 has no history
    assert pool[:3, 0].tolist() == [11, 12, 13]
    # seq 0 wrote only its last 4 positions 6..9 (rows 2, 3, 0, 1); seq 1 positions 0..1 into slot 0
    assert ring[2, :, 0].tolist() == [18, 19, 16, 17]
    assert ring[0, :, 0].tolist() == [0, 1, 0, 0]
    # causal window of 3: seq 0 position 4 sees 2, 3, 4; seq 1 position 0 sees only itself
    idx = ctx.window_rows(plan, 3, noncausal=False)
    vals = torch.where(idx >= 0, pool[idx.clamp(min=0), 0], torch.full(idx.shape, -1.0))
    assert vals[0].tolist() == [12, 13, 14]
    assert vals[5].tolist() == [17, 18, 19]
    assert vals[6].tolist() == [-1, -1, 0] and vals[7].tolist() == [-1, 0, 1]


def test_ring_plan_disjoint_flag():
    # a sequence reading b rows and writing n is disjoint modulo the ring exactly when b = 0 or b + n <= R
    boot = torch.zeros(2, 1, dtype=torch.int32)
    assert not _ctx([4, 0], [6, 2], [2, 0], boot).ring_plan(4, (3, 3), write=True).disjoint  # 3 + 6 > 4
    assert _ctx([4, 2], [1, 1], [2, 0], boot).ring_plan(4, (3, 3), write=True).disjoint  # decode: 3 + 1, 2 + 1
    assert not _ctx([4, 2], [2, 1], [2, 0], boot).ring_plan(4, (3, 3), write=True).disjoint  # 3 + 2 > 4
    assert _ctx([0, 0], [9, 2], [2, 0], boot).ring_plan(4, (3, 3), write=True).disjoint  # prefill: no history


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_ring_plan_gather_one_launch_equals_torch():
    # a decode-shaped plan (disjoint rows) through the ring_pool kernel (interpreter): same pool, same ring
    from kernels_testing import triton_interpreter

    g = torch.Generator().manual_seed(0)
    ring = torch.randn(4, 6, 2, 3, generator=g)
    fresh = torch.randn(3, 2, 3, generator=g)
    ctx = _ctx([9, 4, 2], [1, 1, 1], [3, 1, 0], torch.zeros(3, 1, dtype=torch.int32))
    plan = ctx.ring_plan(6, (5, 5, 5), write=True)
    assert plan.disjoint and plan.num_hist == 5 + 4 + 2
    want_ring = ring.clone()
    want = plan.gather(want_ring, fresh, backend="torch")
    with triton_interpreter("deepinfer_kernels.ring_pool.triton"):
        got = plan.gather(ring, fresh, backend="triton")
    assert torch.equal(got, want) and torch.equal(ring, want_ring)


def test_ring_plan_rejects_history_longer_than_ring():
    ctx = _ctx([10], [1], [0], torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(CapacityError, match="ring of 4 rows"):
        ctx.ring_plan(4, (5,), write=True)


def test_paged_plan_reads_and_writes_by_block_table():
    # page_size 8, ratio 2 -> 4 rows per page; seq 0 uses pages 5, 2; seq 1 page 0
    store = torch.zeros(6, 4, 1)
    bt = torch.tensor([[5, 2], [0, -1]], dtype=torch.int32)
    ctx = _ctx([6, 0], [5, 3], [0, 1], bt, ratios={0: 2})
    plan = ctx.paged_plan(2)
    # seq 0: entries 3..5 are new (positions 6..10 complete groups 3, 4); (6+5)//2 = 5 entries; seq 1: entry 0
    assert plan.new_w.tolist() == [3, 4, 0] and plan.new_seq.tolist() == [0, 0, 1]
    assert plan.counts == (5, 1) and plan.offsets == (0, 5)
    plan.write(store, torch.tensor([4.0, 5.0, 100.0])[:, None])
    assert store[5, 3, 0] == 4 and store[2, 0, 0] == 5 and store[0, 0, 0] == 100
    assert plan.read(store)[:, 0].tolist() == [0, 0, 0, 4, 5, 100]


def test_block_table_coverage_checked_once_on_host_facts():
    bt = torch.tensor([[3, -1]], dtype=torch.int32)
    check_block_tables(bt, 8, [2], [0], [8])  # 4 entries, all in page 0
    check_block_tables(bt, 8, [2], [8], [1])  # position 8 completes no ratio-2 entry: page 1 not needed yet
    with pytest.raises(CapacityError, match="no page"):
        check_block_tables(bt, 8, [2], [8], [2])
    with pytest.raises(CapacityError, match="block table has 2 pages"):
        check_block_tables(bt, 8, [1], [16], [1])


def test_block_table_coverage_names_the_first_failing_sequence() -> None:
    """The whole-batch check raises what a check sequence by sequence raises first (or nothing)."""
    import random

    import numpy as np

    def by_sequence(bt, page_size, ratios, ctx, qlen):
        for i, (c, n) in enumerate(zip(ctx, qlen)):
            k = -(-max((c + n) // r * r for r in ratios) // page_size)
            if k > bt.shape[1]:
                return f"sequence {i}: block table has {bt.shape[1]} pages, entry needs page {k - 1}"
            if k and (bt[i, :k] < 0).any():
                return f"sequence {i}: block table has no page (-1) for a needed compressed entry"
        return None

    rng = random.Random(0)
    for _ in range(300):
        S, width, ratios = rng.randint(0, 5), rng.randint(1, 4), rng.choice([[1], [4], [4, 128], [2, 8]])
        bt = np.array([[rng.choice([-1, 0, 1, 2, 3]) for _ in range(width)] for _ in range(S)],
                      dtype=np.int32).reshape(S, width)
        ctx, qlen = [rng.randint(0, 40) for _ in range(S)], [rng.randint(1, 9) for _ in range(S)]
        want = by_sequence(bt, 8, ratios, ctx, qlen)
        try:
            check_block_tables(bt, 8, ratios, ctx, qlen)
            got = None
        except CapacityError as err:
            got = str(err)
        assert got == want, (bt.tolist(), ratios, ctx, qlen)
