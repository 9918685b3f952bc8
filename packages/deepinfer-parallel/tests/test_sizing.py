"""EP sizing against the arithmetic of docs/runtime.md §6.3 and docs/checkpoint.md §8.2 (V4.1-Flash)."""

from __future__ import annotations

import pytest
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.sizing import (
    dispatch_buffer_bytes,
    estimate_gpu_memory,
    expert_bytes,
    resolve_num_redundant_experts,
    smallest_ep_that_fits,
)

GB = 10**9
# V4.1-Flash numbers from config.json: 40 MoE layers x 384 experts, hidden 5120, moe_intermediate 2304; DSpark:
# 3 stages x 128 experts. Replicated weights ~= 10.6 GB (docs/runtime.md §4.1 / §6.3, Engram tables on host).
MAIN = dict(num_layers=40, num_experts=384, hidden_size=5120, moe_intermediate_size=2304)
DRAFT = dict(num_layers=3, num_experts=128, hidden_size=5120, moe_intermediate_size=2304)
REPLICATED = 10_600_000_000


def _v41(**overrides):
    kw = dict(replicated_bytes=REPLICATED, routed_expert_bytes=expert_bytes(**MAIN), num_experts=384,
              draft_expert_bytes=expert_bytes(**DRAFT))
    kw.update(overrides)
    return kw


def test_expert_bytes_match_architecture_doc():
    # docs/checkpoint.md §8.2: 543,581,798,400 routed params x (0.5 + 1/32) B = 288.8 GB; docs/runtime.md: draft 7.2 GB.
    assert expert_bytes(**MAIN) == 543_581_798_400 * 17 // 32
    assert round(expert_bytes(**MAIN) / GB, 1) == 288.8
    assert round(expert_bytes(**DRAFT) / GB, 1) == 7.2
    assert expert_bytes(**MAIN, weight_bits=8, scale_block=0) == 543_581_798_400


@pytest.mark.parametrize(
    "ep,routed_gb,total_gb",
    # docs/runtime.md §6.3 table: routed experts per GPU (main + draft) and + replicated, as printed there.
    [(1, 296, 307), (2, 148, 159), (4, 74, 85), (8, 37, 48), (64, 4.6, 15)],
)
def test_table_of_runtime_doc(ep, routed_gb, total_gb):
    est = estimate_gpu_memory(ep_size=ep, **_v41())
    routed = (est.routed_expert_bytes + est.draft_expert_bytes) / GB
    digits = 1 if isinstance(routed_gb, float) else 0
    assert round(routed, digits) == routed_gb
    assert round(est.total_bytes / GB) == total_gb


def test_smallest_ep_that_fits_gpus_of_the_doc():
    # docs/runtime.md §6.3: H100/H800 80 GB -> EP8; H200 141 GB -> EP4; B300 ~270 GB -> EP2 (before KV/activations).
    assert smallest_ep_that_fits(budget_bytes=80 * GB, **_v41()).ep_size == 8
    assert smallest_ep_that_fits(budget_bytes=141 * GB, **_v41()).ep_size == 4
    assert smallest_ep_that_fits(budget_bytes=270 * GB, **_v41()).ep_size == 2
    # B200 180 GB fits EP2 "only with ~15 GB left"; asking for 30 GB free pushes it to EP4.
    assert smallest_ep_that_fits(budget_bytes=180 * GB, **_v41()).ep_size == 2
    assert smallest_ep_that_fits(budget_bytes=180 * GB, min_free_bytes=30 * GB, **_v41()).ep_size == 4
    with pytest.raises(ParallelConfigError, match="no EP size"):
        smallest_ep_that_fits(budget_bytes=10 * GB, **_v41())


def test_redundant_experts_scale_the_routed_share():
    base = estimate_gpu_memory(ep_size=64, **_v41(draft_expert_bytes=0))
    extra = estimate_gpu_memory(ep_size=64, num_redundant_experts=64, **_v41(draft_expert_bytes=0))
    # 448 slots instead of 384: routed share x 448/384 (one extra expert per GPU at EP64).
    assert extra.routed_expert_bytes == -(-expert_bytes(**MAIN) * 448 // (384 * 64))
    assert extra.routed_expert_bytes - base.routed_expert_bytes == pytest.approx(expert_bytes(**MAIN) / 384, rel=1e-9)
    with pytest.raises(ParallelConfigError, match="num_redundant_experts"):
        estimate_gpu_memory(ep_size=64, num_redundant_experts=10, **_v41())


def test_resolve_redundant_and_buffers():
    assert resolve_num_redundant_experts(num_experts=384, ep_size=64, min_redundant=10) == 64
    assert resolve_num_redundant_experts(num_experts=384, ep_size=5, min_redundant=0) == 1
    assert resolve_num_redundant_experts(num_experts=384, ep_size=8) == 0
    assert dispatch_buffer_bytes(max_tokens_per_rank=256, hidden_size=5120, top_k=6) == 256 * 6 * 5120 * 3
    est = estimate_gpu_memory(ep_size=8, comm_buffer_bytes=1, activation_bytes=2, kv_state_bytes=3, **_v41())
    assert est.total_bytes == est.weight_bytes + 6
    with pytest.raises(ParallelConfigError, match="ep_size"):
        estimate_gpu_memory(ep_size=0, **_v41())
