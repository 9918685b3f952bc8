"""Triton `pool_at_rows`: one program per (entry, channel block) gathers the entry's k (A, Z) rows, takes the
per-channel softmax of Z over the k tokens, sums A with those weights in fp32 and stores in the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2

__all__ = ["pool_at_rows"]

_BLOCK_C = 256


@triton.jit
def _pool_at_rows_kernel(pool_ptr, rows_ptr, out_ptr, C, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_C: tl.constexpr):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    r = tl.load(rows_ptr + m * K + ks, mask=k_ok, other=0)
    ok = k_ok[:, None] & (cols[None, :] < C)
    base = pool_ptr + r[:, None] * (2 * C) + cols[None, :]  # row r: A at [0, C), Z at [C, 2C)
    a = tl.load(base, mask=ok, other=0.0)
    # padding token lanes weigh nothing; columns past C read 0 (finite: no inf - inf on masked lanes)
    z = tl.where(k_ok[:, None], tl.load(base + C, mask=ok, other=0.0), float("-inf"))
    zmax = tl.max(z, 0)
    e = tl.exp(z - zmax[None, :])
    y = tl.sum(e / tl.sum(e, 0)[None, :] * a, 0)  # the reference's order: softmax weights first, then the sum
    tl.store(out_ptr + m * C + cols, y.to(out_ptr.dtype.element_ty), mask=cols < C)


def pool_at_rows(pool: Tensor, rows: Tensor, out_dtype: torch.dtype) -> Tensor:
    """pool [P, 2, C] fp32, rows [M, k] int64 (in [0, P)) -> [M, C] out_dtype. Validated by the dispatcher."""
    m, k = rows.shape
    c = pool.shape[2]
    out = torch.empty((m, c), dtype=out_dtype, device=pool.device)
    if m == 0:
        return out
    pool, rows = pool.contiguous(), rows.contiguous()
    check_launchable("pool_at_rows", _pool_at_rows_kernel, pool, rows)
    _pool_at_rows_kernel[(m, cdiv(c, _BLOCK_C))](
        pool, rows, out, c, K=k, BLOCK_K=max(2, next_pow2(k)), BLOCK_C=_BLOCK_C, num_warps=2,
    )  # fmt: skip
    return out
