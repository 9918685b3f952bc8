"""mHC hyper-connection mixing (architecture.md §A.3 / §C.2): torch references; Triton for `hc_mix`."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.hyper_conn import reference
from deepinfer_kernels.hyper_conn.reference import hc_post, hc_pre, sinkhorn

__all__ = ["hc_head", "hc_mix", "hc_post", "hc_pre", "sinkhorn"]


def hc_mix(
    r: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    rms_eps: float,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """r [T, n, d]; fn [(2+n)*n, n*d] f32; base [(2+n)*n]; scale [3] -> pre [T,n], post [T,n], comb [T,n,n] f32.
    backend: "auto" | "torch" | "triton" (the Triton kernel needs n a power of two and a float r)."""
    if r.dim() != 3:
        raise ValueError(f"hc_mix: r must be [T, n, d], found {tuple(r.shape)}")
    n, d = r.shape[1], r.shape[2]
    if fn.shape != ((2 + n) * n, n * d) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(
            f"hc_mix: expected fn [{(2 + n) * n}, {n * d}], base [{(2 + n) * n}], scale [3]; found "
            f"{tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}"
        )
    if sinkhorn_iters < 1:
        raise ValueError(f"hc_mix: sinkhorn_iters must be >= 1, found {sinkhorn_iters}")
    ok = n >= 1 and (n & (n - 1)) == 0 and r.is_floating_point() and r.dtype != torch.float64
    why = f"n {n}, r {r.dtype}; needs n a power of two and r bf16/fp16/fp32"
    if resolve_backend("hc_mix", backend, r, fn, base, scale, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.hyper_conn import triton as triton_backend

        return triton_backend.hc_mix(
            r, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, rms_eps=rms_eps
        )
    return reference.hc_mix(r, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, rms_eps=rms_eps)


def hc_head(r: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, hc_eps: float, rms_eps: float) -> Tensor:
    """r [T, n, d]; fn [n, n*d]; base [n]; scale [1] -> [T, d] in r's dtype."""
    n, d = r.shape[1], r.shape[2]
    if fn.shape != (n, n * d) or base.shape != (n,) or scale.shape != (1,):
        raise ValueError(
            f"hc_head: expected fn [{n}, {n * d}], base [{n}], scale [1]; found {tuple(fn.shape)}, "
            f"{tuple(base.shape)}, {tuple(scale.shape)}"
        )
    return reference.hc_head(r, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps)
