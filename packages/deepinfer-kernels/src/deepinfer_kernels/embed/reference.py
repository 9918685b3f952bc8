"""Pure-torch reference of `embed_streams`."""

from __future__ import annotations

from torch import Tensor


def embed_streams(ids: Tensor, weight: Tensor, streams: int) -> Tensor:
    """ids [T] int, weight [V, d] -> [T, streams, d]: weight[ids[t]] in every stream, 0 for ids >= V."""
    v = weight.shape[0]
    e = weight[ids.clamp(max=v - 1)].masked_fill((ids >= v)[:, None], 0)
    return e[:, None, :].expand(-1, streams, -1).contiguous()
