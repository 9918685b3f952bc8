"""Pure-torch reference of the clamped SwiGLU activation (docs/model.md §2): the middle of every expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu(g: Tensor, u: Tensor, limit: float, out_dtype: torch.dtype) -> Tensor:
    """``silu(min(g, L)) * clamp(u, -L, L)`` in fp32 (limit <= 0: no clamp), cast to out_dtype. g, u: [..., I]."""
    gf, uf = g.float(), u.float()
    if limit > 0:
        gf = gf.clamp(max=limit)
        uf = uf.clamp(min=-limit, max=limit)
    return (F.silu(gf) * uf).to(out_dtype)
