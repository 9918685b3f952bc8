"""Triton `paged_rows`: one launch, a program per (sequence, block of entry slots); the first block of each
sequence also writes its K new-entry rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["paged_rows"]


@triton.jit(do_not_specialize=["width", "scratch_row"])
def _paged_rows_kernel(bt_ptr, ctx_ptr, lens_ptr, read_ptr, write_ptr, new_w_ptr, pages, width, per_page, ratio, K,
                       scratch_row, BLOCK: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    blk = tl.program_id(1)
    ctx = tl.load(ctx_ptr + i)
    n = tl.load(lens_ptr + i)
    count = tl.where(n > 0, (ctx + n) // ratio, 0)  # ctx, n >= 0: truncation is the floor
    w = blk * BLOCK + tl.arange(0, BLOCK)
    inside = w < width
    page = tl.load(bt_ptr + i * pages + w // per_page, mask=inside, other=-1)
    row = tl.where((page >= 0) & (w < count), page * per_page + w % per_page, scratch_row)
    tl.store(read_ptr + i * width + w, row, mask=inside)
    if blk == 0:
        k = tl.arange(0, KB)
        mine = k < K
        new_w = ctx // ratio + k
        at = tl.minimum(new_w, width - 1)  # an entry below the count lies within the width
        wpage = tl.load(bt_ptr + i * pages + at // per_page, mask=mine, other=-1)
        done = (new_w < count) & (wpage >= 0)
        tl.store(write_ptr + i * K + k, tl.where(done, wpage * per_page + at % per_page, scratch_row), mask=mine)
        tl.store(new_w_ptr + i * K + k, new_w, mask=mine)


def paged_rows(block_tables: Tensor, ctx: Tensor, lens: Tensor, *, ratio: int, page_size: int, width: int,
               tokens: int, scratch_row: int) -> tuple[Tensor, Tensor, Tensor]:
    """block_tables [S, P] int64 contiguous, ctx / lens [S] int64 -> (read_rows [S * width], write_rows [S * K],
    new_w [S * K]) int64. Validated by the dispatcher."""
    S = ctx.shape[0]
    K = -(-int(tokens) // int(ratio))
    dev = ctx.device
    read = torch.empty(S * width, dtype=torch.int64, device=dev)
    write = torch.empty(S * K, dtype=torch.int64, device=dev)
    new_w = torch.empty(S * K, dtype=torch.int64, device=dev)
    if S == 0:
        return read, write, new_w
    check_launchable("paged_rows", _paged_rows_kernel, block_tables, ctx, lens)
    block = min(1024, max(16, next_pow2(width)))
    _paged_rows_kernel[(S, triton.cdiv(max(width, 1), block))](
        block_tables, ctx, lens, read, write, new_w, block_tables.shape[1], width, int(page_size) // int(ratio),
        int(ratio), K, int(scratch_row), BLOCK=block, KB=max(2, next_pow2(K)), num_warps=4,
    )  # fmt: skip
    return read, write, new_w
