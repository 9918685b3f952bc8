"""Sparse MQA attention over indexed kv rows with attn_sink (architecture.md §A.4). Reference backend only."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels.sparse_attn import reference

__all__ = ["sparse_attn"]


def sparse_attn(
    q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, softmax_scale: float, *, backend: str = "auto"
) -> Tensor:
    """q [T, H, D]; kv [S, D] (one shared K=V head); indices [T, K] int64 rows of kv, -1 = unused;
    attn_sink [H] fp32; returns [T, H, D] in q's dtype. Rows whose indices are all -1 give zeros."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend: found {backend!r}, expected 'auto' or 'torch'")
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(
            f"sparse_attn: expected q [T,H,D], kv [S,D], indices [T,K]; found {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    if q.shape[2] != kv.shape[1] or indices.shape[0] != q.shape[0] or attn_sink.shape != (q.shape[1],):
        raise ValueError(
            f"sparse_attn: shape mismatch q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}, "
            f"attn_sink {tuple(attn_sink.shape)}"
        )
    if indices.dtype != torch.int64:
        raise ValueError(f"sparse_attn: indices dtype {indices.dtype}, expected int64")
    if indices.numel() and int(indices.max()) >= kv.shape[0]:
        raise ValueError(f"sparse_attn: index {int(indices.max())} out of range for {kv.shape[0]} kv rows")
    return reference.sparse_attn(q, kv, indices, attn_sink, softmax_scale)
