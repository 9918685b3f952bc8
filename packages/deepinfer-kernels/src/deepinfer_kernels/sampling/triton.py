"""Triton greedy argmax over a large vocabulary in two stages: per (row, chunk) the max, the lowest index reaching
it and whether the chunk holds a NaN; then one program per row combines its chunks. torch's argmax of one row is
a single-block reduction (one SM for 129,280 entries at batch 1); the chunks spread a row over many programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2

__all__ = ["CHUNK", "greedy_argmax"]

CHUNK = 4096  # entries of a row per first-stage program (32 programs per row of the 129,280-entry vocabulary)
_BIG = tl.constexpr(2**31 - 1)  # an index past every row (V < 2**31); constexpr: a kernel may only read those globals


@triton.jit(do_not_specialize=["V", "C"])
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, V, C, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & ok, offs, _BIG), 0)
    xm = tl.where(is_nan, float("-inf"), x)
    m = tl.max(xm, 0)
    first_max = tl.min(tl.where((xm == m) & ok, offs, _BIG), 0)
    has_nan = first_nan < _BIG
    tl.store(val_ptr + row * C + c, m)
    tl.store(idx_ptr + row * C + c, tl.where(has_nan, first_nan, first_max))
    tl.store(nan_ptr + row * C + c, has_nan.to(tl.int32))


@triton.jit(do_not_specialize=["C"])
def _combine_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, C, invalid, USE_INVALID: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < C
    v = tl.load(val_ptr + row * C + offs, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * C + offs, mask=ok, other=_BIG)
    nan = tl.load(nan_ptr + row * C + offs, mask=ok, other=0) != 0
    # a NaN chunk holds its first NaN's index and chunks are in index order: the smallest one is the first NaN
    first_nan = tl.min(tl.where(nan, i, _BIG), 0)
    m = tl.max(v, 0)
    first_max = tl.min(tl.where(ok & (v == m), i, _BIG), 0)
    out = tl.where(first_nan < _BIG, first_nan, first_max).to(tl.int64)
    if USE_INVALID:
        finite = (first_nan == _BIG) & (m != float("inf")) & (m != float("-inf"))
        out = tl.where(finite, out, invalid)
    tl.store(out_ptr + row, out)


def greedy_argmax(logits: Tensor, *, invalid: int | None = None) -> Tensor:
    """logits [N, V] bf16|fp16|fp32 (last dim contiguous) -> [N] int64, exactly reference.greedy_argmax."""
    n, v = logits.shape
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    check_launchable("greedy_argmax", _chunk_max_kernel, x)
    block = min(CHUNK, next_pow2(v))
    c = cdiv(v, block)
    vals = torch.empty((n, c), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, c), dtype=torch.int32, device=x.device)
    nan = torch.empty((n, c), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(n, c)](x, vals, idx, nan, v, c, x.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    _combine_kernel[(n,)](
        vals, idx, nan, out, c, 0 if invalid is None else int(invalid), USE_INVALID=invalid is not None,
        BLOCK_C=next_pow2(c), num_warps=1,
    )  # fmt: skip
    return out
