"""Triton backend of `embed_streams`: one program per (token, column block) reads the embedding row once and
writes it to every stream (an id past the table writes zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["embed_streams"]


@triton.jit
def _embed_streams_kernel(ids_ptr, w_ptr, out_ptr, V, D, stride_w, N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(ids_ptr + t + offs * 0).to(tl.int64)  # [BLOCK] copies of the id: a mask of the tile's shape
    inside = tok < V
    row = tl.where(inside, tok, 0)
    x = tl.load(w_ptr + row * stride_w + offs, mask=(offs < D) & inside, other=0.0)
    for i in tl.static_range(N):
        tl.store(out_ptr + (t * N + i) * D + offs, x, mask=offs < D)


def embed_streams(ids: Tensor, weight: Tensor, streams: int) -> Tensor:
    """ids [T] int, weight [V, d] (unit column stride) -> [T, streams, d]. Validated by the package dispatcher."""
    v, d = weight.shape
    t = ids.shape[0]
    out = torch.empty((t, streams, d), dtype=weight.dtype, device=weight.device)
    if t == 0 or d == 0:
        return out
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    i = ids.contiguous()
    check_launchable("embed_streams", _embed_streams_kernel, i, w)
    block = min(1024, next_pow2(d))
    _embed_streams_kernel[(t, -(-d // block))](i, w, out, v, d, w.stride(0), N=streams, BLOCK=block, num_warps=4)
    return out
