"""The cost policy's start-up profile: which graph shapes it times, and how (worker/spec_profile.py)."""

from __future__ import annotations

import types

import torch
from deepinfer_dspark import LatencyModel, StepPadding, VerifyPolicy
from deepinfer_engine.worker.cuda_graph import verify_row_sizes
from deepinfer_engine.worker.spec_decode import SpecDecoder
from deepinfer_engine.worker.spec_profile import (
    PROFILE_WARMUP,
    batch_profile_sizes,
    profile_batch_latency,
    profile_target_latency,
)


def test_batch_profile_sizes_are_the_row_buckets_of_the_batches_that_fit() -> None:
    batches = (1, 2, 4, 8, 16, 32, 64)
    roomy = dict(max_tokens=10_000, num_slots=64, pages=10_000, page_size=4)
    assert batch_profile_sizes(batches, 6, **roomy) == {b: verify_row_sizes(b, 6) for b in (16, 32, 64)}
    # launch-bound small batches get no curve of their own; a bucket needs its b slots and b * ceil(6 / 4) pages
    assert batch_profile_sizes(batches, 6, **{**roomy, "num_slots": 40}).keys() == {16, 32}
    assert batch_profile_sizes(batches, 6, **{**roomy, "pages": 2 * 32}).keys() == {16, 32}
    assert batch_profile_sizes(batches, 6, **roomy, min_batch=4).keys() == {4, 8, 16, 32, 64}
    # rows past the scheduler's token budget are never run: not profiled
    capped = batch_profile_sizes(batches, 6, **{**roomy, "max_tokens": 100})
    assert capped == {16: tuple(r for r in verify_row_sizes(16, 6) if r <= 100), 32: (32, 48, 64, 80, 96), 64: (64, 96)}
    assert 64 not in batch_profile_sizes(batches, 6, **{**roomy, "max_tokens": 90})  # one point left: no curve


def test_profile_batch_latency_times_b_sequences_at_every_row_bucket() -> None:
    """Each point is a step of exactly b sequences (the graph a verify step of b sequences replays), its rows
    spread 1 .. per per sequence, each sequence in its own slot and pages from position 0; every size is called
    PROFILE_WARMUP times untimed (a row bucket is captured on its third request) before the timed rounds."""
    calls = []

    def forward(batch) -> None:
        calls.append((batch.query_lens, batch.slots, batch.host.ctx_lens, batch.block_tables.tolist(),
                      batch.positions.tolist()))

    sizes = {4: verify_row_sizes(4, 3), 8: verify_row_sizes(8, 3)}
    curves = profile_batch_latency(forward, sizes, per=3, page_size=2, device=torch.device("cpu"), repeats=2)
    assert curves.keys() == sizes.keys()
    for b, rows in sizes.items():
        assert curves[b].sizes == list(rows) and curves[b].measured is not None
    for b, rows in sizes.items():
        for r in rows:
            mine = [c for c in calls if len(c[0]) == b and sum(c[0]) == r]
            assert len(mine) == PROFILE_WARMUP + 2
            lens, slots, ctx, tables, pos = mine[0]
            assert max(lens) - min(lens) <= 1 and 1 <= min(lens) and max(lens) <= 3
            assert slots == tuple(range(b)) and ctx == (0,) * b
            assert tables == [[2 * i, 2 * i + 1] for i in range(b)]  # ceil(3 / 2) pages each, none shared
            assert pos == [j for n in lens for j in range(n)]
    assert len(calls) == sum(len(r) for r in sizes.values()) * (PROFILE_WARMUP + 2)


def test_profile_target_latency_times_powers_of_two_as_verify_chunks() -> None:
    seen = []
    lat = profile_target_latency(lambda b: seen.append(b.query_lens), block_size=2, max_tokens=10, num_slots=3,
                                 pages=12, page_size=4, device=torch.device("cpu"), repeats=1)
    assert lat.sizes == [1, 2, 4, 8, 9]  # capped by 3 slots of k + 1 = 3 rows
    assert all(max(q) <= 3 for q in seen) and {sum(q) for q in seen} == {1, 2, 4, 8, 9}


def test_decoder_prices_a_graph_step_by_its_batch_bucket_curve() -> None:
    """A ragged graph step is priced by its batch bucket's curve when there is one, every other step by T(Q);
    a new curve given to set_policy prices every step (the batch curves go, unless given again)."""
    default = LatencyModel.affine(1e-3, 1e-6, 64)
    by_batch = {16: LatencyModel.affine(2e-3, 1e-5, 96)}
    dec = SpecDecoder(types.SimpleNamespace(block_size=5), policy=VerifyPolicy(kind="cost"), latency=default,
                      capture=(), max_position=1024, batch_latency=by_batch)
    assert dec.latency_for(StepPadding(16, verify_row_sizes(16, 6), ragged=True)) is by_batch[16]
    assert dec.latency_for(StepPadding(8, verify_row_sizes(8, 6), ragged=True)) is default
    assert dec.latency_for(None) is default
    fixed = LatencyModel.affine(5e-3, 0.0, 64)
    dec.set_policy(VerifyPolicy(kind="cost"), fixed)
    assert dec.batch_latency == {} and dec.latency_for(StepPadding(16, (16, 32), ragged=True)) is fixed
    dec.set_policy(VerifyPolicy(kind="threshold"))  # no curve given: the curves stay
    assert dec.latency is fixed
