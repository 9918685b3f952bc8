"""EP dispatch/combine vs. the single-process reference: one rank in-process, and 2 gloo ranks on the CPU."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.ep import ExpertPlacement, combine, dispatch, reference_moe
from deepinfer_parallel.eplb import rebalance_experts
from deepinfer_parallel.errors import PlacementError

HIDDEN, EXPERTS, TOP_K, SLOTS = 8, 6, 2, 8


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # torch.testing.assert_close costs seconds of lazy imports on first use; the check is simple enough by hand.
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), float((a - b).abs().max())


def _expert_weights() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0))


def _expert_fn(weights):
    return lambda e, rows: torch.tanh(rows @ weights[e])


def _placement() -> ExpertPlacement:
    load = torch.tensor([[50.0, 1.0, 1.0, 20.0, 1.0, 1.0]])
    phy2log, log2phy, logcnt = rebalance_experts(load, SLOTS, 1, 1, 2)
    return ExpertPlacement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)


def _tokens(rank: int, num_tokens: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)]).reshape(
        num_tokens, TOP_K
    )
    if num_tokens:
        ids[0, 1] = -1  # one unrouted column
    w = torch.rand(num_tokens, TOP_K, generator=g)
    return x, ids, w


def _run_local_experts(recv_x, recv_slot, placement, ep_rank, ep_size, weights):
    local = placement.local_experts(0, ep_rank, ep_size)  # logical expert of each local slot
    out = torch.empty_like(recv_x)
    fn = _expert_fn(weights)
    for s in torch.unique(recv_slot).tolist():
        rows = recv_slot == s
        out[rows] = fn(int(local[s]), recv_x[rows])
    return out


def test_single_rank_matches_reference():
    placement = _placement()
    weights = _expert_weights()
    x, ids, w = _tokens(0, 9)
    slots = placement.map_to_physical(0, ids)
    recv_x, recv_slot, handle = dispatch(x, slots, slots_per_rank=SLOTS)
    assert recv_x.shape[0] == int((ids >= 0).sum())
    y = _run_local_experts(recv_x, recv_slot, placement, 0, 1, weights)
    out = combine(y, handle, w)
    _assert_close(out, reference_moe(x, ids, w, _expert_fn(weights)))


def test_reference_moe_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    ids = torch.tensor([[0, 1], [1, -1]])
    w = torch.tensor([[0.5, 2.0], [1.0, 9.0]])
    out = reference_moe(x, ids, w, lambda e, rows: rows * (e + 1))
    assert out.tolist() == [[0.5 * 1 + 2.0 * 2, 0.5 * 2 + 2.0 * 4], [6.0, 8.0]]


def test_errors():
    x, ids, w = _tokens(0, 3)
    with pytest.raises(PlacementError, match="topk_slots"):
        dispatch(x, torch.full((3, TOP_K), SLOTS), slots_per_rank=SLOTS)
    with pytest.raises(PlacementError, match="equal T"):
        dispatch(x[:2], ids, slots_per_rank=SLOTS)
    recv_x, _, handle = dispatch(x, ids.clamp(min=0), slots_per_rank=SLOTS)
    with pytest.raises(PlacementError, match="expert_out"):
        combine(recv_x[:-1], handle, w)
    with pytest.raises(PlacementError, match="topk_weights"):
        combine(recv_x, handle, w[:, :1])


def _two_rank_worker(state) -> None:
    rank, world_size = state.rank, state.world_size
    placement = _placement()
    weights = _expert_weights()
    num_tokens = (9, 3)[rank]
    x, ids, w = _tokens(rank, num_tokens)
    slots = placement.map_to_physical(0, ids, ep_rank=rank)
    recv_x, recv_slot, handle = dispatch(x, slots, slots_per_rank=SLOTS // world_size)
    assert bool((recv_slot < SLOTS // world_size).all())
    y = _run_local_experts(recv_x, recv_slot, placement, rank, world_size, weights)
    out = combine(y, handle, w)
    _assert_close(out, reference_moe(x, ids, w, _expert_fn(weights)))
    # Everything routed to rank 0's slots only (rank 1 receives nothing) still round-trips.
    only0 = torch.where(ids >= 0, torch.zeros_like(ids), ids)
    recv_x, recv_slot, handle = dispatch(x, only0, slots_per_rank=SLOTS // world_size)
    if rank == 1:
        assert recv_x.shape[0] == 0
    y = _run_local_experts(recv_x, recv_slot, placement, rank, world_size, weights)
    ref_ids = torch.where(ids >= 0, torch.full_like(ids, int(placement.phy2log[0, 0])), ids)
    _assert_close(combine(y, handle, w), reference_moe(x, ref_ids, w, _expert_fn(weights)))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_gloo_ranks_match_reference():
    from deepinfer_parallel.testing import run_ranks

    run_ranks(_two_rank_worker, 2)
