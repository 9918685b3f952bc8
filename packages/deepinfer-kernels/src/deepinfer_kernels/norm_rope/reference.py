"""Pure-torch references: RMSNorm and interleaved (GPT-J) RoPE on the trailing rope dims, YaRN frequencies.

Written as docs/model.md §2: norms in fp32, RoPE pairs (2i, 2i+1) of the LAST `rope_dim` channels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight], computed in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def yarn_correction_range(
    rope_dim: int, theta: float, original_max_pos: int, beta_fast: float, beta_slow: float
) -> tuple[int, int]:
    """(low, high) pair indices of the YaRN ramp: corr(r) = dim*ln(L0/(2*pi*r)) / (2*ln(theta))."""

    def corr(r: float) -> float:
        return rope_dim * math.log(original_max_pos / (r * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    return low, high


def rope_freqs(
    rope_dim: int,
    theta: float,
    *,
    yarn_factor: float | None = None,
    original_max_pos: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> Tensor:
    """Per-pair inverse frequencies [rope_dim // 2] fp32; YaRN-interpolated when yarn_factor is given.

    Every step is an fp32 tensor operation in the order of DeepSeek's inference code (docs/fidelity.md):
    ``b = theta ** (i / dim)``, ``extra = 1 / b``, ``inter = 1 / (factor * b)``, ``mask = 1 - ramp`` and
    ``inter * (1 - mask) + extra * mask``; the float rounding of each step is part of the result.
    """
    i = torch.arange(0, rope_dim, 2, dtype=torch.float32)
    base = theta ** (i / rope_dim)
    extrapolated = 1.0 / base
    if yarn_factor is None:
        return extrapolated
    interpolated = 1.0 / (yarn_factor * base)
    low, high = yarn_correction_range(rope_dim, theta, original_max_pos, beta_fast, beta_slow)
    # a zero-width ramp would divide by zero: widen it by 0.001 (the reference's guard)
    high_f = high + 0.001 if low == high else high
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high_f - low)).clamp(0.0, 1.0)
    keep = 1.0 - ramp  # weight of the extrapolated (unscaled) frequency
    return interpolated * (1.0 - keep) + extrapolated * keep


def rope_cos_sin(positions: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, rope_dim // 2] fp32 of the fp32 angle table ``outer(positions_fp32, freqs_fp32)``.

    The angle is rounded to fp32 before cos/sin (as the reference's cos/sin cache); positions up to 2^24 are
    exact in fp32. cos/sin come from ``torch.polar`` like the reference's cache.
    """
    ang = torch.outer(positions.to(torch.float32), freqs.to(torch.float32))
    z = torch.polar(torch.ones_like(ang), ang)
    return z.real.contiguous(), z.imag.contiguous()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False) -> Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x [T, ..., D] in interleaved pairs; returns x's dtype.

    cos/sin: [T, P] (P pairs) broadcast over the middle dims. inverse=True rotates by -angle.
    """
    p = cos.shape[-1]
    d = x.shape[-1]
    rot = x[..., d - 2 * p :].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (p,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    ra = a * c - b * s
    rb = a * s + b * c
    out_rot = torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([x[..., : d - 2 * p], out_rot.to(x.dtype)], dim=-1)
