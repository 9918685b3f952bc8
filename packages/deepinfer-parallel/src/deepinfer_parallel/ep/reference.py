"""Pure-torch references of the expert-parallel MoE: the single-process MoE every dispatch/combine path is tested
against, and a local-expert runner for dispatched rows (grouped by slot with one host read; the engine's grouped
GEMM replaces it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepinfer_kernels.moe import swiglu_expert
from torch import Tensor

__all__ = ["reference_moe", "run_local_experts", "swiglu_local_experts"]


def reference_moe(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, expert_fn: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Single-process definition: `out[t] = sum_k w[t, k] * expert_fn(topk_ids[t, k], x[t])`, ids < 0 skipped,
    float32 accumulation. expert_fn(e, rows [n, hidden]) -> [n, hidden]."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, k = (topk_ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, expert_fn(e, x[tok]).to(torch.float32) * topk_weights[tok, k, None].to(torch.float32))
    return out.to(x.dtype)


def run_local_experts(recv_x: Tensor, recv_slot: Tensor, expert_fn: Callable[[int, Tensor], Tensor]) -> Tensor:
    """`[R, hidden]` outputs of `expert_fn(local_slot, rows)` for every dispatched row; padding rows (slot -1) -> 0."""
    out = torch.zeros_like(recv_x)
    for s in torch.unique(recv_slot[recv_slot >= 0]).tolist():
        rows = (recv_slot == s).nonzero().squeeze(-1)
        out[rows] = expert_fn(int(s), recv_x[rows]).to(out.dtype)
    return out


def swiglu_local_experts(
    recv_x: Tensor, recv_slot: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float
) -> Tensor:
    """The clamped-SwiGLU experts of one rank on dispatched rows: w1, w3 `[S, inter, hidden]`, w2
    `[S, hidden, inter]` stacked by local slot (deepinfer_kernels.moe.swiglu_expert per slot)."""
    return run_local_experts(recv_x, recv_slot, lambda s, rows: swiglu_expert(rows, w1[s], w3[s], w2[s], limit))
