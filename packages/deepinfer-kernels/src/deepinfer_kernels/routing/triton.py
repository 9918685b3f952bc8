"""Triton backend of MoE routing after the gate GEMM: (sqrtsoftplus) + bias + top-k + renormalise x scale, fused.

One program per token keeps the E (384) scores in registers and runs k (6) argmax rounds: selection by
score + bias, weights from the unbiased score, ids in descending selection order like torch.topk. Exact ties
go to the LOWER expert id (tl.argmax's left tie-break); torch.topk leaves tie order unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["route_topk"]


@triton.jit
def _route_topk_kernel(
    x_ptr,
    bias_ptr,
    alt_bias_ptr,
    alt_rows_ptr,
    w_ptr,
    id_ptr,
    E,
    stride_x,
    stride_b,
    route_scale,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SQRTSOFTPLUS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALT: tl.constexpr,
    RENORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    x = tl.load(x_ptr + t * stride_x + offs_e, mask=e_mask, other=0.0).to(tl.float32)
    if SQRTSOFTPLUS:
        # softplus = max(x, 0) + log1p(exp(-|x|)); torch switches to x above 20 (same value in fp32).
        # log1p(u) = log(1+u) * u / ((1+u) - 1) is accurate for tiny u without a libdevice log1p.
        u = tl.exp(-tl.abs(x))
        w1 = 1.0 + u
        lp = tl.where(w1 == 1.0, u, tl.log(w1) * u / tl.where(w1 == 1.0, 1.0, w1 - 1.0))
        sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + lp)
        score = tl.sqrt(sp)
    else:
        score = x
    sel = score
    if HAS_BIAS:
        b = tl.load(bias_ptr + t * stride_b + offs_e, mask=e_mask, other=0.0).to(tl.float32)
        if HAS_ALT:  # rows flagged in alt_rows select with the alternative bias (V4.1 bias_vl at image positions)
            alt = tl.load(alt_bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
            b = tl.where(tl.load(alt_rows_ptr + t) != 0, alt, b)
        sel = sel + b
    sel = tl.where(e_mask, sel, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    ws = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        j = tl.argmax(sel, 0)
        hit = offs_e == j
        wj = tl.sum(tl.where(hit, score, 0.0), 0)
        ws = tl.where(offs_k == i, wj, ws)
        ids = tl.where(offs_k == i, j.to(tl.int64), ids)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        ws = ws / tl.sum(tl.where(offs_k < K, ws, 0.0), 0)
    ws = ws * route_scale
    tl.store(w_ptr + t * K + offs_k, ws, mask=offs_k < K)
    tl.store(id_ptr + t * K + offs_k, ids, mask=offs_k < K)


def route_topk(
    x: Tensor,
    bias: Tensor | None,
    topk: int,
    *,
    sqrtsoftplus: bool = True,
    route_scale: float = 1.0,
    renormalize: bool = True,
    bias_alt: Tensor | None = None,
    alt_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """x [T, E] fp32 gate logits (sqrtsoftplus=True) or scores; bias [E] or [T, E] (selection only) ->
    (weights [T, topk] fp32, ids [T, topk] int64). bias_alt [E] with alt_rows [T] bool: the rows flagged select
    with bias_alt instead of bias (bias [E] then). Validated by the package dispatcher."""
    t, e = x.shape
    w = torch.empty((t, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, topk), dtype=torch.int64, device=x.device)
    if t == 0:
        return w, ids
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.float()
        if bias.stride(-1) != 1:
            bias = bias.contiguous()
    stride_b = 0 if bias is None or bias.dim() == 1 else bias.stride(0)
    has_alt = bias is not None and bias_alt is not None and alt_rows is not None
    if has_alt:
        bias_alt = bias_alt.float().contiguous()
        alt_rows = alt_rows.contiguous().view(torch.uint8) if alt_rows.dtype == torch.bool else alt_rows.contiguous()
    extra = (bias, bias_alt, alt_rows) if has_alt else (() if bias is None else (bias,))
    check_launchable("route_topk", _route_topk_kernel, x, *extra)
    block_e = next_pow2(e)
    _route_topk_kernel[(t,)](
        x,
        bias if bias is not None else x,
        bias_alt if has_alt else x,
        alt_rows if has_alt else x,
        w,
        ids,
        e,
        x.stride(0),
        stride_b,
        float(route_scale),
        K=topk,
        BLOCK_E=block_e,
        BLOCK_K=max(2, next_pow2(topk)),
        SQRTSOFTPLUS=sqrtsoftplus,
        HAS_BIAS=bias is not None,
        HAS_ALT=has_alt,
        RENORM=renormalize,
        num_warps=4 if block_e >= 1024 else 2 if block_e >= 256 else 1,
    )
    return w, ids
