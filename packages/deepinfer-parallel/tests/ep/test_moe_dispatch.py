"""MoEDispatch strategies: EPDispatch (dispatch -> local experts -> combine) against LocalDispatch (all experts
on one rank) on the same tokens, in one process and on gloo world 2, with and without redundant experts."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.moe import StackedExperts, moe_experts
from deepinfer_parallel import EPDispatch, LocalDispatch, MoEDispatch
from deepinfer_parallel.ep import EPDispatcher, ExpertPlacement
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.state import ParallelState

HIDDEN, INTER, EXPERTS, TOP_K, MAX_TOKENS, LIMIT = 64, 32, 8, 2, 16, 0.5


def _weights():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w3 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return w1, w3, w2


def _experts(w1, w3, w2):
    """LocalExperts over stacked weights (the engine's Experts module computes the same)."""
    stacked = StackedExperts(w1, w3, w2)
    return lambda x, weights, ids: moe_experts(x, weights, ids, stacked, LIMIT)


def _tokens(rank: int, n: int, seed: int):
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.argsort(torch.rand(n, EXPERTS, generator=g), dim=1)[:, :TOP_K].contiguous()
    w = torch.rand(n, TOP_K, generator=g)
    return x, ids, w


def _check(state: ParallelState) -> None:
    """Every mode, identity placement and one with 2 redundant slots; rank 1 has no tokens in round 0."""
    world, rank = state.ep_size, state.rank
    w1, w3, w2 = _weights()
    everything = _experts(w1, w3, w2)
    placements = {EXPERTS: None, EXPERTS + 2: ExpertPlacement.initial(num_layers=1, num_experts=EXPERTS,
                                                                      num_physical=EXPERTS + 2)}
    for physical, placement in placements.items():
        disp = EPDispatcher(state, num_physical_experts=physical, hidden_size=HIDDEN, top_k=TOP_K,
                            max_tokens_per_rank=MAX_TOKENS, dtype=torch.float32)
        spr = physical // world
        if placement is None:
            local = list(range(rank * spr, (rank + 1) * spr))
        else:
            local = placement.local_experts(0, state.ep_rank, world).tolist()
        mine = _experts(w1[local], w3[local], w2[local])
        for mode in ("throughput", "low_latency"):
            strategy = EPDispatch(disp, placement=placement, mode=mode)
            assert isinstance(strategy, MoEDispatch)
            for round_ in range(2):
                n = 0 if (rank == 1 and round_ == 0) else (MAX_TOKENS, 5, 3)[(rank + round_) % 3]
                x, ids, w = _tokens(rank, n, round_)
                want = LocalDispatch().run(x, w, ids, everything, layer=0)
                got = strategy.run(x, w, ids, mine, layer=0)
                assert got.shape == want.shape == (n, HIDDEN) and got.dtype == torch.float32
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_single_process() -> None:
    _check(ParallelState.single())


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gloo_world_2_matches_local_dispatch() -> None:
    from parallel_testing import run_ranks

    run_ranks(_check, 2, timeout_s=80)


def test_local_dispatch_is_the_local_expert_call() -> None:
    w1, w3, w2 = _weights()
    x, ids, w = _tokens(0, 6, 0)
    experts = _experts(w1, w3, w2)
    assert torch.equal(LocalDispatch().run(x, w, ids, experts), experts(x, w, ids))


def test_errors() -> None:
    disp = EPDispatcher(ParallelState.single(), num_physical_experts=EXPERTS + 2, hidden_size=HIDDEN,
                        top_k=TOP_K, max_tokens_per_rank=4, dtype=torch.float32)
    with pytest.raises(ParallelConfigError, match="mode"):
        EPDispatch(disp, mode="fast")
    placement = ExpertPlacement.initial(num_layers=1, num_experts=EXPERTS, num_physical=EXPERTS + 2)
    x, ids, w = _tokens(0, 3, 0)
    with pytest.raises(ParallelConfigError, match="layer"):
        EPDispatch(disp, placement=placement).run(x, w, ids, _experts(*_weights()))
