"""Sampling ops (penalties, min-p/top-k/top-p masking, seeded sampling, greedy argmax). Torch references, device
agnostic and sync-free (CUDA runs use them too); a Triton two-stage greedy argmax for large vocabularies."""

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
    "logprobs_topk",
    "mask_logits",
    "sample",
    "token_counts",
]


def greedy_argmax(logits: Tensor, *, invalid: int | None = None, backend: str = "auto") -> Tensor:
    """logits [N, V] float -> [N] int64 greedy ids, identical to torch.argmax(dim=-1) (ties: the lowest index;
    NaN is the largest value, the first NaN wins). invalid: id of the rows whose max is not finite (NaN, +Inf,
    all -Inf). backend: "auto" | "torch" | "triton" (the kernel takes bf16/fp16/fp32 [N, V] with V < 2**31)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_argmax: logits must be [N, V], found {tuple(logits.shape)}")
    n, v = logits.shape
    ok = logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and 0 < v < 2**31 - 1
    why = f"logits {logits.dtype} [{n}, {v}]; needs bf16/fp16/fp32 and 0 < V < 2**31 - 1"
    if resolve_backend("greedy_argmax", backend, logits, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.sampling import triton as triton_backend

        return triton_backend.greedy_argmax(logits, invalid=invalid)
    return reference.greedy_argmax(logits, invalid=invalid)
