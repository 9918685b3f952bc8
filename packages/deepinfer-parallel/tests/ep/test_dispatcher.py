"""EPDispatcher (throughput and low-latency modes, plain and FP8 payloads) against the single-process MoE: one
process, and gloo worlds of 2 and 4 ranks with random routing, redundant experts and a rank with zero tokens."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.moe import moe_experts, swiglu_expert
from deepinfer_parallel.ep import (
    EPDispatcher,
    ExpertPlacement,
    reference_moe,
    run_local_experts,
    swiglu_local_experts,
)
from deepinfer_parallel.ep.fp8_payload import decode_fp8_rows, encode_fp8_rows
from deepinfer_parallel.eplb import rebalance_experts
from deepinfer_parallel.errors import ParallelConfigError, PlacementError
from deepinfer_parallel.state import ParallelState

HIDDEN, INTER, EXPERTS, TOP_K, SLOTS, MAX_TOKENS, LIMIT = 128, 32, 6, 2, 8, 12, 0.5


def _assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, atol=atol, rtol=1e-5), float((a - b).abs().max())


def _weights():
    g = torch.Generator().manual_seed(0)
    lin = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    w1 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w3 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return lin, w1, w3, w2


def _placement(ep_size: int) -> ExpertPlacement:
    load = torch.tensor([[50.0, 1.0, 1.0, 20.0, 1.0, 1.0]])
    phy2log, log2phy, logcnt = rebalance_experts(load, SLOTS, 1, 1, ep_size)
    return ExpertPlacement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)


def _tokens(rank: int, num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.argsort(torch.rand(num_tokens, EXPERTS, generator=g), dim=1)[:, :TOP_K].contiguous()
    if num_tokens:
        ids[0, 1] = -1  # an unrouted column, whose weight must be ignored
    w = torch.rand(num_tokens, TOP_K, generator=g)
    if num_tokens:
        w[0, 1] = float("nan")
    return x, ids, w


def _check_all(state: ParallelState) -> None:
    """Every mode x payload x expert function on this rank's tokens; rank 1 has no tokens in round 0."""
    rank, world = state.rank, state.ep_size
    placement = _placement(world)
    local = placement.local_experts(0, state.ep_rank, world)  # logical expert of each local slot
    dev = state.device
    lin, w1, w3, w2 = (t.to(dev) for t in _weights())
    fns = {
        "tanh": (lambda e, rows: torch.tanh(rows @ lin[e]), lambda s, rows: torch.tanh(rows @ lin[int(local[s])])),
        "swiglu": (lambda e, rows: swiglu_expert(rows, w1[e], w3[e], w2[e], LIMIT), None),
    }
    for fp8 in (None, 32, 128):
        d = EPDispatcher(state, num_physical_experts=SLOTS, hidden_size=HIDDEN, top_k=TOP_K,
                         max_tokens_per_rank=MAX_TOKENS, dtype=torch.float32, fp8_block=fp8)
        for mode in ("throughput", "low_latency"):
            for round_ in range(2):  # a second round reuses the low-latency buffers with other sizes
                n = (0 if rank == 1 and round_ == 0 else (MAX_TOKENS, 5, 3, 7)[(rank + round_) % 4])
                x, ids, w = (t.to(dev) for t in _tokens(rank, n, round_))
                slots = placement.map_to_physical(0, ids, ep_rank=state.ep_rank)
                shared = torch.randn(n, HIDDEN).to(dev)
                xq = x if fp8 is None else decode_fp8_rows(encode_fp8_rows(x, fp8), HIDDEN, fp8, torch.float32)
                for name, (ref_fn, local_fn) in fns.items():
                    out = d.dispatch(x, slots, mode=mode)
                    assert bool((out.recv_slot < SLOTS // world).all())
                    valid = out.recv_slot >= 0
                    assert torch.equal(out.recv_count, torch.bincount(out.recv_slot[valid], minlength=SLOTS // world))
                    if name == "swiglu":
                        idx = local.tolist()
                        y = swiglu_local_experts(out.recv_x, out.recv_slot, w1[idx], w3[idx], w2[idx], LIMIT)
                    else:
                        y = run_local_experts(out.recv_x, out.recv_slot, local_fn)
                    if mode == "low_latency":
                        y[~valid] = float("nan")  # padding rows must never be read back
                    got = d.combine(y, out.handle, w, bias=shared)
                    ref = reference_moe(xq, ids, torch.nan_to_num(w), ref_fn) + shared
                    _assert_close(got, ref, atol=1e-5)
                    if name == "swiglu":  # also the kernels' own grouped MoE reference
                        experts = [(w1[e], w3[e], w2[e]) for e in range(EXPERTS)]
                        routed = torch.where(ids >= 0, torch.nan_to_num(w), torch.zeros_like(w))
                        ref2 = moe_experts(xq, routed, ids.clamp(min=0), experts, LIMIT) + shared
                        _assert_close(got, ref2, atol=1e-5)


def test_single_process_all_modes():
    _check_all(ParallelState.single())


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_match_single_process_moe(world):
    from parallel_testing import run_ranks

    run_ranks(_check_all, world, timeout_s=80)


def test_errors():
    d = EPDispatcher(ParallelState.single(), num_physical_experts=SLOTS, hidden_size=HIDDEN, top_k=TOP_K,
                     max_tokens_per_rank=4, dtype=torch.float32)
    x, ids, w = _tokens(0, 3, 0)
    with pytest.raises(PlacementError, match="topk_slots"):
        d.dispatch(x, torch.full((3, TOP_K), SLOTS), mode="throughput")
    with pytest.raises(PlacementError, match="expected x"):
        d.dispatch(x[:2], ids)
    with pytest.raises(PlacementError, match="max_tokens_per_rank"):
        d.dispatch(torch.randn(5, HIDDEN), torch.zeros(5, TOP_K, dtype=torch.int64), mode="low_latency")
    out = d.dispatch(x, ids.clamp(min=0))
    with pytest.raises(PlacementError, match="expert_out"):
        d.combine(out.recv_x[:-1], out.handle, w)
    with pytest.raises(PlacementError, match="topk_weights"):
        d.combine(out.recv_x, out.handle, w[:, :1])
    with pytest.raises(ParallelConfigError, match="num_physical_experts"):
        EPDispatcher(ParallelState.single(), num_physical_experts=0, hidden_size=HIDDEN, top_k=TOP_K)


def test_load_hook_sees_layer_and_slots():
    seen = []
    d = EPDispatcher(ParallelState.single(), num_physical_experts=SLOTS, hidden_size=HIDDEN, top_k=TOP_K,
                     dtype=torch.float32, load_hook=lambda layer, s: seen.append((layer, s.clone())))
    x, ids, _ = _tokens(0, 3, 0)
    d.dispatch(x, ids, layer=5)
    d.dispatch(x, ids)  # no layer: not recorded
    assert len(seen) == 1 and seen[0][0] == 5 and torch.equal(seen[0][1], ids)


def test_reference_moe_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    ids = torch.tensor([[0, 1], [1, -1]])
    w = torch.tensor([[0.5, 2.0], [1.0, 9.0]])
    out = reference_moe(x, ids, w, lambda e, rows: rows * (e + 1))
    assert out.tolist() == [[0.5 * 1 + 2.0 * 2, 0.5 * 2 + 2.0 * 4], [6.0, 8.0]]


@pytest.mark.gpu
def test_low_latency_path_replays_in_a_cuda_graph():
    """No host read in the low-latency path (FP8 payload included): it captures, and a replay on new inputs equals
    an eager run. (World of 1, so the all-to-all is a copy; NCCL's all_to_all_single is capturable itself.)"""
    d = EPDispatcher(ParallelState.single("cuda"), num_physical_experts=SLOTS, hidden_size=HIDDEN, top_k=TOP_K,
                     max_tokens_per_rank=MAX_TOKENS, dtype=torch.float32, fp8_block=128)
    x, ids, w = (t.cuda() for t in _tokens(0, MAX_TOKENS, 0))
    w = torch.nan_to_num(w)

    def step():
        out = d.dispatch(x, ids, mode="low_latency")
        return d.combine(torch.tanh(out.recv_x), out.handle, w)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x2, ids2, w2 = (t.cuda() for t in _tokens(1, MAX_TOKENS, 3))
    x.copy_(x2)
    ids.copy_(ids2)
    w.copy_(torch.nan_to_num(w2))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(captured.clone(), step())


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_nccl_world_of_one_matches_single_process_moe():
    from parallel_testing import run_ranks

    run_ranks(_check_all, 1, backend="nccl", devices=["cuda:0"], start_method="spawn", timeout_s=280)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.multigpu(2)),
                                   pytest.param(4, marks=pytest.mark.multigpu(4))])
@pytest.mark.timeout(300)
def test_nccl_ranks_match_single_process_moe(world):
    from parallel_testing import run_ranks

    run_ranks(_check_all, world, backend="nccl", devices=[f"cuda:{r}" for r in range(world)], start_method="spawn",
              timeout_s=280)
