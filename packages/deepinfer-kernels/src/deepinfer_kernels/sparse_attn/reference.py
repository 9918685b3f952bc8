"""Pure-torch reference of sparse MQA attention with a per-head sink (docs/model.md §A.4), dense-gather style.

Every query attends to the kv rows named by its index list (-1 = none); K = V = the full kv row; the sink logit
enters only the softmax denominator; softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels.quant.kv_formats import KVFormat, decode_records


def _rows(src: Tensor, idx: Tensor, fmt: KVFormat | None) -> Tensor:
    """src[idx] as float32 [T, K, D]; record rows (codes then scale bytes) are decoded after the gather."""
    g = src[idx]
    return g.float() if fmt is None else decode_records(g, fmt)


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Tensor,
    softmax_scale: float,
    kv2: Tensor | None = None,
    indices2: Tensor | None = None,
    kv_format: KVFormat | None = None,
    kv2_format: KVFormat | None = None,
) -> Tensor:
    """q [T, H, D], kv [S, D], indices [T, K] int64 (-1 invalid), attn_sink [H] -> o [T, H, D] in q's dtype.

    kv2 [S2, D] / indices2 [T, K2]: a second source; token t attends to kv[indices[t]] and kv2[indices2[t]]
    under one softmax (as if both lists were one list over one pool). kv_format / kv2_format: the source holds
    uint8 records of that format ([S, record bytes]), decoded to float32 after the gather (the decoded values are
    exact in bf16, so the result equals attention over `dequantize(records)` in bf16)."""
    valid = indices >= 0
    k = _rows(kv, indices.clamp(min=0), kv_format)  # [T, K, D]
    if kv2 is not None and kv2.shape[0] > 0:  # an empty second source has only -1 indices: nothing to add
        valid = torch.cat([valid, indices2 >= 0], 1)
        k = torch.cat([k, _rows(kv2, indices2.clamp(min=0), kv2_format)], 1)
    scores = torch.einsum("thd,tkd->thk", q.float(), k) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = attn_sink.float()[None, :, None].expand(scores.shape[0], -1, 1)
    m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    p = e / denom
    return torch.einsum("thk,tkd->thd", p, k).to(q.dtype)
