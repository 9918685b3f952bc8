"""Torch reference of `ring_pool`: the history is read before the ring is written (any overlap allowed)."""

from __future__ import annotations

import torch
from torch import Tensor


def ring_pool(
    flat: Tensor, hist_src: Tensor, fresh: Tensor, write_dst: Tensor | None = None, write_src: Tensor | None = None
) -> Tensor:
    """See `deepinfer_kernels.ring_pool.ring_pool`."""
    if hist_src.numel():
        pool = torch.cat([flat.index_select(0, hist_src).to(fresh.dtype), fresh], 0)
    else:
        pool = fresh
    if write_dst is not None:
        flat.index_copy_(0, write_dst, fresh.index_select(0, write_src).to(flat.dtype))
    return pool
