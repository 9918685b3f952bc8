"""Lightning indexer for V4.1 CSA2 (docs/model.md §C.4): scores, causal top-k with -1 padding, candidates.

Pure-torch references; the scores and the causal top-k also have Triton kernels (fused scores over the bf16 keys;
a top-k with no sort), dispatched here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.indexer import reference
from deepinfer_kernels.indexer.reference import (
    candidate_blocks,
    causal_mask,
    visible_counts,
)

__all__ = ["candidate_blocks", "causal_mask", "index_scores", "store_rows", "topk_indices", "visible_counts"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def index_scores(q: Tensor, weights: Tensor, keys: Tensor, *, w_scale: float = 1.0, backend: str = "auto") -> Tensor:
    """Lightning-indexer scores ``score[t, n] = sum_h weights[t, h] * ReLU(q[t, h] . keys[n])`` -> ``[T, N]
    float32``. q ``[T, H, D]`` (RoPE'd), weights ``[T, H]`` times ``w_scale`` (the head-weight scale: one fp32
    multiply, inside the kernel, no separate launch; 1.0 = weights scaled by the caller), keys ``[N, D]`` shared by every
    query, or ``[T, N, D]``: each query its own keys (a fixed-shape decode step, one query per sequence).
    backend: "auto" | "torch" | "triton" (the kernel: q and keys of one dtype, bf16 / fp16 / fp32; equal to the
    reference up to fp32 summation order)."""
    if keys.dim() == 3:
        ref_fn = reference.index_scores_per_query
        shapes_ok = q.dim() == 3 and keys.shape[0] == q.shape[0] and keys.shape[2] == q.shape[-1]
    else:
        ref_fn = reference.index_scores
        shapes_ok = q.dim() == 3 and keys.dim() == 2 and keys.shape[1] == q.shape[-1]
    if not shapes_ok or weights.shape != q.shape[:2]:
        raise ValueError(f"index_scores: q {tuple(q.shape)}, weights {tuple(weights.shape)}, keys "
                         f"{tuple(keys.shape)}; expected [T, H, D], [T, H] and [N, D] or [T, N, D]")
    ok = q.dtype in _FLOATS and keys.dtype == q.dtype and weights.is_floating_point() and q.shape[1] <= 256
    why = f"q {q.dtype} H {q.shape[1]}, keys {keys.dtype}; needs q and keys of one float dtype and H <= 256"
    if resolve_backend("index_scores", backend, q, weights, keys, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.indexer import triton as triton_backend

        return triton_backend.index_scores(q, weights, keys, w_scale)
    return ref_fn(q, weights if w_scale == 1.0 else weights * w_scale, keys)


def topk_indices(scores: Tensor, k: int, visible: Tensor | None = None, *, backend: str = "auto") -> Tensor:
    """Causal top-k: ``[T, k] int64`` entry ids, valid ids ascending first, then -1 padding (`reference.topk_indices`:
    the k largest finite scores of each row, ties to the lower id).

    scores ``[T, N]`` float, causally masked already (-inf = not selectable) unless ``visible`` ``[T] int`` is
    given: then entries ``w >= visible[t]`` are not selectable either (``causal_mask`` folded in). backend: "auto" |
    "torch" | "triton" (the kernel: fp32 / bf16 / fp16 scores, N and k below 2**30)."""
    if k < 1:
        raise ValueError(f"topk_indices: k must be >= 1, found {k}")
    if scores.dim() != 2 or (visible is not None and tuple(visible.shape) != (scores.shape[0],)):
        raise ValueError(f"topk_indices: scores {tuple(scores.shape)}, visible "
                         f"{None if visible is None else tuple(visible.shape)}; expected [T, N] and [T]")
    ok = scores.dtype in _FLOATS and scores.shape[1] < 2**30 and k < 2**30
    why = f"scores {scores.dtype} {tuple(scores.shape)}, k {k}; needs fp32/bf16/fp16, N and k < 2**30"
    tensors = (scores,) if visible is None else (scores, visible)
    if resolve_backend("topk_indices", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.indexer import triton as triton_backend

        return triton_backend.topk_indices(scores, k, visible)
    if visible is not None:
        scores = reference.causal_mask(scores, visible)
    return reference.topk_indices(scores, k)


def store_rows(
    sel: Tensor, seq_of_token: Tensor, seq_offsets: Tensor, rows: Tensor, *, backend: str = "auto"
) -> Tensor:
    """Per-sequence entry ids -> compressed-store rows: ``out[t, j] = rows[seq_offsets[seq_of_token[t]] +
    sel[t, j]]`` (-1 stays -1). sel ``[T, K] int64``, seq_of_token ``[T]`` int, seq_offsets ``[S]`` int, rows
    ``[E] int64`` -> ``[T, K] int64``; out-of-range ids are clamped into rows (as the reference). backend: "auto" |
    "torch" | "triton" (one launch instead of ~7 torch ops)."""
    if sel.dim() != 2 or seq_of_token.shape != (sel.shape[0],) or seq_offsets.dim() != 1 or rows.dim() != 1:
        raise ValueError(f"store_rows: sel {tuple(sel.shape)}, seq_of_token {tuple(seq_of_token.shape)}, seq_offsets "
                         f"{tuple(seq_offsets.shape)}, rows {tuple(rows.shape)}; expected [T, K], [T], [S], [E]")
    ok = sel.dtype == torch.int64 and rows.dtype == torch.int64 and rows.numel() > 0
    why = f"sel {sel.dtype}, rows {rows.dtype} [{rows.numel()}]; needs int64 and at least one row"
    tensors = (sel, seq_of_token, seq_offsets, rows)
    if resolve_backend("store_rows", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.indexer import triton as triton_backend

        return triton_backend.store_rows(sel, seq_of_token, seq_offsets, rows)
    return reference.store_rows(sel, seq_of_token, seq_offsets, rows)
