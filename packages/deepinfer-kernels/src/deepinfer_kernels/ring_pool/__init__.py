"""The pool of a ring-buffer cache read for one step: history rows gathered from the ring, the step's fresh rows
after them, and the fresh rows stored into the ring. Torch reference (four launches: gather, cat, gather,
index_copy); Triton kernel (one launch) when the caller guarantees the rows written are not rows read."""

from __future__ import annotations

from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.ring_pool import reference

__all__ = ["ring_pool"]


def ring_pool(
    flat: Tensor,
    hist_src: Tensor,
    fresh: Tensor,
    write_dst: Tensor | None = None,
    write_src: Tensor | None = None,
    *,
    disjoint: bool = False,
    backend: str = "auto",
) -> Tensor:
    """flat [N, *C] (a ring viewed as rows; any dtype), hist_src [H] int64 rows of flat, fresh [T, *C] ->
    pool [H + T, *C] in fresh's dtype = cat(flat[hist_src], fresh); then, when write_dst [m] / write_src [m]
    int64 are given, flat[write_dst] = fresh[write_src] (cast to flat's dtype).

    disjoint: the caller guarantees that no row of write_dst is in hist_src (the ring holds each sequence's read
    history and its new rows at once); only then can one launch read and write concurrently, so the Triton path
    needs it. backend: "auto" | "torch" | "triton" (also needs *C of at most 16,384 elements)."""
    if fresh.shape[1:] != flat.shape[1:] or hist_src.dim() != 1:
        raise ValueError(
            f"ring_pool: flat {tuple(flat.shape)} and fresh {tuple(fresh.shape)} must share their row shape; "
            f"hist_src {tuple(hist_src.shape)} must be 1-d"
        )
    if (write_dst is None) != (write_src is None) or (write_dst is not None and write_dst.shape != write_src.shape):
        raise ValueError("ring_pool: write_dst and write_src go together, with one shape")
    width = fresh[0].numel() if fresh.shape[0] else flat[0].numel() if flat.shape[0] else 0
    ok = disjoint and 0 < width <= 16384 and flat.is_contiguous()
    why = f"disjoint={disjoint}, row width {width}, flat contiguous {flat.is_contiguous()}"
    tensors = [t for t in (flat, hist_src, fresh, write_dst, write_src) if t is not None]
    if resolve_backend("ring_pool", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.ring_pool import triton as triton_backend

        return triton_backend.ring_pool(flat, hist_src, fresh, write_dst, write_src)
    return reference.ring_pool(flat, hist_src, fresh, write_dst, write_src)
