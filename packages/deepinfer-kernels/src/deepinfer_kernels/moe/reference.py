"""Pure-torch reference of the MoE expert computation (architecture.md §2 clamped SwiGLU, §A.8 combine)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu_expert(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float) -> Tensor:
    """y = w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L)); gate/up in fp32; returns x's dtype. x [T, d]."""
    g = F.linear(x, w1.to(x.dtype)).float()
    u = F.linear(x, w3.to(x.dtype)).float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    h = (F.silu(g) * u).to(x.dtype)
    return F.linear(h, w2.to(x.dtype))


def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    experts: Sequence[tuple[Tensor, Tensor, Tensor]],
    limit: float,
) -> Tensor:
    """sum_k weights[t,k] * Expert_{ids[t,k]}(x[t]) -> [T, d] fp32. experts[e] = (w1, w3, w2)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w1, w3, w2 = experts[e]
        y = swiglu_expert(x[tok], w1, w3, w2, limit).float()
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out
