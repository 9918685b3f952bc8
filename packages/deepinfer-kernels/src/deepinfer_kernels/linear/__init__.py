"""Linear layers over weights in their checkpoint formats: FP8 e4m3 block-scaled (dequantized in the kernel,
optional FP8 activation quantization) and the float32-output LM head. Torch references; Triton on CUDA.

Shapes: M rows (tokens), K input features, N output features.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels._launch import target_programs
from deepinfer_kernels.linear import reference

__all__ = ["fp8_linear", "fp8_linear_grouped", "linear_f32_out", "split_k_counters"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_block(op: str, weight: Tensor, scale: Tensor, block: tuple[int, int]) -> None:
    n, k = weight.shape
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{op}: scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} with block "
            f"{tuple(block)}; expected {want}"
        )


def split_k_counters(device: torch.device | str) -> Tensor:
    """Zeroed ``[P] int32`` split-K arrival counters for the Triton GEMM on `device` (P = programs that fill the
    GPU twice: no split launch of the default policy has more output tiles). Pass them as ``counters=`` to the ops
    here: every launch leaves them zero again, so the per-call fill of fresh counters is gone. Owned by the caller;
    launches that can run at the same time (two streams) must not share one buffer."""
    device = torch.device(device)
    return torch.zeros(target_programs(device), dtype=torch.int32, device=device)


def _check_counters(op: str, counters: Tensor | None, x: Tensor) -> None:
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1 or counters.device != x.device):
        raise ValueError(f"{op}: counters {counters.dtype} {tuple(counters.shape)} on {counters.device}; expected "
                         f"1-D int32 on {x.device} (split_k_counters)")


def _kernel_takes(scale: Tensor, block: tuple[int, int]) -> tuple[bool, str]:
    """(whether the Triton kernel takes these scales, why not). The kernel takes one dot per K scale group: a power
    of two of at least the 16-column dot minimum."""
    ok = scale.dtype in (torch.float8_e8m0fnu, torch.float32) and block[1] in (16, 32, 64, 128, 256)
    return ok, f"scale {scale.dtype}, K block {block[1]}; needs e8m0/f32 scales and a K block in 16..256 (power of two)"


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    *,
    act_quant: bool = False,
    backend: str = "auto",
    counters: Tensor | None = None,
    pdl: bool = False,
) -> Tensor:
    """``y = x Wᵀ`` with W FP8 e4m3 block-scaled, decoded inside the kernel (no dequantized copy).

    x ``[..., K]`` bf16 / fp16 / fp32; weight ``[N, K] float8_e4m3fn``; scale ``[ceil(N/b0), ceil(K/b1)]``
    ``float8_e8m0fnu`` (UE8M0) or float32; block ``(b0, b1)`` (V4.1 (32, 32), V4 (128, 128)) -> ``[..., N]`` in x's
    dtype. ``act_quant``: quantize x to e4m3 with one power-of-two scale per 1 x b1 channels first (the deployed
    numerics; `deepinfer_kernels.quant.act_quant_fp8`). backend: "auto" | "torch" | "triton". counters: the
    caller's `split_k_counters` (Triton split-K; the reference ignores them). ``pdl``: let the M = 1 "gemv" kernel
    and the activation pass before it launch as programmatic dependent launches on sm_90+ (their launch and the
    gemv's weight loads overlap the previous kernel's tail; docs/pdl.md); ignored by the reference and by the other
    kernels, same results either way.
    """
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_linear: weight must be [N, K] float8_e4m3fn, found {weight.dtype} {tuple(weight.shape)}"
        )
    if x.shape[-1] != weight.shape[1] or x.dtype not in _FLOATS:
        raise ValueError(
            f"fp8_linear: x {x.dtype} {tuple(x.shape)} does not match weight [N, K={weight.shape[1]}]"
        )
    _check_block("fp8_linear", weight, scale, block)
    _check_counters("fp8_linear", counters, x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ok, why = _kernel_takes(scale, block)
    if resolve_backend("fp8_linear", backend, x2, weight, scale, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.linear import triton as triton_backend

        y = triton_backend.fp8_linear(x2, weight, scale, tuple(block), act_quant=act_quant, counters=counters,
                                      pdl=pdl)
    else:
        y = reference.fp8_linear(x2, weight, scale, tuple(block), act_quant=act_quant)
    return y.reshape(*lead, weight.shape[0])


def fp8_linear_grouped(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    block: tuple[int, int],
    *,
    act_quant: bool = False,
    backend: str = "auto",
    counters: Tensor | None = None,
    pdl: bool = False,
) -> Tensor:
    """Block-diagonal `fp8_linear`: x ``[M, G, K]``, weight ``[G * R, K] float8_e4m3fn`` whose row group g multiplies
    x's group g, scale ``[G * R / b0, ceil(K / b1)]`` -> ``[M, G, R]`` in x's dtype (the grouped low-rank output
    projection). R must be a multiple of b0 (no scale block straddles two groups). On CUDA one launch covers every
    group; otherwise, or when the kernel's tiles do not divide R, one `fp8_linear` per group. pdl: as
    `fp8_linear`."""
    if x.dim() != 3 or weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear_grouped: x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}; "
                         "expected x [M, G, K] and weight [G * R, K] float8_e4m3fn")
    m, g, k = x.shape
    n = weight.shape[0]
    if n % g or (n // g) % block[0] or weight.shape[1] != k or x.dtype not in _FLOATS:
        raise ValueError(f"fp8_linear_grouped: x {x.dtype} {tuple(x.shape)}, weight {tuple(weight.shape)}, block "
                         f"{tuple(block)}; expected weight [G * R, K] with R a multiple of {block[0]}")
    _check_block("fp8_linear_grouped", weight, scale, block)
    _check_counters("fp8_linear_grouped", counters, x)
    rows = n // g
    ok, why = _kernel_takes(scale, block)
    if resolve_backend("fp8_linear_grouped", backend, x, weight, scale, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.linear import triton as triton_backend

        y = triton_backend.fp8_linear_grouped(x, weight, scale, tuple(block), act_quant=act_quant,
                                              counters=counters, pdl=pdl)
        if y is not None:
            return y.view(m, g, rows)
    b0 = block[0]
    outs = [
        fp8_linear(x[:, i], weight[i * rows : (i + 1) * rows], scale[i * rows // b0 : (i + 1) * rows // b0], block,
                   act_quant=act_quant, backend=backend, counters=counters, pdl=pdl)
        for i in range(g)
    ]  # fmt: skip
    return torch.stack(outs, dim=1)


def linear_f32_out(
    x: Tensor, weight: Tensor, *, backend: str = "auto", counters: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """``y = x Wᵀ`` as float32 without converting W: x ``[..., K]``, weight ``[N, K]`` (bf16 / fp16 / fp32) ->
    ``[..., N] float32``. On CUDA the kernel reads W in its dtype and accumulates in fp32 (the LM head's
    129,280 x d bf16 weight is never copied to fp32). A float32 weight is a plain fp32 matmul.

    out: a contiguous ``[..., N] float32`` tensor on x's device to write y into (returned). The Triton kernel
    writes it directly, so CUDA graphs of different row counts can share one logits buffer without a copy."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_f32_out: x {tuple(x.shape)}, weight {tuple(weight.shape)}; expected [..., K], [N, K]"
        )
    _check_counters("linear_f32_out", counters, x)
    lead = x.shape[:-1]
    n = weight.shape[0]
    if out is not None and (tuple(out.shape) != (*lead, n) or out.dtype != torch.float32
                            or out.device != x.device or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"linear_f32_out: out {out.dtype} {tuple(out.shape)} on {out.device} (contiguous: "
                         f"{out.is_contiguous()}); expected a contiguous float32 {(*lead, n)} on {x.device}")
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(-1, n)
    if weight.dtype == torch.float32:
        y = torch.nn.functional.linear(x2.float(), weight)
    else:
        ok = weight.dtype in _FLOATS and x.dtype in _FLOATS
        why = f"x {x.dtype}, weight {weight.dtype}"
        if resolve_backend("linear_f32_out", backend, x2, weight, triton_ok=ok, why_not=why) == "triton":
            from deepinfer_kernels.linear import triton as triton_backend

            y = triton_backend.linear_f32_out(x2, weight, counters=counters, out=out2)
        else:
            y = reference.linear_f32_out(x2, weight)
    if out2 is not None and y.data_ptr() != out2.data_ptr():  # the paths that do not write into it
        out2.copy_(y)
    return y.reshape(*lead, n) if out is None else out
