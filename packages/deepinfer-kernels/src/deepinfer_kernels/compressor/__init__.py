"""KV compressor pooling (docs/model.md §A.6/§A.7/§C.3). Reference backend only for now."""

from __future__ import annotations

from torch import Tensor

from deepinfer_kernels.compressor import reference

__all__ = ["compress_pool"]


def compress_pool(a: Tensor, z: Tensor, *, backend: str = "auto") -> Tensor:
    """a, z [W, k, C] fp32 -> [W, C] fp32 (per-channel softmax of z over k, weighted sum of a)."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend: found {backend!r}, expected 'auto' or 'torch'")
    if a.shape != z.shape or a.dim() != 3:
        raise ValueError(f"compress_pool: a and z must both be [W, k, C]; found {tuple(a.shape)}, {tuple(z.shape)}")
    return reference.compress_pool(a, z)
