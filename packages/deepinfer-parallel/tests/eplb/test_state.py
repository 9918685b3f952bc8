"""EPLBState in a running MoE loop: loads counted through the dispatcher's hook, rebalance due on schedule, expert
weights in checkpoint formats (FP4 packed + UE8M0, FP8 + fp32 scales) moved between gloo ranks mid-run, and the MoE
output unchanged (equal to the single-process MoE before and after)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.moe import swiglu_expert
from deepinfer_kernels.quant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.ep import EPDispatcher, reference_moe, run_local_experts
from deepinfer_parallel.eplb.state import EPLBState
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.state import ParallelState

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER, LIMIT, TOKENS = 2, 8, 2, 64, 32, 1.0, 10


def _checkpoint_experts():
    """Per layer: w1 / w3 FP4 (packed int8 + e8m0 per 32), w2 FP8 e4m3 + fp32 32x32 block scales, stacked [E, ...]."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        q = {k: [] for k in ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s")}
        for _ in range(EXPERTS):
            for name, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN))):
                w, s = quant_fp4(torch.randn(shape, generator=g) / HIDDEN**0.5)
                q[name].append(w)
                q[f"{name}_s"].append(s)
            w, s = quant_fp8_block(torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5, block=32, scale_fmt=None)
            q["w2"].append(w)
            q["w2_s"].append(s)
        layers.append([torch.stack(q[k]) for k in ("w1", "w1_s", "w3", "w3_s", "w2", "w2_s")])
    return layers


def _expert(tensors, i, rows):
    w1, w1s, w3, w3s, w2, w2s = (t[i] for t in tensors)
    return swiglu_expert(rows, dequant_fp4(w1, w1s), dequant_fp4(w3, w3s), dequant_fp8_block(w2, w2s, 32), LIMIT)


def _batch(rank: int, step: int, n: int):
    g = torch.Generator().manual_seed(97 * step + rank)
    x = torch.randn(n, HIDDEN, generator=g)
    # skewed routing: experts 0 and 1 are hot
    scores = torch.rand(n, EXPERTS, generator=g) + torch.tensor([2.0, 1.0] + [0.0] * (EXPERTS - 2))
    ids = torch.topk(scores + 0.5 * torch.rand(n, EXPERTS, generator=g), TOP_K).indices
    return x, ids, torch.rand(n, TOP_K, generator=g)


def _moe(state, eplb, dispatcher, local, layer, x, ids, w, mode):
    placement = eplb.placement
    slots = placement.map_to_physical(layer, ids, ep_rank=state.ep_rank)
    out = dispatcher.dispatch(x, slots, mode=mode, layer=layer)
    mine = placement.local_experts(layer, state.ep_rank, state.ep_size)
    y = run_local_experts(out.recv_x, out.recv_slot, lambda s, rows: _expert(local[layer], s, rows))
    assert bool((out.recv_slot < mine.numel()).all())
    return dispatcher.combine(y, out.handle, w)


def _run(state) -> dict:
    world = state.ep_size
    cfg = ParallelConfig(dp_size=world, ep_size=world, num_redundant_experts=world, enable_eplb=True,
                         eplb_window_size=4, eplb_step_interval=8)
    eplb = EPLBState(config=cfg, state=state, num_layers=LAYERS, num_experts=EXPERTS)
    dev = state.device
    full = [[t.to(dev) for t in layer] for layer in _checkpoint_experts()]
    initial = eplb.placement.phy2log.clone()
    local = []
    for layer in range(LAYERS):
        idx = eplb.placement.local_experts(layer, state.ep_rank, world)
        local.append([t[idx].clone() for t in full[layer]])
    ptrs = [t.data_ptr() for ts in local for t in ts]
    d = EPDispatcher(state, num_physical_experts=EXPERTS + world, hidden_size=HIDDEN, top_k=TOP_K,
                     max_tokens_per_rank=TOKENS, dtype=torch.float32, load_hook=eplb.record)
    probe = tuple(t.to(dev) for t in _batch(state.rank, 1000, 7))
    before_probe = None
    due_at, balance = [], []
    for step in range(1, 13):
        n = 0 if state.rank == world - 1 and step % 3 == 0 else TOKENS  # an idle rank now and then
        x, ids, w = (t.to(dev) for t in _batch(state.rank, step, n))
        mode = "throughput" if step % 2 else "low_latency"
        for layer in range(LAYERS):
            got = _moe(state, eplb, d, local, layer, x, ids, w, mode)
            want = reference_moe(x, ids, w, lambda e, rows, l=layer: _expert(full[l], e, rows))
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())
        if eplb.step():
            due_at.append(step)
            load = eplb.global_load()
            assert int(load.sum()) > 0
            old_balance = eplb.balancedness(load)
            before_probe = [_moe(state, eplb, d, local, l, *probe, "throughput") for l in range(LAYERS)]
            eplb.rearrange(lambda l: local[l], load=load)
            balance.append((old_balance.tolist(), eplb.balancedness(load).tolist()))
            after = [_moe(state, eplb, d, local, l, *probe, "low_latency") for l in range(LAYERS)]
            for a, b in zip(before_probe, after):
                assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), float((a - b).abs().max())
    assert [t.data_ptr() for ts in local for t in ts] == ptrs  # moved in place
    return {"due_at": due_at, "changed": not torch.equal(initial, eplb.placement.phy2log), "balance": balance,
            "window_after": eplb.recorder.num_steps}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_rebalance_mid_run_keeps_moe_output(world):
    from parallel_testing import run_ranks

    results = run_ranks(_run, world, timeout_s=110)
    for r in results:
        assert r["due_at"] == [2, 8]  # a quarter of the interval, then every interval
        assert r["changed"]  # hot experts got the redundant slots
        for old, new in r["balance"]:
            assert all(n >= o - 1e-9 for o, n in zip(old, new)), (old, new)
    assert len({str(r["balance"]) for r in results}) == 1  # every rank computed the same placement


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.multigpu(2)),
                                   pytest.param(4, marks=pytest.mark.multigpu(4))])
@pytest.mark.timeout(300)
def test_nccl_rebalance_mid_run_keeps_moe_output(world):
    from parallel_testing import run_ranks

    results = run_ranks(_run, world, backend="nccl", devices=[f"cuda:{r}" for r in range(world)],
                        start_method="spawn", timeout_s=280)
    assert all(r["due_at"] == [2, 8] and r["changed"] for r in results)


def test_single_process_state_and_errors():
    cfg = ParallelConfig(num_redundant_experts=2, enable_eplb=True, eplb_window_size=2, eplb_step_interval=4)
    eplb = EPLBState(config=cfg, state=ParallelState.single(), num_layers=1, num_experts=4)
    eplb.record(0, torch.tensor([[0, 4], [5, -1]]))  # slots 4, 5 hold copies of experts 0, 1
    assert eplb.recorder.current().tolist() == [[2, 1, 0, 0]]
    assert [eplb.step() for _ in range(4)] == [True, False, False, True]
    off = EPLBState(config=ParallelConfig(num_redundant_experts=2), state=ParallelState.single(), num_layers=1,
                    num_experts=4)
    assert not any(off.step() for _ in range(5000))
    with pytest.raises(ParallelConfigError, match="ep_size"):
        EPLBState(config=ParallelConfig(dp_size=2, ep_size=2), state=ParallelState.single(), num_layers=1,
                  num_experts=4)
