"""Triton `ring_pool`: one launch, one program per row copied (history rows, fresh rows, ring writes).

The programs run concurrently, so a ring row written must not be a row read (the dispatcher's `disjoint`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["ring_pool"]


@triton.jit(do_not_specialize=["H", "T", "skip"])
def _ring_pool_kernel(flat_ptr, hist_ptr, fresh_ptr, dst_ptr, src_ptr, pool_ptr, H, T, W, skip,
                      BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) + skip
    offs = tl.arange(0, BLOCK)
    for c0 in tl.range(0, W, BLOCK):
        cols = c0 + offs
        m = cols < W
        # one name per branch: triton merges the names bound in both arms of an if, and the ring's dtype may differ
        # from the step's (a bf16 ring fed fp32 rows)
        if i < H:  # a history row: ring -> pool
            row = tl.load(hist_ptr + i)
            hv = tl.load(flat_ptr + row * W + cols, mask=m)
            tl.store(pool_ptr + i.to(tl.int64) * W + cols, hv.to(pool_ptr.dtype.element_ty), mask=m)
        elif i < H + T:  # a fresh row: the step's values -> pool
            fv = tl.load(fresh_ptr + (i - H).to(tl.int64) * W + cols, mask=m)
            tl.store(pool_ptr + i.to(tl.int64) * W + cols, fv, mask=m)
        else:  # a ring write: fresh row write_src[j] -> ring row write_dst[j]
            j = i - H - T
            src = tl.load(src_ptr + j)
            dst = tl.load(dst_ptr + j)
            wv = tl.load(fresh_ptr + src * W + cols, mask=m)
            tl.store(flat_ptr + dst * W + cols, wv.to(flat_ptr.dtype.element_ty), mask=m)


def ring_pool(
    flat: Tensor, hist_src: Tensor, fresh: Tensor, write_dst: Tensor | None = None, write_src: Tensor | None = None
) -> Tensor:
    """flat [N, *C] contiguous, hist_src [H] int64, fresh [T, *C], write_dst / write_src [m] int64 (rows written
    not among the rows read) -> pool [H + T, *C] fresh.dtype. Validated by the dispatcher."""
    h, t = hist_src.shape[0], fresh.shape[0]
    m = 0 if write_dst is None else write_dst.shape[0]
    # without history rows the pool is fresh itself: the launch only writes the ring (programs skip the pool rows)
    pool = fresh if not h else torch.empty((h + t, *fresh.shape[1:]), dtype=fresh.dtype, device=fresh.device)
    if h == 0 and m == 0:
        return pool
    fresh = fresh.contiguous()
    width = fresh[0].numel() if t else flat[0].numel()
    dst = hist_src if write_dst is None else write_dst
    src = hist_src if write_src is None else write_src
    check_launchable("ring_pool", _ring_pool_kernel, flat, hist_src, fresh, dst, src)
    skip = 0 if h else t
    _ring_pool_kernel[(h + t + m - skip,)](
        flat, hist_src, fresh, dst, src, pool, h, t, width, skip, BLOCK=min(1024, next_pow2(width)), num_warps=4,
    )  # fmt: skip
    return pool
