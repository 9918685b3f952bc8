"""Rows of a fixed-shape step's paged entries (compressed KV, indexer keys): for S sequences, the store row of
each of their `width` entry slots, and of the K = ceil(tokens / ratio) entries the step may complete. A captured
decode graph recomputes them every replay from the step's buffers. Torch reference (16 launches at K = 1, 19
above, with the shape-only tensors made once by the caller); Triton kernel (one launch)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.paged_rows import reference
from deepinfer_kernels.paged_rows.reference import PagedRowsConstants, paged_rows_constants

__all__ = ["PagedRowsConstants", "paged_rows", "paged_rows_constants"]


def paged_rows(block_tables: Tensor, ctx: Tensor, lens: Tensor, *, ratio: int, page_size: int, width: int,
               tokens: int, scratch_row: int, consts: PagedRowsConstants, backend: str = "auto"
               ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """block_tables [S, P] int64 page ids (-1 = none; P pages cover `width` entries of page_size // ratio each),
    ctx [S] int64 first position (>= 0) of each sequence's new tokens, lens [S] int64 its real tokens n_i (0: a
    padding sequence) -> (read_rows [S * width], write_rows [S * K], new_w [S * K]) int64, K = ceil(tokens /
    ratio).

    Entry slot w of sequence i reads its page row (page table[w // per_page], row w % per_page) while w < count_i
    = (ctx_i + n_i) // ratio, else `scratch_row`; new-entry row k of i is entry new_w = ctx_i // ratio + k, written
    to its page row when it is below count_i (completed by real tokens), else to `scratch_row`. A slot whose page
    is -1 reads and writes `scratch_row`. consts: `paged_rows_constants(ratio, page_size, S, width, tokens,
    device)` (the reference reads them; the kernel needs none). backend: "auto" | "torch" | "triton" (also "device"
    / "triton-where-supported", a model's resolved forms)."""
    S = ctx.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != S or lens.shape != ctx.shape or ctx.dim() != 1:
        raise ValueError(f"paged_rows: block_tables {tuple(block_tables.shape)}, ctx {tuple(ctx.shape)} and lens "
                         f"{tuple(lens.shape)} must be [S, P], [S], [S]")  # fmt: skip
    per_page = int(page_size) // int(ratio)
    if block_tables.shape[1] * per_page < width:
        raise ValueError(f"paged_rows: {block_tables.shape[1]} pages of {per_page} entries cover fewer than the "
                         f"{width} entry slots")  # fmt: skip
    ok = all(t.dtype == torch.int64 for t in (block_tables, ctx, lens)) and block_tables.is_contiguous() and ctx.is_contiguous() and lens.is_contiguous()
    why = f"dtypes {block_tables.dtype}, {ctx.dtype}, {lens.dtype} (int64 needed), contiguous inputs"
    if resolve_backend("paged_rows", backend, block_tables, ctx, lens, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.paged_rows import triton as triton_backend

        return triton_backend.paged_rows(block_tables, ctx, lens, ratio=ratio, page_size=page_size, width=width,
                                         tokens=tokens, scratch_row=scratch_row)
    return reference.paged_rows(block_tables, ctx, lens, ratio=ratio, page_size=page_size, width=width,
                                tokens=tokens, scratch_row=scratch_row, consts=consts)
