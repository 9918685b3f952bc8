"""Expert weight movement: the transfer plan, local-only moves, and any-dtype moves across gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from deepinfer_parallel.eplb.shuffle import move_expert_weights, plan_transfers
from deepinfer_parallel.errors import PlacementError
from deepinfer_parallel.state import ParallelState


def test_plan_by_hand():
    # 2 ranks x 3 slots. old: r0 {0,1,2} r1 {3,4,0}; new: r0 {0,3,3} r1 {1,2,4}
    plan = plan_transfers([0, 1, 2, 3, 4, 0], [0, 3, 3, 1, 2, 4], 2)
    assert plan == {(1, 0): [3], (0, 1): [1, 2]}
    # expert 0 is held by both ranks: a rank that needs it takes it from holder number dst mod 2
    plan = plan_transfers([0, 1, 2, 0, 3, 4], [1, 2, 3, 0, 0, 4], 2)
    assert plan == {(1, 0): [3]}
    with pytest.raises(PlacementError, match="held by no slot"):
        plan_transfers([0, 1], [2, 1], 1)
    with pytest.raises(PlacementError, match="equal length"):
        plan_transfers([0, 1, 2], [0, 1], 1)


def test_local_permutation_keeps_bytes():
    state = ParallelState.single()
    w = torch.arange(4 * 6, dtype=torch.int8).view(4, 6)
    s = torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.float8_e4m3fn)
    w0, s0 = w.clone(), s.clone()
    ptr = w.data_ptr()
    got = move_expert_weights([w, s], torch.tensor([0, 1, 2, 3]), torch.tensor([3, 3, 0, 1]), state)
    assert got == 0 and w.data_ptr() == ptr
    assert torch.equal(w, w0[[3, 3, 0, 1]])
    assert torch.equal(s.view(torch.uint8), s0.view(torch.uint8)[[3, 3, 0, 1]])
    with pytest.raises(PlacementError, match="one row per local slot"):
        move_expert_weights([w[:3]], torch.tensor([0, 1, 2, 3]), torch.tensor([3, 3, 0, 1]), state)


def _expert_bytes(e: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(e)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _move_across_ranks(state) -> None:
    world, me = state.ep_size, state.ep_rank
    spr, num_experts = 3, 2 * world
    g = torch.Generator().manual_seed(7)
    old = torch.cat([torch.arange(num_experts), torch.randint(0, num_experts, (spr * world - num_experts,), generator=g)])
    new = old[torch.randperm(old.numel(), generator=g)]
    specs = [((5, 4), torch.int8), ((5, 2), torch.float8_e8m0fnu), ((3,), torch.float32), ((2, 2), torch.bfloat16)]

    def local(phy2log):
        ids = phy2log[me * spr : (me + 1) * spr].tolist()
        return [torch.stack([_expert_bytes(e, shape, dtype) for e in ids]).to(state.device) for shape, dtype in specs]

    tensors = local(old)
    # NCCL: a batched P2P call may involve a subset of ranks only once the group has run a collective
    dist.barrier(group=state.ep_group)
    move_expert_weights(tensors, old, new, state)
    for got, want in zip(tensors, local(new)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_move_across_gloo_ranks_any_dtype(world):
    from parallel_testing import run_ranks

    run_ranks(_move_across_ranks, world, timeout_s=80)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.multigpu(2)),
                                   pytest.param(4, marks=pytest.mark.multigpu(4))])
@pytest.mark.timeout(300)
def test_move_across_nccl_ranks_any_dtype(world):
    from parallel_testing import run_ranks

    run_ranks(_move_across_ranks, world, backend="nccl", devices=[f"cuda:{r}" for r in range(world)],
              start_method="spawn", timeout_s=280)
