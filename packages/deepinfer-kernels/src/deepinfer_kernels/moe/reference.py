"""Pure-torch reference of the MoE expert computation (docs/model.md §2 clamped SwiGLU, docs/model.md §A.8 combine)."""

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
    """sum_k weights[t,k] * Expert_{ids[t,k]}(x[t]) -> [T, d] fp32. experts[e] = (w1, w3, w2).

    Grouped: the T*k (token, expert) pairs are sorted by expert (stable, so each expert's tokens stay in token
    order) and every used expert runs once over its contiguous segment; one bincount read is the only host sync
    (segment sizes), instead of unique() plus one nonzero() per expert. Pairs are combined with one index_add_
    in expert order, the same per-token summation order as a per-expert loop.
    """
    t, k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    if ids.numel() == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*k] pair ids grouped by expert
    tok = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    xs = x.index_select(0, tok)
    ys = torch.empty(xs.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            w1, w3, w2 = experts[e]
            ys[start : start + n] = swiglu_expert(xs[start : start + n], w1, w3, w2, limit).float()
            start += n
    out.index_add_(0, tok, ys * weights.reshape(-1).float().index_select(0, order)[:, None])
    return out


def combine_rows(rows: Tensor, topk: int, shared: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """rows [T * k, d] fp32 (one weighted expert output per (token, slot) pair, token-major) -> [T, d]: the sum
    of each token's k rows, plus shared [T, d] (any float dtype, upcast) when given, in out_dtype (None: fp32)."""
    t = rows.shape[0] // topk if topk else 0
    y = torch.sum(rows.view(t, topk, rows.shape[1]), dim=1)
    return add_shared(y, shared, out_dtype)


def wait_shared(shared_ready: torch.cuda.Event | None) -> None:
    """Make the current stream wait for `shared_ready` (the shared expert may run on another stream: docs of
    `moe_experts`); nothing when None."""
    if shared_ready is not None:
        torch.cuda.current_stream().wait_event(shared_ready)


def add_shared(y: Tensor, shared: Tensor | None, out_dtype: torch.dtype | None) -> Tensor:
    """y [T, d] fp32 routed sum + shared [T, d] (type promotion upcasts inside the add: no fp32 copy of shared),
    cast to out_dtype (None: fp32)."""
    if shared is not None:
        y = y + shared
    return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)
