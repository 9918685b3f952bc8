"""RMSNorm and interleaved RoPE on the trailing rope dims (docs/model.md §2): torch references; Triton RMSNorm and
RoPE rotation."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.norm_rope import reference
from deepinfer_kernels.norm_rope.reference import rope_freqs, yarn_correction_range

__all__ = [
    "apply_rope",
    "apply_rope_at",
    "rms_norm",
    "rope_at_uses_kernel",
    "rope_cos_sin",
    "rope_freqs",
    "yarn_correction_range",
]


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TRITON_MAX_D = 16384  # == norm_rope.triton.MAX_D (kept here so the dispatcher does not import triton)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, backend: str = "auto", pdl: bool = False) -> Tensor:
    """x [..., D] any float dtype; weight [D] or None; fp32 math; returns x's dtype.
    backend: "auto" | "torch" | "triton" (the Triton kernel takes bf16/fp16/fp32 x with D <= 16384).
    pdl: launch the kernel as a programmatic dependent launch on sm_90+ (docs/pdl.md); same results either way."""
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    ok = x.dtype in _TRITON_DTYPES and 0 < x.shape[-1] <= _TRITON_MAX_D
    why = f"x {x.dtype} with D {x.shape[-1]}; needs bf16/fp16/fp32 and 0 < D <= {_TRITON_MAX_D}"
    tensors = (x,) if weight is None else (x, weight)
    if resolve_backend("rms_norm", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.norm_rope import triton as triton_backend

        return triton_backend.rms_norm(x, weight, eps, pdl=pdl)
    return reference.rms_norm(x, weight, eps)


def rope_cos_sin(positions: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """positions [T] int64, freqs [P] fp32 -> cos, sin [T, P] fp32."""
    if positions.dim() != 1 or freqs.dim() != 1:
        raise ValueError(
            f"rope_cos_sin: expected positions [T], freqs [P]; found {tuple(positions.shape)}, {tuple(freqs.shape)}"
        )
    return reference.rope_cos_sin(positions, freqs)


def apply_rope(
    x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False, backend: str = "auto", pdl: bool = False
) -> Tensor:
    """x [T, ..., D] (rope on the last 2P channels, interleaved pairs), cos/sin [T, P] fp32 -> x's shape and dtype.
    backend: "auto" | "torch" | "triton" (the Triton kernel takes bf16/fp16/fp32 x; within 1 ULP of the reference).
    pdl: as `rms_norm`."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[0]:
        raise ValueError(
            f"apply_rope: cos/sin must be [T={x.shape[0]}, P]; found {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"apply_rope: {2 * cos.shape[1]} rope dims exceed the last dim {x.shape[-1]}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"apply_rope: x dtype {x.dtype} is not a float type")
    ok = x.dtype in _TRITON_DTYPES and x.dim() >= 2
    why = f"x {x.dtype} {tuple(x.shape)}; needs bf16/fp16/fp32 and at least [T, D]"
    if resolve_backend("apply_rope", backend, x, cos, sin, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.norm_rope import triton as triton_backend

        return triton_backend.apply_rope(x, cos, sin, inverse=inverse, pdl=pdl)
    return reference.apply_rope(x, cos, sin, inverse=inverse)


def _check_rope_at(
    x: Tensor, positions: Tensor, freqs: Tensor, norm: tuple[Tensor | None, float] | None
) -> tuple[bool, str]:
    if positions.dim() != 1 or positions.shape[0] != x.shape[0] or freqs.dim() != 1:
        raise ValueError(f"apply_rope_at: positions {tuple(positions.shape)}, freqs {tuple(freqs.shape)}; expected "
                         f"[T={x.shape[0]}] and [P]")
    if 2 * freqs.shape[0] > x.shape[-1]:
        raise ValueError(f"apply_rope_at: {2 * freqs.shape[0]} rope dims exceed the last dim {x.shape[-1]}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"apply_rope_at: x dtype {x.dtype} is not a float type")
    if norm is not None and norm[0] is not None and norm[0].shape != (x.shape[-1],):
        raise ValueError(f"apply_rope_at: norm weight {tuple(norm[0].shape)}, expected ({x.shape[-1]},)")
    ok = (x.dtype in _TRITON_DTYPES and x.dim() >= 2 and not positions.is_floating_point()
          and (norm is None or x.shape[-1] <= _TRITON_MAX_D))
    why = (f"x {x.dtype} {tuple(x.shape)}, positions {positions.dtype}; needs bf16/fp16/fp32 x of [T, D] or more "
           f"(D <= {_TRITON_MAX_D} with a norm) and integer positions")
    return ok, why


def _rope_at_tensors(x: Tensor, positions: Tensor, freqs: Tensor, norm: tuple[Tensor | None, float] | None):
    return (x, positions, freqs) if norm is None or norm[0] is None else (x, positions, freqs, norm[0])


def rope_at_uses_kernel(
    x: Tensor, positions: Tensor, freqs: Tensor, *, norm: tuple[Tensor | None, float] | None = None,
    backend: str = "auto",
) -> bool:  # fmt: skip
    """Whether `apply_rope_at` with these arguments runs the Triton kernel (angles computed inside it); when not,
    a caller that rotates several tensors at the same positions may rather share one `rope_cos_sin`."""
    ok, why = _check_rope_at(x, positions, freqs, norm)
    tensors = _rope_at_tensors(x, positions, freqs, norm)
    return resolve_backend("apply_rope_at", backend, *tensors, triton_ok=ok, why_not=why) == "triton"


def apply_rope_at(
    x: Tensor, positions: Tensor, freqs: Tensor, *, inverse: bool = False,
    norm: tuple[Tensor | None, float] | None = None, backend: str = "auto", pdl: bool = False,
) -> Tensor:  # fmt: skip
    """``apply_rope(x, *rope_cos_sin(positions, freqs), inverse=inverse)``: x [T, ..., D], positions [T] int,
    freqs [P] fp32. ``norm`` (weight [D] | None, eps): ``rms_norm(x, weight, eps)`` first (its output dtype
    rounding kept), in the same kernel. The Triton kernel computes the fp32 angles and their cos / sin itself
    (cos/sin within 1 ULP of torch.polar's; the rotation as `apply_rope`, the norm as `rms_norm`).
    backend: "auto" | "torch" | "triton". pdl: as `rms_norm`."""
    ok, why = _check_rope_at(x, positions, freqs, norm)
    tensors = _rope_at_tensors(x, positions, freqs, norm)
    if resolve_backend("apply_rope_at", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.norm_rope import triton as triton_backend

        return triton_backend.apply_rope_at(x, positions, freqs, inverse=inverse, norm=norm, pdl=pdl)
    if norm is not None:
        x = reference.rms_norm(x, norm[0], norm[1])
    cos, sin = reference.rope_cos_sin(positions, freqs)
    return reference.apply_rope(x, cos, sin, inverse=inverse)
