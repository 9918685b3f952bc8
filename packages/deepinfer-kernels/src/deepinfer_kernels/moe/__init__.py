"""MoE experts: clamped SwiGLU expert and the routed combine (architecture.md §2, §A.8). Reference backend only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer_kernels.moe import reference
from deepinfer_kernels.moe.reference import swiglu_expert

__all__ = ["moe_experts", "swiglu_expert"]


def moe_experts(
    x: Tensor, weights: Tensor, ids: Tensor, experts: Sequence[tuple[Tensor, Tensor, Tensor]], limit: float
) -> Tensor:
    """x [T, d]; weights [T, k] fp32; ids [T, k] int64 in [0, E); experts[e] = (w1 [I,d], w3 [I,d], w2 [d,I]).
    Returns [T, d] fp32 (sum of weighted expert outputs; shared experts are the caller's)."""
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: weights {tuple(weights.shape)}, ids {tuple(ids.shape)}, x {tuple(x.shape)}")
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host read for both bounds
        if lo < 0 or hi >= len(experts):
            raise ValueError(f"moe_experts: expert ids must be in [0, {len(experts)}), found {lo}..{hi}")
    return reference.moe_experts(x, weights, ids, experts, limit)
