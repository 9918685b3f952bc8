"""V4.1 Engram gate and injection into the hc streams (docs/model.md §C.6): torch reference; Triton injection."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.engram import reference
from deepinfer_kernels.engram.reference import GATE_CLAMP, engram_gate

__all__ = ["GATE_CLAMP", "engram_gate", "engram_inject"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def engram_inject(
    r: Tensor, keys: Tensor, val: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
    image_mask: Tensor | None = None, *, backend: str = "auto",
) -> Tensor:
    """``R_i + gate_i · val``: r [T, n, d], keys [T, n, d], val [T, d], q_weight / k_weight [n, d], image_mask
    [T] bool (gate 0) or None -> [T, n, d] in r's dtype, fp32 math (reference.engram_gate).
    backend: "auto" | "torch" | "triton" (the kernel needs n a power of two and bf16/fp16/fp32 tensors)."""
    t, n, d = r.shape if r.dim() == 3 else (0, 0, 0)
    if r.dim() != 3 or keys.shape != r.shape or val.shape != (t, d) or q_weight.shape != (n, d) or (
        k_weight.shape != (n, d)
    ):
        raise ValueError(
            f"engram_inject: expected r [T, n, d], keys [T, n, d], val [T, d], q/k_weight [n, d]; found "
            f"{tuple(r.shape)}, {tuple(keys.shape)}, {tuple(val.shape)}, {tuple(q_weight.shape)}, "
            f"{tuple(k_weight.shape)}"
        )
    if image_mask is not None and image_mask.shape != (t,):
        raise ValueError(f"engram_inject: image_mask {tuple(image_mask.shape)}, expected ({t},)")
    ok = n >= 1 and (n & (n - 1)) == 0 and all(x.dtype in _DTYPES for x in (r, keys, val, q_weight, k_weight))
    why = f"n {n}, dtypes {r.dtype}/{keys.dtype}/{val.dtype}; needs n a power of two and bf16/fp16/fp32"
    tensors = (r, keys, val, q_weight, k_weight) + (() if image_mask is None else (image_mask,))
    if resolve_backend("engram_inject", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.engram import triton as triton_backend

        return triton_backend.engram_inject(r, keys, val, q_weight, k_weight, eps, image_mask)
    return reference.engram_inject(r, keys, val, q_weight, k_weight, eps, image_mask)
