"""Sparse MQA attention over indexed kv rows with attn_sink (docs/model.md §A.4): torch reference, Triton, and a
warp-specialised TileLang kernel for decode batches at the V4.1 head shape (docs/kernels.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import KernelBackendError, backend_from_env, resolve_backend
from deepinfer_kernels.sparse_attn import reference

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# From this many tokens on, "auto" runs the TileLang kernel where it applies (bf16, 64 heads x 512, sm_90, tilelang
# installed): one CTA per token, so at 16 tokens and fewer the Triton kernel's index-list splits win (H200: 24.5 vs
# 22.6 us at 16 tokens, 25.0 vs 28.4 at 32; docs/perf.md "Sparse decode attention, warp-specialised").
TILELANG_MIN_TOKENS = 32

__all__ = ["TILELANG_MIN_TOKENS", "sparse_attn"]


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Tensor,
    softmax_scale: float,
    *,
    kv2: Tensor | None = None,
    indices2: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """q [T, H, D]; kv [S, D] (one shared K=V head); indices [T, K] int64 rows of kv, -1 = unused;
    attn_sink [H] fp32; returns [T, H, D] in q's dtype. Rows whose indices are all -1 give zeros.
    kv2 [S2, D] (same dtype) / indices2 [T, K2] int64: an optional second source read in place (e.g. a paged
    compressed cache viewed as [pages * rows, D], addressed by store rows): each token's list is indices[t]
    over kv followed by indices2[t] over kv2, one softmax over both (FlashMLA-style window + sparse extra KV).
    backend: "auto" | "torch" | "triton" | "tilelang" (deepinfer_kernels._backend.resolve_backend; "tilelang" is
    this op's own explicit choice). The triton kernel needs q and kv of one dtype in {bf16, fp16, fp32} and
    D <= 1024; the tilelang kernel bf16, 64 heads, D = 512 on sm_90 (`tilelang.supports`), and "auto" takes it
    from TILELANG_MIN_TOKENS tokens on. Both treat indices >= S like -1 instead of raising (the range check below
    would cost a device sync per call)."""
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(
            f"sparse_attn: expected q [T,H,D], kv [S,D], indices [T,K]; found {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    if q.shape[2] != kv.shape[1] or indices.shape[0] != q.shape[0] or attn_sink.shape != (q.shape[1],):
        raise ValueError(
            f"sparse_attn: shape mismatch q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}, "
            f"attn_sink {tuple(attn_sink.shape)}"
        )
    if indices.dtype != torch.int64:
        raise ValueError(f"sparse_attn: indices dtype {indices.dtype}, expected int64")
    if (kv2 is None) != (indices2 is None):
        raise ValueError("sparse_attn: kv2 and indices2 go together (both or neither)")
    if kv2 is not None and (
        kv2.dim() != 2 or kv2.shape[1] != kv.shape[1] or kv2.dtype != kv.dtype or indices2.dim() != 2
        or indices2.shape[0] != q.shape[0] or indices2.dtype != torch.int64
    ):  # fmt: skip
        raise ValueError(
            f"sparse_attn: second source kv2 {tuple(kv2.shape)} {kv2.dtype}, indices2 {tuple(indices2.shape)} "
            f"{indices2.dtype}; expected kv2 [S2, {kv.shape[1]}] {kv.dtype} and indices2 [{q.shape[0]}, K2] int64"
        )
    if backend == "tilelang":
        from deepinfer_kernels.sparse_attn import tilelang as tilelang_backend

        if not tilelang_backend.tilelang_available():
            raise KernelBackendError(
                "sparse_attn: backend='tilelang' but tilelang is not importable; install deepinfer-kernels[tilelang]"
            )
        if not tilelang_backend.supports(q, kv, indices, kv2):
            raise KernelBackendError(
                f"sparse_attn: backend='tilelang' has no kernel for q {tuple(q.shape)} {q.dtype} on {q.device}, "
                f"kv {kv.dtype}, indices {tuple(indices.shape)}; it needs bf16 q [T, 64, 512] and kv on an sm_90 "
                "GPU and a non-empty first index list; use 'triton' or 'torch'"
            )
        return tilelang_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2=kv2, indices2=indices2)
    ok = q.dtype in _TRITON_DTYPES and kv.dtype == q.dtype and q.shape[2] <= 1024
    why = f"q {q.dtype}, kv {kv.dtype}, D {q.shape[2]}; needs one dtype in bf16/fp16/fp32 and D <= 1024"
    if resolve_backend("sparse_attn", backend, q, kv, indices, attn_sink, triton_ok=ok, why_not=why) == "triton":
        # "auto" under DEEPINFER_KERNEL_BACKEND=triton is an explicit request for the Triton kernels
        auto = backend == "device" or (backend == "auto" and backend_from_env() == "device")
        if auto and q.shape[0] >= TILELANG_MIN_TOKENS:
            from deepinfer_kernels.sparse_attn import tilelang as tilelang_backend

            if tilelang_backend.tilelang_available() and tilelang_backend.supports(q, kv, indices, kv2):
                return tilelang_backend.sparse_attn(
                    q, kv, indices, attn_sink, softmax_scale, kv2=kv2, indices2=indices2
                )
        from deepinfer_kernels.sparse_attn import triton as triton_backend

        return triton_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2=kv2, indices2=indices2)
    for name, src, idx in (("kv", kv, indices), ("kv2", kv2, indices2)):
        if idx is not None and idx.numel() and int(idx.max()) >= src.shape[0]:
            raise ValueError(f"sparse_attn: index {int(idx.max())} out of range for {src.shape[0]} {name} rows")
    return reference.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2, indices2)
