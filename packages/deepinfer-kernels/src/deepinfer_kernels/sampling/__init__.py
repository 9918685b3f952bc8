"""Sampling ops (penalties, min-p/top-k/top-p masking, seeded sampling, greedy argmax, inverse-CDF draws). Torch
references, device agnostic and sync-free (CUDA runs use them too); Triton two-stage kernels for the greedy argmax
and the inverse-CDF draws over large vocabularies."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.sampling import reference
from deepinfer_kernels.sampling.reference import (
    apply_penalties,
    counter_uniform,
    logprobs_topk,
    mask_logits,
    sample,
    token_counts,
)

__all__ = [
    "apply_penalties",
    "counter_uniform",
    "greedy_argmax",
    "inverse_cdf_sample",
    "logprobs_topk",
    "logsumexp_rows",
    "mask_logits",
    "residual_sample",
    "sample",
    "softmax_sample",
    "token_counts",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _float_rows(name: str, x: Tensor) -> tuple[bool, str]:
    """(a Triton kernel takes these [N, V] rows, why not): bf16/fp16/fp32 and 0 < V < 2**31 - 1."""
    ok = x.dtype in _FLOATS and 0 < x.shape[1] < 2**31 - 1
    return ok, f"{name} {x.dtype} [{x.shape[0]}, {x.shape[1]}]; needs bf16/fp16/fp32, 0 < V < 2**31 - 1"


def _dispatch(name: str, backend: str, tensors: list[Tensor], ok: bool, why: str, *args: object, **kw: object):
    """`name` of the Triton backend (imported on first use: it needs triton) or of the torch reference, whichever
    `resolve_backend` picks for these tensors; both take the same arguments."""
    if resolve_backend(name, backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.sampling import triton as triton_backend

        return getattr(triton_backend, name)(*args, **kw)
    return getattr(reference, name)(*args, **kw)


def greedy_argmax(logits: Tensor, *, invalid: int | None = None, backend: str = "auto") -> Tensor:
    """logits [N, V] float -> [N] int64 greedy ids, identical to torch.argmax(dim=-1) (ties: the lowest index;
    NaN is the largest value, the first NaN wins). invalid: id of the rows whose max is not finite (NaN, +Inf,
    all -Inf). backend: "auto" | "torch" | "triton" (the kernel takes bf16/fp16/fp32 [N, V] with V < 2**31)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_argmax: logits must be [N, V], found {tuple(logits.shape)}")
    ok, why = _float_rows("logits", logits)
    return _dispatch("greedy_argmax", backend, [logits], ok, why, logits, invalid=invalid)


def inverse_cdf_sample(weights: Tensor, uniforms: Tensor, *, backend: str = "auto") -> Tensor:
    """One id per row of unnormalised weights: weights [N, V] float (>= 0), uniforms [N] float32 in [0, 1) ->
    [N] int64, the first id whose cumulative weight exceeds u * total; zero-weight ids are never chosen, an
    all-zero row gives V - 1. The Triton kernel (bf16/fp16/fp32) equals the reference up to summation order
    (`sampling/triton.py`)."""
    if weights.dim() != 2 or uniforms.shape != weights.shape[:1]:
        raise ValueError(f"inverse_cdf_sample: expected weights [N, V] and uniforms [N], found "
                         f"{tuple(weights.shape)} / {tuple(uniforms.shape)}")
    ok, why = _float_rows("weights", weights)
    return _dispatch("inverse_cdf_sample", backend, [weights, uniforms], ok, why, weights, uniforms)


