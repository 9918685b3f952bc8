"""The "chunked" memory layout of FP4 expert weights: the checkpoint's bytes reordered once at load so that the GPU
kernels read them with fully coalesced 16-byte loads (docs/moe_fp4_kernel.md, "The chunked layout").

A packed weight ``[..., N, K/2] int8`` (e2m1 codes, two per byte) is a row of ``K/8`` 32-bit words; 16 words make a
128-column chunk (4 scale groups g of 4 words c). The chunked layout stores word ``4g + c`` of every chunk at position
``4c + g`` (a 4 x 4 word transpose), so the lane that decodes word c of all four groups reads one contiguous 16-byte
vector. The UE8M0 scales ``[..., N, K/32]`` are one 32-bit word per row and chunk (4 groups); the chunked layout
stores a matrix's ``[N, K/128]`` scale words chunk-major (``[K/128, N]``), so the scale words of consecutive rows
are contiguous. Shapes and dtypes stay those of the checkpoint (only the byte order inside each matrix changes), so
whole-slot copies stay layout-agnostic; `StackedExperts` records the layout in its ``fmt`` ("fp4_chunked").

All functions are pure torch and work on any device; ``[...]`` is any number of leading (expert) dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "chunk_codes",
    "chunk_codes_",
    "chunk_scales",
    "chunk_scales_",
    "unchunk_codes",
    "unchunk_scales",
]

CHUNK = 128  # columns per chunk: 4 scale groups of 32, one 32-bit scale word


def _words(t: Tensor, cols_per_byte: int, what: str) -> tuple[Tensor, int, int]:
    """t [..., N, K/cols_per_byte] of one-byte elements -> (int32 words [..., N, K/(4 cols_per_byte)], N, K)."""
    if t.dim() < 2 or t.element_size() != 1:
        raise ValueError(
            f"fp4 layout: {what} {tuple(t.shape)} {t.dtype}; expected [..., N, K/{cols_per_byte}] of one byte each"
        )
    n, k = t.shape[-2], t.shape[-1] * cols_per_byte
    if k % CHUNK:
        raise ValueError(
            f"fp4 layout: {what} of K = {k} columns; expected a multiple of {CHUNK} (the chunked layout needs whole "
            "128-column chunks; keep the checkpoint layout)"
        )
    if not t.is_contiguous():
        raise ValueError(f"fp4 layout: {what} must be contiguous (call .contiguous() first)")
    return t.view(torch.uint8).view(torch.int32), n, k


def _like(words: Tensor, t: Tensor) -> Tensor:
    return words.contiguous().view(-1).view(torch.uint8).view(t.dtype).view(t.shape)


def chunk_codes(w: Tensor) -> Tensor:
    """Packed e2m1 codes [..., N, K/2] (checkpoint layout, K % 128 == 0) -> the chunked layout (a new tensor of the
    same shape and dtype): word 4g + c of every 128-column chunk moves to 4c + g."""
    v, n, k = _words(w, 2, "codes")
    return _like(v.view(*w.shape[:-2], n, k // CHUNK, 4, 4).transpose(-1, -2), w)


def unchunk_codes(w: Tensor) -> Tensor:
    """Chunked codes -> checkpoint layout (a new tensor): the inverse of `chunk_codes` (the 4 x 4 transpose is its
    own inverse)."""
    return chunk_codes(w)


def chunk_scales(s: Tensor) -> Tensor:
    """UE8M0 scales [..., N, K/32] (checkpoint layout) -> the chunked layout (a new tensor of the same shape and
    dtype): each matrix's scale words [N, K/128] stored chunk-major, [K/128, N]."""
    v, n, k = _words(s, 32, "scales")
    return _like(v.view(*s.shape[:-2], n, k // CHUNK).transpose(-1, -2), s)


def unchunk_scales(s: Tensor) -> Tensor:
    """Chunked scales -> checkpoint layout (a new tensor): the inverse of `chunk_scales`."""
    v, n, k = _words(s, 32, "scales")
    return _like(v.view(*s.shape[:-2], k // CHUNK, n).transpose(-1, -2), s)


def _in_place(t: Tensor, fn: object) -> None:
    # one leading index at a time: the temporary is one matrix, so a stacked [E, ...] tensor does not double
    if t.dim() > 2:
        for i in range(t.shape[0]):
            _in_place(t[i], fn)
        return
    t.copy_(fn(t))


def chunk_codes_(w: Tensor) -> Tensor:
    """`chunk_codes` in place (one matrix of temporary memory); returns w."""
    _words(w, 2, "codes")
    _in_place(w, chunk_codes)
    return w


def chunk_scales_(s: Tensor) -> Tensor:
    """`chunk_scales` in place (one matrix of temporary memory); returns s."""
    _words(s, 32, "scales")
    _in_place(s, chunk_scales)
    return s
