"""Pure-torch reference of the V4.1 Engram gate and injection (docs/model.md §C.6), fp32 math.

r: [T, n, d] hc streams; keys: [T, n, d] per-stream keys; val: [T, d] the value; q_weight / k_weight: [n, d].
"""

from __future__ import annotations

import torch
from torch import Tensor

# Smallest |g| before the square root: sqrt(1e-6) = 1e-3 is the gate's smallest distance from 0.5.
GATE_CLAMP = 1e-6


def engram_gate(r: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """Per-stream gate [T, n] float32.

    ``g_i = (Σ_c r_i[c] q_i[c] k_i[c] key_i[c]) · rsqrt(mean(r_i²)+ε) · rsqrt(mean(key_i²)+ε) / sqrt(d)``;
    returns ``sigmoid(copysign(sqrt(max(|g|, 1e-6)), g))``. copysign, as DeepSeek's gate kernel
    (docs/fidelity.md §4): g = +0 gives sigmoid(+1e-3) and g = -0 sigmoid(-1e-3), never the 0.5 a ``sign(g)``
    product would give.
    """
    rf, kf = r.float(), key.float()
    d = rf.shape[-1]
    dot = (rf * q_weight.float() * k_weight.float() * kf).sum(-1)
    g = dot * torch.rsqrt(rf.pow(2).mean(-1) + eps) * torch.rsqrt(kf.pow(2).mean(-1) + eps) / d**0.5
    return torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(g.abs(), min=GATE_CLAMP)), g))


def engram_inject(
    r: Tensor, keys: Tensor, val: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
    image_mask: Tensor | None = None,
) -> Tensor:
    """``R_i + gate_i · val`` [T, n, d] in r's dtype; image_mask [T] bool: gate 0 there (streams unchanged)."""
    gate = engram_gate(r, keys, q_weight, k_weight, eps)
    if image_mask is not None:
        gate = gate.masked_fill(image_mask[:, None], 0.0)
    return (r.float() + gate[..., None] * val.float()[:, None, :]).to(r.dtype)
