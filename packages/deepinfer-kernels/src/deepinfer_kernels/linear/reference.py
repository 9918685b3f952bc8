"""Pure-torch references of the linear layers over weights kept in their checkpoint formats.

- `fp8_linear`: ``y = x Wᵀ`` with ``W = dequant_fp8_block(weight, scale, block)`` decoded per call (exact: an e4m3
  value times a power of two is representable in bf16 and fp32), computed in x's dtype, so a float32 model gets
  the same numbers as with weights dequantized at load. ``act_quant=True`` first rounds x to FP8 e4m3 with one
  power-of-two scale per 1 x block[1] channels (`fake_quant_act_fp8`), the deployed numerics.
- `linear_f32_out`: ``y = x Wᵀ`` as float32 (the LM head); the reference upcasts both operands.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from deepinfer_kernels.quant.reference import dequant_fp8_block, fake_quant_act_fp8

__all__ = ["fp8_linear", "linear_f32_out"]


def fp8_linear(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], act_quant: bool = False
) -> Tensor:
    """x ``[M, K]`` float; weight ``[N, K] float8_e4m3fn``; scale ``[ceil(N/b0), ceil(K/b1)]`` e8m0 | f32 ->
    ``[M, N]`` in x's dtype."""
    w = dequant_fp8_block(weight, scale, block).to(x.dtype)
    if act_quant:
        x = fake_quant_act_fp8(x, block[1]).to(x.dtype)
    return F.linear(x, w)


def linear_f32_out(x: Tensor, weight: Tensor) -> Tensor:
    """x ``[M, K]``, weight ``[N, K]`` (same float dtype) -> ``[M, N] float32``."""
    return F.linear(x.float(), weight.float())
