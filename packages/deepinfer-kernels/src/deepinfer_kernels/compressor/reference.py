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
