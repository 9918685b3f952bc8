"""mHC hyper-connection mixing (docs/model.md §A.3 / docs/model.md §C.2): torch references; Triton hc_mix / hc_pre / hc_post."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.hyper_conn import reference
from deepinfer_kernels.hyper_conn.reference import sinkhorn

__all__ = ["hc_head", "hc_mix", "hc_post", "hc_post_pre", "hc_pre", "sinkhorn"]


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
    counters: Tensor | None = None,
    fused: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """r [T, n, d]; fn [(2+n)*n, n*d] f32; base [(2+n)*n]; scale [3] -> pre [T,n], post [T,n], comb [T,n,n] f32.
    backend: "auto" | "torch" | "triton" (the Triton kernel needs n a power of two and a float r). counters: zeroed
    1-D int32 on r's device owned by the caller (`deepinfer_kernels.linear.split_k_counters`), which the one-launch
    Triton kernel uses for its split arrivals and leaves zero (no zero fill per call); the reference ignores them.
    fused=False selects the Triton two-launch path (kept for comparison)."""
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
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1 or counters.device != r.device):
        raise ValueError(
            f"hc_mix: counters {counters.dtype} {tuple(counters.shape)} on {counters.device}; expected 1-D int32 "
            f"zeros on {r.device} (deepinfer_kernels.linear.split_k_counters)"
        )
    ok = n >= 1 and (n & (n - 1)) == 0 and r.is_floating_point() and r.dtype != torch.float64
    why = f"n {n}, r {r.dtype}; needs n a power of two and r bf16/fp16/fp32"
    if resolve_backend("hc_mix", backend, r, fn, base, scale, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.hyper_conn import triton as triton_backend

        return triton_backend.hc_mix(
            r, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, rms_eps=rms_eps, counters=counters,
            fused=fused,
        )
    return reference.hc_mix(r, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, rms_eps=rms_eps)


def _streams_ok(r: Tensor) -> bool:
    n = r.shape[1] if r.dim() == 3 else 0
    return n >= 1 and (n & (n - 1)) == 0 and r.dtype in (torch.bfloat16, torch.float16, torch.float32)


def hc_pre(r: Tensor, pre: Tensor, *, backend: str = "auto") -> Tensor:
    """x = sum_i pre_i R_i: r [T, n, d], pre [T, n] -> [T, d] in r's dtype (fp32 math)."""
    if r.dim() != 3 or pre.shape != r.shape[:2]:
        raise ValueError(f"hc_pre: expected r [T, n, d] and pre [T, n]; found {tuple(r.shape)}, {tuple(pre.shape)}")
    why = f"r {r.dtype} {tuple(r.shape)}; needs n a power of two and r bf16/fp16/fp32"
    if resolve_backend("hc_pre", backend, r, pre, triton_ok=_streams_ok(r), why_not=why) == "triton":
        from deepinfer_kernels.hyper_conn import triton as triton_backend

        return triton_backend.hc_pre(r, pre)
    return reference.hc_pre(r, pre)


def hc_post(y: Tensor, r: Tensor, post: Tensor, comb: Tensor, *, backend: str = "auto") -> Tensor:
    """R'_j = post_j * y + sum_i comb[i, j] R_i: y [T, d], r [T, n, d], post [T, n], comb [T, n, n] ->
    [T, n, d] in r's dtype (fp32 math)."""
    if r.dim() != 3 or y.shape != (r.shape[0], r.shape[2]) or post.shape != r.shape[:2]:
        raise ValueError(
            f"hc_post: expected y [T, d], r [T, n, d], post [T, n]; found {tuple(y.shape)}, {tuple(r.shape)}, "
            f"{tuple(post.shape)}"
        )
    if comb.shape != (r.shape[0], r.shape[1], r.shape[1]):
        raise ValueError(f"hc_post: comb shape {tuple(comb.shape)}, expected {(r.shape[0], r.shape[1], r.shape[1])}")
    ok = _streams_ok(r) and y.is_floating_point()
    why = f"r {r.dtype} {tuple(r.shape)}, y {y.dtype}; needs n a power of two and bf16/fp16/fp32"
    if resolve_backend("hc_post", backend, y, r, post, comb, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.hyper_conn import triton as triton_backend

        return triton_backend.hc_post(y, r, post, comb)
    return reference.hc_post(y, r, post, comb)


def hc_post_pre(
    y: Tensor, r: Tensor, post: Tensor, comb: Tensor, pre: Tensor, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """(R', x) = (hc_post(y, r, post, comb), hc_pre(R', pre)): the sub-layer's output streams and the next
    collapse with an already known pre [T, n] (V4.1 delayed mHC), one pass over the streams on Triton.
    Shapes as hc_post / hc_pre; both results in r's dtype."""
    if pre.shape != r.shape[:2]:
        raise ValueError(f"hc_post_pre: pre shape {tuple(pre.shape)}, expected {tuple(r.shape[:2])}")
    if r.dim() != 3 or y.shape != (r.shape[0], r.shape[2]) or post.shape != r.shape[:2] or (
        comb.shape != (r.shape[0], r.shape[1], r.shape[1])
    ):
        raise ValueError(
            f"hc_post_pre: expected y [T, d], r [T, n, d], post [T, n], comb [T, n, n]; found {tuple(y.shape)}, "
            f"{tuple(r.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}"
        )
    ok = _streams_ok(r) and y.is_floating_point()
    why = f"r {r.dtype} {tuple(r.shape)}, y {y.dtype}; needs n a power of two and bf16/fp16/fp32"
    if resolve_backend("hc_post_pre", backend, y, r, post, comb, pre, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.hyper_conn import triton as triton_backend

        return triton_backend.hc_post_pre(y, r, post, comb, pre)
    out = reference.hc_post(y, r, post, comb)
    return out, reference.hc_pre(out, pre)


def hc_head(r: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, hc_eps: float, rms_eps: float) -> Tensor:
    """r [T, n, d]; fn [n, n*d]; base [n]; scale [1] -> [T, d] in r's dtype."""
    n, d = r.shape[1], r.shape[2]
    if fn.shape != (n, n * d) or base.shape != (n,) or scale.shape != (1,):
        raise ValueError(
            f"hc_head: expected fn [{n}, {n * d}], base [{n}], scale [1]; found {tuple(fn.shape)}, "
            f"{tuple(base.shape)}, {tuple(scale.shape)}"
        )
    return reference.hc_head(r, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps)
