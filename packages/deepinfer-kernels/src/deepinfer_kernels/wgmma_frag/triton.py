"""Triton helpers that assemble decoded weights into the K order of the wgmma A fragment (docs/moe_fp4_kernel.md,
docs/linear_fp8_frag.md). In one K = 16 step of that fragment, lane q of a quad holds dot positions 2q, 2q + 1 and
2q + 8, 2q + 9 of its rows; the kernels decode four [rows, 4] tensors (index q) per step and join them here, which
Triton keeps in the fragment's register layout (no data movement)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["any_nan", "cat_k", "dot_order"]


@triton.jit
def dot_order(a, b, c, d, BLOCK_N: tl.constexpr):
    """Four [BLOCK_N, 4] tensors (index q) holding dot positions 2q + j + 8h for (h, j) = (0, 0), (0, 1), (1, 0),
    (1, 1) -> [BLOCK_N, 16] in dot order."""
    t = tl.join(tl.join(a, b), tl.join(c, d))  # [BLOCK_N, 4 (q), 2 (j), 2 (h)]
    return tl.reshape(tl.permute(t, (0, 3, 1, 2)), [BLOCK_N, 16])


@triton.jit
def cat_k(a, b, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """[BLOCK_N, W] ++ [BLOCK_N, W] along K -> [BLOCK_N, 2W]."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [BLOCK_N, 2 * W])


@triton.jit
def any_nan(t):
    """Whether a 2-D tile holds a NaN (the fast decodes' signal that a tile needs the exact redo)."""
    return tl.max(tl.max((t != t).to(tl.int32), axis=1), axis=0) > 0
