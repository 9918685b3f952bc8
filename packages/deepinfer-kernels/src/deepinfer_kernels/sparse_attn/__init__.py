"""Sparse MQA attention over indexed kv rows with attn_sink (docs/model.md §A.4): torch reference, Triton, and a
warp-specialised TileLang kernel for decode batches at the V4.1 head shape (docs/kernels.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import KernelBackendError, backend_from_env, resolve_backend
from deepinfer_kernels.quant.kv_formats import KVFormat
from deepinfer_kernels.sparse_attn import reference

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# From this many tokens on, "auto" runs the TileLang kernel where it applies (bf16, 64 heads x 512, sm_90, tilelang
# installed): one CTA per token, so at 16 tokens and fewer the Triton kernel's index-list splits win (H200: 24.5 vs
# 22.6 us at 16 tokens, 25.0 vs 28.4 at 32; docs/perf.md "Sparse decode attention, warp-specialised").
TILELANG_MIN_TOKENS = 32
# The threshold for record sources (kv_format / kv2_format): the TileLang producer decodes at most 32 rows per SM
# at a time, so it wins later (H200, MXFP8 window + NVFP4 compressed rows: 61.5 vs 56.1 us at 32 tokens, 63.3 vs
# 94.2 at 64; docs/perf.md "KV records read in place").
TILELANG_MIN_TOKENS_RECORDS = 64

__all__ = ["TILELANG_MIN_TOKENS", "TILELANG_MIN_TOKENS_RECORDS", "sparse_attn"]


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Tensor,
    softmax_scale: float,
    *,
    kv2: Tensor | None = None,
    indices2: Tensor | None = None,
    kv_format: KVFormat | None = None,
    kv2_format: KVFormat | None = None,
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
    would cost a device sync per call).
    kv_format / kv2_format (`deepinfer_kernels.quant.kv_formats.KVFormat`, default None = plain values): that
    source is the cache's deployed records, uint8 [S, fmt.record_bytes(D)] (codes, then scale bytes), read in
    place and decoded in the gather (MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1; the tilelang kernel MXFP8 and NVFP4, and
    "auto" takes it from TILELANG_MIN_TOKENS_RECORDS tokens on, with its staged record producer when every
    source is records)."""
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(
            f"sparse_attn: expected q [T,H,D], kv [S,D], indices [T,K]; found {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    d = q.shape[2]
    width = _row_width(kv, kv_format, d, "kv")
    width2 = None if kv2 is None else _row_width(kv2, kv2_format, d, "kv2")
    if width != d or indices.shape[0] != q.shape[0] or attn_sink.shape != (q.shape[1],):
        raise ValueError(
            f"sparse_attn: shape mismatch q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}, "
            f"attn_sink {tuple(attn_sink.shape)}"
        )
    if indices.dtype != torch.int64:
        raise ValueError(f"sparse_attn: indices dtype {indices.dtype}, expected int64")
    if (kv2 is None) != (indices2 is None):
        raise ValueError("sparse_attn: kv2 and indices2 go together (both or neither)")
    if kv2 is not None and (
        kv2.dim() != 2 or width2 != d or (kv2_format is None and kv2.dtype != (q if kv_format else kv).dtype)
        or indices2.dim() != 2
        or indices2.shape[0] != q.shape[0] or indices2.dtype != torch.int64
    ):  # fmt: skip
        raise ValueError(
            f"sparse_attn: second source kv2 {tuple(kv2.shape)} {kv2.dtype}, indices2 {tuple(indices2.shape)} "
            f"{indices2.dtype}; expected kv2 [S2, {d}] {(q if kv_format else kv).dtype} (or uint8 records with kv2_format) and indices2 "
            f"[{q.shape[0]}, K2] int64"
        )
    records = kv_format is not None or kv2_format is not None
    if backend == "tilelang":
        from deepinfer_kernels.sparse_attn import tilelang as tilelang_backend

        if not tilelang_backend.tilelang_available():
            raise KernelBackendError(
                "sparse_attn: backend='tilelang' but tilelang is not importable; install deepinfer-kernels[tilelang]"
            )
        if not tilelang_backend.supports(q, kv, indices, kv2, kv_format, kv2_format):
            raise KernelBackendError(
                f"sparse_attn: backend='tilelang' has no kernel for q {tuple(q.shape)} {q.dtype} on {q.device}, "
                f"kv {kv.dtype}, indices {tuple(indices.shape)}; it needs bf16 q [T, 64, 512] and kv on an sm_90 "
                "GPU (or 16-byte aligned MXFP8 / NVFP4 records) and a non-empty first index list; use 'triton' or "
                "'torch'"
            )
        return tilelang_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2=kv2, indices2=indices2,
                                            kv_format=kv_format, kv2_format=kv2_format)  # fmt: skip
    ok = q.dtype in _TRITON_DTYPES and (kv.dtype == q.dtype or kv_format is not None) and d <= 1024
    ok = ok and (not records or (d >= 32 and d & (d - 1) == 0))
    why = (f"q {q.dtype}, kv {kv.dtype}, D {d}; needs one dtype in bf16/fp16/fp32 (or kv records) and D <= 1024 "
           "(a power of two >= 32 with records)")  # fmt: skip
    if resolve_backend("sparse_attn", backend, q, kv, indices, attn_sink, triton_ok=ok, why_not=why) == "triton":
        # "auto" under DEEPINFER_KERNEL_BACKEND=triton is an explicit request for the Triton kernels
        auto = backend == "device" or (backend == "auto" and backend_from_env() == "device")
        if auto and q.shape[0] >= (TILELANG_MIN_TOKENS_RECORDS if records else TILELANG_MIN_TOKENS):
            from deepinfer_kernels.sparse_attn import tilelang as tilelang_backend

            if tilelang_backend.tilelang_available() and tilelang_backend.supports(
                q, kv, indices, kv2, kv_format, kv2_format
            ):
                staged = {}
                if kv_format is not None and (kv2 is None or kv2_format is not None):
                    # every source is records: the staged producer (H200, MXFP8 window + NVFP4 compressed rows:
                    # 108.6 vs 126.9 us at 256 tokens, 50.6 vs 63.7 at 64; docs/perf.md "Records decode step")
                    staged = dict(block_rows=tilelang_backend.STAGED_BLOCK_ROWS, staged=True)
                return tilelang_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2=kv2,
                                                    indices2=indices2, kv_format=kv_format, kv2_format=kv2_format,
                                                    **staged)  # fmt: skip
        from deepinfer_kernels.sparse_attn import triton as triton_backend

        return triton_backend.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2=kv2, indices2=indices2,
                                          kv_format=kv_format, kv2_format=kv2_format)  # fmt: skip
    for name, src, idx in (("kv", kv, indices), ("kv2", kv2, indices2)):
        if idx is not None and idx.numel() and int(idx.max()) >= src.shape[0]:
            raise ValueError(f"sparse_attn: index {int(idx.max())} out of range for {src.shape[0]} {name} rows")
    return reference.sparse_attn(q, kv, indices, attn_sink, softmax_scale, kv2, indices2, kv_format, kv2_format)


