"""Pure-torch reference of compressor pooling (docs/model.md §A.6/§A.7/§C.3): per-channel softmax over tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def compress_pool(a: Tensor, z: Tensor) -> Tensor:
    """a, z [W, k, C] fp32 (z = gate logits incl. ape, -inf = absent candidate) -> [W, C] fp32.

    For every window and channel independently: softmax of z over the k candidates, weighted sum of a.
    """
    w = torch.softmax(z.float(), dim=1)
    return (w * a.float()).sum(dim=1)


def pool_at_rows(pool: Tensor, rows: Tensor, out_dtype: torch.dtype) -> Tensor:
    """pool [P, 2, C] fp32, rows [M, k] int64 -> [M, C] out_dtype (see compressor.pool_at_rows)."""
    g = pool[rows]  # [M, k, 2, C]
    return compress_pool(g[:, :, 0], g[:, :, 1]).to(out_dtype)
