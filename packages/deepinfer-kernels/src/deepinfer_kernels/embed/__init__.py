"""Token embeddings as the n residual streams of the first layer: torch reference; one Triton gather kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.embed import reference

__all__ = ["embed_streams"]


def embed_streams(ids: Tensor, weight: Tensor, streams: int, *, backend: str = "auto") -> Tensor:
    """``[T, streams, d]`` in weight's dtype: every stream of token t is ``weight[ids[t]]``, or 0 for an id at or
    past the table's rows (V4.1 image-position ids). ids ``[T]`` int, weight ``[V, d]``. backend: "auto" | "torch"
    | "triton" (one launch instead of clamp, gather, masked fill and the stream copy)."""
    if ids.dim() != 1 or weight.dim() != 2 or streams < 1:
        raise ValueError(f"embed_streams: ids {tuple(ids.shape)}, weight {tuple(weight.shape)}, streams {streams}; "
                         "expected [T], [V, d] and streams >= 1")
    ok = not ids.is_floating_point() and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
    why = f"ids {ids.dtype}, weight {weight.dtype}; needs integer ids and a bf16/fp16/fp32 table"
    if resolve_backend("embed_streams", backend, ids, weight, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.embed import triton as triton_backend

        return triton_backend.embed_streams(ids, weight, streams)
    return reference.embed_streams(ids, weight, streams)
