"""MoE gate scores and top-k selection (architecture.md §A.8/§C.5). Reference backend only for now."""

from __future__ import annotations

from torch import Tensor

from deepinfer_kernels.routing import reference

__all__ = ["gate_scores", "select_experts"]


def gate_scores(x: Tensor, weight: Tensor, score_func: str) -> Tensor:
    """x [T, d], weight [E, d] -> [T, E] fp32."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gate_scores: expected x [T,d], weight [E,d]; found {tuple(x.shape)}, {tuple(weight.shape)}")
    return reference.gate_scores(x, weight, score_func)


def select_experts(
    scores: Tensor,
    topk: int,
    *,
    bias: Tensor | None = None,
    hash_ids: Tensor | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """scores [T, E] fp32 -> (weights [T, topk] fp32, ids [T, topk] int64)."""
    if topk < 1 or topk > scores.shape[-1]:
        raise ValueError(f"select_experts: topk {topk} not in [1, {scores.shape[-1]}]")
    if hash_ids is not None and hash_ids.shape != (scores.shape[0], topk):
        raise ValueError(f"select_experts: hash_ids shape {tuple(hash_ids.shape)}, expected ({scores.shape[0]}, {topk})")
    if bias is not None and bias.shape[-1] != scores.shape[-1]:
        raise ValueError(f"select_experts: bias last dim {bias.shape[-1]}, expected {scores.shape[-1]}")
    return reference.select_experts(
        scores, topk, bias=bias, hash_ids=hash_ids, route_scale=route_scale, renormalize=renormalize
    )
