"""Sparse MQA attention over indexed kv rows with attn_sink (architecture.md §A.4): torch reference + Triton."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.sparse_attn import reference

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["sparse_attn"]


def sparse_attn(
    q: Tensor, kv: Tensor, indices: Tensor, attn_sink: Tensor, softmax_scale: float, *, backend: str = "auto"
) -> Tensor:
    """q [T, H, D]; kv [S, D] (one shared K=V head); indices [T, K] int64 rows of kv, -1 = unused;
    attn_sink [H] fp32; returns [T, H, D] in q's dtype. Rows whose indices are all -1 give zeros.
    backend: "auto" | "torch" | "triton" (deepinfer_kernels._backend.resolve_backend). The triton kernel needs q
    and kv of one dtype in {bf16, fp16, fp32} and D <= 1024; it treats indices >= S like -1 instead of raising
    (the range check below would cost a device sync per call)."""
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
    ok = q.dtype in _TRITON_DTYPES and kv.dtype == q.dtype and q.shape[2] <= 1024
    why = f"q {q.dtype}, kv {kv.dtype}, D {q.shape[2]}; needs one dtype in bf16/fp16/fp32 and D <= 1024"
    if resolve_backend("sparse_attn", backend, q, kv, indices, attn_sink, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.sparse_attn import triton as triton_backend

        return triton_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale)
    if indices.numel() and int(indices.max()) >= kv.shape[0]:
        raise ValueError(f"sparse_attn: index {int(indices.max())} out of range for {kv.shape[0]} kv rows")
    return reference.sparse_attn(q, kv, indices, attn_sink, softmax_scale)
