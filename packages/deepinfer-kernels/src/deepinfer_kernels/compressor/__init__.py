"""KV compressor pooling (docs/model.md §A.6/§A.7/§C.3): torch references; a Triton kernel for `pool_at_rows`
(the gather of each entry's token rows, the softmax pooling and the cast in one launch)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.compressor import reference

__all__ = ["compress_pool", "pool_at_rows"]


def compress_pool(a: Tensor, z: Tensor, *, backend: str = "auto") -> Tensor:
    """a, z [W, k, C] fp32 -> [W, C] fp32 (per-channel softmax of z over k, weighted sum of a)."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend: found {backend!r}, expected 'auto' or 'torch'")
    if a.shape != z.shape or a.dim() != 3:
        raise ValueError(f"compress_pool: a and z must both be [W, k, C]; found {tuple(a.shape)}, {tuple(z.shape)}")
    return reference.compress_pool(a, z)


def pool_at_rows(pool: Tensor, rows: Tensor, out_dtype: torch.dtype, *, backend: str = "auto") -> Tensor:
    """pool [P, 2, C] fp32 (the (A, Z) rows of a step's positions), rows [M, k] int64 rows of pool (the k tokens
    of each entry) -> [M, C] out_dtype: `compress_pool(pool[rows, 0], pool[rows, 1])` cast to out_dtype.
    backend: "auto" | "torch" | "triton" (k <= 16, C <= 16,384)."""
    if pool.dim() != 3 or pool.shape[1] != 2 or rows.dim() != 2:
        raise ValueError(f"pool_at_rows: expected pool [P, 2, C] and rows [M, k]; found {tuple(pool.shape)}, "
                         f"{tuple(rows.shape)}")  # fmt: skip
    ok = pool.dtype == torch.float32 and 1 <= rows.shape[1] <= 16 and 0 < pool.shape[2] <= 16384
    why = f"pool {pool.dtype} {tuple(pool.shape)}, rows {tuple(rows.shape)}; needs fp32, k <= 16, C <= 16384"
    if resolve_backend("pool_at_rows", backend, pool, rows, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.compressor import triton as triton_backend

        return triton_backend.pool_at_rows(pool, rows, out_dtype)
    return reference.pool_at_rows(pool, rows, out_dtype)