# (element, scale, block) of the record formats the kernels decode in the gather
_RECORD_FORMATS = {("e4m3", "ue8m0", 32), ("e2m1", "e4m3", 16), ("e2m1", "ue8m0", 32)}


def _row_width(src: Tensor, fmt: KVFormat | None, dim: int, name: str) -> int:
    """Values per row of a source (its columns, or the channels its records hold); checks record sources."""
    if fmt is None or src.dim() != 2:
        return src.shape[-1]
    if (fmt.element, fmt.scale, fmt.block) not in _RECORD_FORMATS:
        raise ValueError(f"sparse_attn: {name} record format {fmt.name} has no decoder; use MXFP8_E4M3, "
                         "NVFP4_E2M1 or MXFP4_E2M1, or pass decoded values")  # fmt: skip
    if src.dtype != torch.uint8 or dim % fmt.block or src.shape[1] != fmt.record_bytes(dim):
        raise ValueError(
            f"sparse_attn: {name} {tuple(src.shape)} {src.dtype} is not a set of {fmt.name} records of {dim} "
            f"channels; expected uint8 [S, {fmt.record_bytes(dim) if dim % fmt.block == 0 else '?'}] (codes then "
            "scale bytes, deepinfer_kernels.quant.kv_formats)"
        )
    return dim
