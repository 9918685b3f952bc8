"""MoE experts: clamped SwiGLU expert and the routed combine (docs/model.md §2, docs/model.md §A.8).

`moe_experts` takes the experts either as a sequence of float ``(w1, w3, w2)`` or as one `StackedExperts`
(``[E, ...]`` in the checkpoint format, or FP4 in the chunked layout of `fp4_layout`). Torch reference everywhere
(per-call exact decode of the experts a step uses); on CUDA the FP4 experts run the Triton grouped W4A16 path
(device-side permutation, fused SwiGLU, no host read), or, for decode token counts (T <= 4 at top-6) on the chunked
layout, the CUDA-core gemv kernels of `moe.fp4_gemv` (`moe.triton.GEMV_TILES`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.moe import reference
from deepinfer_kernels.moe.reference import swiglu_expert
from deepinfer_kernels.moe.stacked import EXPERT_FORMATS, StackedExperts

__all__ = ["EXPERT_FORMATS", "StackedExperts", "moe_experts", "swiglu_expert"]


def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    experts: Sequence[tuple[Tensor, Tensor, Tensor]] | StackedExperts,
    limit: float,
    *,
    shared: Tensor | None = None,
    shared_ready: torch.cuda.Event | None = None,
    backend: str = "auto",
) -> Tensor:
    """x [T, d]; weights [T, k] fp32; ids [T, k] int64 in [0, E); experts[e] = (w1 [I,d], w3 [I,d], w2 [d,I])
    or a `StackedExperts`. Returns [T, d] fp32 (sum of weighted expert outputs), or, with shared [T, d] (the
    shared experts' output, any float dtype), [T, d] in x's dtype = (routed sum + shared in fp32) rounded once:
    the Triton path does the k-sum, the add and the cast in one launch (`triton.combine_rows`).

    backend: "auto" | "torch" | "triton" (Triton: FP4 stacked experts, x bf16 / fp16 / fp32, d and I multiples
    of 32). The reference checks the id range (one host read); the Triton path trusts the router's ids.

    shared_ready: CUDA event after which `shared` is complete, when a caller computes the shared expert on another
    stream; the current stream waits on it right before the combine reads `shared`, so the routed GEMMs run
    beside the shared expert."""
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts: weights {tuple(weights.shape)}, ids {tuple(ids.shape)}, x {tuple(x.shape)}"
        )
    if shared is not None and shared.shape != x.shape:
        raise ValueError(f"moe_experts: shared {tuple(shared.shape)}, expected x's shape {tuple(x.shape)}")
    out_dtype = None if shared is None else x.dtype
    stacked = isinstance(experts, StackedExperts)
    ok = (
        stacked
        and experts.fmt in ("fp4", "fp4_chunked")
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.shape[1] == experts.hidden
        and x.shape[1] % 32 == 0
        and experts.inter % 32 == 0
    )
    why = "needs StackedExperts in fp4 / fp4_chunked with d, I multiples of 32 and a float x"
    tensors = (x, experts.w1) if stacked else (x,)
    if resolve_backend("moe_experts", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.moe import triton as triton_backend

        e = experts
        return triton_backend.moe_experts_fp4(x, weights, ids, e.w1, e.w3, e.w2, e.s1, e.s3, e.s2, limit,
                                              chunked=e.fmt == "fp4_chunked", shared=shared,
                                              out_dtype=out_dtype, shared_ready=shared_ready)  # fmt: skip
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host read for both bounds
        if lo < 0 or hi >= len(experts):
            raise ValueError(f"moe_experts: expert ids must be in [0, {len(experts)}), found {lo}..{hi}")
    y = reference.moe_experts(x, weights, ids, experts, limit)
    reference.wait_shared(shared_ready)
    return reference.add_shared(y, shared, out_dtype)
