"""Sampling ops (penalties, min-p/top-k/top-p masking, seeded sampling). Only the torch reference exists so far;
it is device-agnostic and sync-free, so CUDA runs use it too."""

from deepinfer_kernels.sampling.reference import (
    apply_penalties,
    counter_uniform,
    logprobs_topk,
    mask_logits,
    sample,
    token_counts,
)

__all__ = ["apply_penalties", "counter_uniform", "logprobs_topk", "mask_logits", "sample", "token_counts"]
