"""Clamped SwiGLU activation (docs/model.md §2) of a dense expert: torch reference; Triton elementwise kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.activation import reference

__all__ = ["swiglu"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu(g: Tensor, u: Tensor, limit: float, out_dtype: torch.dtype, *, backend: str = "auto") -> Tensor:
    """``silu(min(g, L)) * clamp(u, -L, L)`` with fp32 math: g, u [..., I] (gate and up projections) ->
    [..., I] out_dtype. limit <= 0: no clamp. backend: "auto" | "torch" | "triton" (bf16/fp16/fp32 in and out)."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu: g {tuple(g.shape)} and u {tuple(u.shape)} must have one shape")
    ok = g.dtype in _DTYPES and u.dtype in _DTYPES and out_dtype in _DTYPES
    why = f"g {g.dtype}, u {u.dtype}, out {out_dtype}; needs bf16/fp16/fp32"
    if resolve_backend("swiglu", backend, g, u, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.activation import triton as triton_backend

        return triton_backend.swiglu(g, u, limit, out_dtype)
    return reference.swiglu(g, u, limit, out_dtype)