def softmax_sample(logits: Tensor, temperature: Tensor | None = None, uniforms: Tensor | None = None, *,
                   probs_out: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:  # fmt: skip
    """Inverse-CDF draw from softmax(logits / temperature) per row, and the row's argmax.

    logits: [N, V] float32, finite (e.g. a draft head's logits); temperature: [N] float32, 0 = a greedy row (its
    token is the argmax), None = every row greedy; uniforms: [N] float32 in [0, 1), required with temperature.
    probs_out: [N, V] float32 (may be `logits` itself: overwritten in place) that takes each row's distribution,
    softmax(logits / T) for sampled rows and one-hot at the argmax for greedy rows; not written without
    temperature. Returns (tokens [N] int64, argmax [N] int64, ties: the lowest index). The Triton kernel equals
    the reference up to summation order (`sampling/triton.py`)."""
    if logits.dim() != 2:
        raise ValueError(f"softmax_sample: logits must be [N, V], found {tuple(logits.shape)}")
    n, v = logits.shape
    if temperature is not None and (temperature.shape != (n,) or uniforms is None or uniforms.shape != (n,)):
        raise ValueError(f"softmax_sample: expected temperature and uniforms of shape ({n},), found "
                         f"{None if temperature is None else tuple(temperature.shape)} / "
                         f"{None if uniforms is None else tuple(uniforms.shape)}")
    if probs_out is not None and (probs_out.shape != (n, v) or probs_out.dtype != torch.float32):
        raise ValueError(f"softmax_sample: probs_out must be [{n}, {v}] float32, found {tuple(probs_out.shape)} "
                         f"{probs_out.dtype}")
    ok = (logits.dtype == torch.float32 and 0 < v < 2**31 - 1
          and (probs_out is None or probs_out.stride(-1) == 1))
    why = f"logits {logits.dtype} [{n}, {v}]; needs float32, 0 < V < 2**31 - 1, probs_out with a contiguous last dim"
    tensors = [logits] + ([temperature, uniforms] if temperature is not None else [])
    return _dispatch("softmax_sample", backend, tensors, ok, why, logits, temperature, uniforms, probs_out=probs_out)


def logsumexp_rows(logits: Tensor, temperature: Tensor, *, backend: str = "auto") -> Tensor:
    """log sum_v exp(logits / T) per row: logits [R, V] float (bf16 read as is), temperature [R] float32 > 0 ->
    [R] float32. p[r, v] = exp(logits[r, v] / T[r] - lse[r]) then costs a gather, not a softmax of every row (the
    Triton kernel reads the logits once and writes nothing of [R, V])."""
    if logits.dim() != 2 or temperature.shape != logits.shape[:1]:
        raise ValueError(f"logsumexp_rows: expected logits [R, V] and temperature [R], found {tuple(logits.shape)} "
                         f"/ {tuple(temperature.shape)}")
    ok, why = _float_rows("logits", logits)
    return _dispatch("logsumexp_rows", backend, [logits, temperature], ok, why, logits, temperature)


def residual_sample(logits: Tensor, rows: Tensor, temperature: Tensor, lse: Tensor, draft_probs: Tensor | None,
                    positions: Tensor | None, rejected: Tensor, uniforms: Tensor, *, alpha: float = 1.0,
                    backend: str = "auto") -> Tensor:  # fmt: skip
    """The correction / bonus draw of speculative rejection sampling, one per request b (`reference.
    residual_sample`): from p = softmax(logits[rows[b]] / temperature[rows[b]]), or where `rejected[b]` from the
    residual max(0, p - alpha * draft_probs[b, positions[b]]) (p when it is all zero).

    logits [R, V] float (bf16 read as is), rows [B] int64, temperature / lse [R] float32 (`logsumexp_rows`),
    draft_probs [B, N, V] float32 or None (p for every request), positions [B] int64 in [0, N) (with draft_probs),
    rejected [B] bool, uniforms [B] float32 in [0, 1) -> [B] int64. The Triton kernels read the target row and the
    draft row once and scan one chunk, without writing a [B, V] distribution; they equal the reference up to
    float rounding (p as exp(l / T - lse) against a softmax; summation order)."""
    if logits.dim() != 2 or temperature.shape != logits.shape[:1] or lse.shape != logits.shape[:1]:
        raise ValueError(f"residual_sample: expected logits [R, V], temperature and lse [R], found "
                         f"{tuple(logits.shape)} / {tuple(temperature.shape)} / {tuple(lse.shape)}")
    b = rows.shape[0]
    if rows.shape != (b,) or rejected.shape != (b,) or uniforms.shape != (b,):
        raise ValueError(f"residual_sample: expected rows, rejected and uniforms of shape ({b},), found "
                         f"{tuple(rows.shape)} / {tuple(rejected.shape)} / {tuple(uniforms.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 3 or draft_probs.shape[0] != b
                                    or draft_probs.shape[2] != logits.shape[1] or positions is None
                                    or positions.shape != (b,)):
        raise ValueError(f"residual_sample: expected draft_probs [{b}, N, {logits.shape[1]}] with positions [{b}], "
                         f"found {tuple(draft_probs.shape)} / {None if positions is None else tuple(positions.shape)}")
    ok, why = _float_rows("logits", logits)
    if draft_probs is not None and (draft_probs.dtype != torch.float32 or draft_probs.stride(-1) != 1):
        ok, why = False, f"draft_probs {draft_probs.dtype} with last-dim stride {draft_probs.stride(-1)}; needs float32, contiguous rows"
    tensors = [logits, rows, temperature, lse, rejected, uniforms] + ([draft_probs] if draft_probs is not None else [])
    return _dispatch("residual_sample", backend, tensors, ok, why, logits, rows, temperature, lse, draft_probs,
                     positions, rejected, uniforms, alpha)
