"""Torch reference of `paged_rows`: elementwise ops over the step's buffers; the shape-only tensors come from
`paged_rows_constants` (made once by the caller, outside any captured graph)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PagedRowsConstants", "paged_rows", "paged_rows_constants"]


@dataclass(frozen=True)
class PagedRowsConstants:
    """The shape-only tensors of `paged_rows` for S sequences, `width` entry slots each, K new entries each.

    page_of: [width] int64 page column of entry slot w (w // per_page); in_page: [width] int64 its row in that
    page (w % per_page); slots: [width] int64 w; new_seq: [S * K] int64 sequence of new-entry row k (k // K);
    new_k: [S * K] int64 k % K; new_base: [S * K] int64 new_seq * width; offsets_t: [S] int64 i * width.
    """

    page_of: Tensor
    in_page: Tensor
    slots: Tensor
    new_seq: Tensor
    new_k: Tensor
    new_base: Tensor
    offsets_t: Tensor


def paged_rows_constants(ratio: int, page_size: int, num_seqs: int, width: int, tokens: int,
                         device: torch.device | str) -> PagedRowsConstants:
    """`PagedRowsConstants` of S = num_seqs sequences of `tokens` rows, `width` entry slots each, at `ratio`."""
    per_page, K = int(page_size) // int(ratio), -(-int(tokens) // int(ratio))
    w = torch.arange(int(width), device=device)
    k = torch.arange(int(num_seqs) * K, device=device)
    new_seq = k // K
    return PagedRowsConstants(page_of=w // per_page, in_page=w % per_page, slots=w, new_seq=new_seq, new_k=k % K,
                              new_base=new_seq * int(width),
                              offsets_t=torch.arange(int(num_seqs), device=device) * int(width))


def paged_rows(block_tables: Tensor, ctx: Tensor, lens: Tensor, *, ratio: int, page_size: int, width: int,
               tokens: int, scratch_row: int, consts: PagedRowsConstants) -> tuple[Tensor, Tensor, Tensor]:
    """See `deepinfer_kernels.paged_rows.paged_rows`."""
    r, per_page = int(ratio), int(page_size) // int(ratio)
    K = -(-int(tokens) // r)
    c = consts
    pages = block_tables.index_select(1, c.page_of)  # [S, width] the page of every entry slot
    grid = torch.add(c.in_page, pages, alpha=per_page)
    grid = torch.where(pages >= 0, grid, scratch_row)  # an entry's row is negative exactly where its page is -1
    # a padding sequence completes nothing (count 0), so no new entry of it is below its count either
    counts = torch.where(lens > 0, (ctx + lens) // r, 0)
    read_rows = torch.where(c.slots < counts[:, None], grid, scratch_row).reshape(-1)
    first = ctx // r
    if K == 1:  # new-entry row k is sequence k's
        new_w, done = first, first < counts
    else:
        new_w = first[c.new_seq] + c.new_k
        done = new_w < counts[c.new_seq]
    at = c.new_base + new_w.clamp(max=width - 1)  # an entry below count_i lies within the width
    write_rows = torch.where(done, grid.reshape(-1)[at], scratch_row)
    return read_rows, write_rows, new_w
