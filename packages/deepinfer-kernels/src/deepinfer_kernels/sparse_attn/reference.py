"""Pure-torch reference of sparse MQA attention with a per-head sink (architecture.md §A.4), dense-gather style.

Every query attends to the kv rows named by its index list (-1 = none); K = V = the full kv row; the sink logit
enters only the softmax denominator; softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sparse_attn(q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, softmax_scale: float) -> Tensor:
    """q [T, H, D], kv [S, D], indices [T, K] int64 (-1 invalid), attn_sink [H] -> o [T, H, D] in q's dtype."""
    valid = indices >= 0
    safe = indices.clamp(min=0)
    k = kv[safe].float()  # [T, K, D]
    scores = torch.einsum("thd,tkd->thk", q.float(), k) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = attn_sink.float()[None, :, None].expand(scores.shape[0], -1, 1)
    m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    p = e / denom
    return torch.einsum("thk,tkd->thd", p, k).to(q.dtype)
