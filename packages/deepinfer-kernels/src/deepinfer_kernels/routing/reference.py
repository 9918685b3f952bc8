"""Pure-torch reference of MoE routing (docs/model.md §A.8/§C.5): sqrtsoftplus scores, biased top-k selection,
hash routing, renormalisation over the selected experts and the routed scaling factor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gate_scores(x: Tensor, weight: Tensor, score_func: str) -> Tensor:
    """[T, E] fp32 scores of x [T, d] against weight [E, d]."""
    logits = x.float() @ weight.float().T
    if score_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"gate_scores: unknown score_func {score_func!r}")


def select_experts(
    scores: Tensor,
    topk: int,
    *,
    bias: Tensor | None = None,
    hash_ids: Tensor | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64). bias: [E] or per-token [T, E] (selection only);
    hash_ids [T, k] replace the selection (V4 hash layers). Weights come from the unbiased scores."""
    if hash_ids is not None:
        ids = hash_ids.to(torch.int64)
    else:
        sel = scores if bias is None else scores + bias.float()
        ids = torch.topk(sel, topk, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * route_scale, ids
