"""Two FP8 Linears that read the same input, computed by one GEMM launch (`linear_pair`).

At decode sizes every FP8 GEMM launch has a fixed cost even for a small weight, and two pairs of each layer read
one input: ``attn.wq_a`` + ``attn.wkv`` (the normed x) and the shared expert's ``w1`` + ``w3`` (x, into SwiGLU).

How, without changing a parameter name: after the weights are loaded, `fuse_same_input(a, b)` concatenates the
two loaded FP8 weights ``[N1, K]`` + ``[N2, K]`` into one buffer ``[N1 + N2, K]`` (and their block scales into
``[(N1 + N2) / b0, K / b1]``) and re-points ``a.weight`` / ``b.weight`` (``a.scale`` / ``b.scale``) to adjacent row
views of it; the old storages are freed, so memory stays the same. The parameters keep their names, shapes and
dtypes: `state_dict`, the weight loaders (they copy into the views, i.e. into the joint buffer), the inventory
and the checkpoint writer see no difference. `linear_pair(x, a, b)` then multiplies x by the joint buffer once
(`deepinfer_kernels.linear.fp8_linear`) and returns the two column ranges of the output as views ``[..., N1]`` /
``[..., N2]`` (rows strided by N1 + N2; the consumers read them in place).

Fusing happens once at load (`fuse_model_pairs`, called by the loader), before any CUDA graph is captured:
the graph records the joint buffer's address, which no later call changes. Whether a pair is fused is read off
the parameters at each call (adjacent views of one storage, same format), so anything that replaces a parameter
later (a format switch, ``module.to``) silently returns to two launches instead of reading stale memory.

Dense pairs (`fuse_dense_pair`, listed by a module's ``same_input_dense()``: the V4.1 ratio-2 compressor's ``wkv`` +
``wgate``) share one buffer the same way; the module multiplies by `dense_joint_weight` once.

Not fused by `fuse_same_input` (two launches, same results): dense (unquantized) Linears, pairs whose formats differ, and pairs where
N1 is not a multiple of the scale block b0 (a scale row would straddle the two weights; tiny test configs only:
the real configs have N1 = 1280 / 2304 with b0 = 32 or 128).

Numerics: every output column is the same dot product over K as in a separate call (the weight rows and scales
are the same bytes; FP8 activation quantization is per input row, the same for both). The torch reference and
the Triton interpreter give bit-identical results; on CUDA the Triton launch config (tiles, split-K count) is
chosen from N1 + N2 instead of N1 or N2, so the fp32 summation order over K may differ (results equal up to
fp32 rounding before the cast to the output dtype).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from deepinfer_kernels.linear import fp8_linear
from torch import Tensor, nn

from deepinfer_engine.model.linear import Linear, split_counters

__all__ = ["dense_joint_weight", "fuse_dense_pair", "fuse_model_pairs", "fuse_same_input", "joint_weight", "linear_pair"]


def _compatible(a: Linear, b: Linear) -> bool:
    """Whether one GEMM over [a; b] computes both: same FP8 format, input, numerics and backend, and a's rows end on
    a scale block boundary."""
    return (
        a.scale is not None and b.scale is not None and a.in_features == b.in_features and a.block == b.block
        and a.out_features % a.block[0] == 0 and a.weight.dtype == b.weight.dtype
        and a.scale.dtype == b.scale.dtype and a.dtype == b.dtype
        and a.quantize_activations == b.quantize_activations and a.kernel_backend == b.kernel_backend
    )  # fmt: skip


def _adjacent(first: Tensor, second: Tensor) -> Tensor | None:
    """The [rows1 + rows2, ...] view that `first` and `second` are consecutive row ranges of, else None."""
    if (
        first.is_meta or not first.is_contiguous() or not second.is_contiguous() or first.device != second.device
        or first.shape[1:] != second.shape[1:]
        or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
        or second.storage_offset() != first.storage_offset() + first.numel()
    ):  # fmt: skip
        return None
    shape = (first.shape[0] + second.shape[0], *first.shape[1:])
    return first.detach().as_strided(shape, first.stride(), first.storage_offset())


def joint_weight(a: Linear, b: Linear) -> tuple[Tensor, Tensor] | None:
    """(weight [N1 + N2, K] e4m3, scale [(N1 + N2) / b0, K / b1]) when `fuse_same_input(a, b)` holds, else None."""
    if not _compatible(a, b):
        return None
    w = _adjacent(a.weight, b.weight)
    s = _adjacent(a.scale, b.scale) if w is not None else None
    return None if s is None else (w, s)


def _cat_rows(first: Tensor, second: Tensor) -> Tensor:
    # one-byte formats (e4m3 codes, UE8M0 scales) are joined as raw bytes: cat need not support the float8 dtypes
    if first.element_size() == 1:
        return torch.cat([first.view(torch.uint8), second.view(torch.uint8)]).view(first.dtype)
    return torch.cat([first, second])


def _view_param(old: nn.Parameter, view: Tensor) -> nn.Parameter:
    p = nn.Parameter(view, requires_grad=False)
    for k, v in vars(old).items():  # e.g. a weight_loader attribute
        setattr(p, k, v)
    return p


@torch.no_grad()
def fuse_same_input(a: Linear, b: Linear) -> bool:
    """Put the loaded FP8 weights (and scales) of `a` and `b` into one buffer, a's rows first, with both Linears'
    parameters re-pointed to row views of it. Returns whether the pair is fused now (False: left as it was)."""
    if not _compatible(a, b) or a.weight.is_meta or a.weight.device != b.weight.device:
        return False
    if joint_weight(a, b) is not None:
        return True
    n1 = a.out_features
    s1 = a.scale.shape[0]
    w = _cat_rows(a.weight, b.weight)
    s = _cat_rows(a.scale, b.scale)
    a.weight, b.weight = _view_param(a.weight, w[:n1]), _view_param(b.weight, w[n1:])
    a.scale, b.scale = _view_param(a.scale, s[:s1]), _view_param(b.scale, s[s1:])
    return True


def linear_pair(x: Tensor, a: Linear, b: Linear) -> tuple[Tensor, Tensor]:
    """(a(x), b(x)): x ``[..., K]`` -> ``[..., N1]``, ``[..., N2]`` in the Linears' compute dtype. One GEMM launch
    when the pair is fused (the outputs are column views of one ``[..., N1 + N2]`` tensor), else two calls."""
    joint = joint_weight(a, b)
    if joint is None:
        return a(x), b(x)
    w, s = joint
    x = x.to(a.dtype)
    y = fp8_linear(x, w, s, a.block, act_quant=a.quantize_activations, backend=a.kernel_backend,
                   counters=split_counters(a, x.device), pdl=a.pdl)
    n1 = a.out_features
    return y[..., :n1], y[..., n1:]


def dense_joint_weight(a: nn.Module, b: nn.Module) -> Tensor | None:
    """The [N1 + N2, K] weight that the dense weights of `a` and `b` are adjacent row views of (`fuse_dense_pair`),
    else None."""
    wa, wb = a.weight, b.weight
    return _adjacent(wa, wb) if wa.dtype == wb.dtype else None


@torch.no_grad()
def fuse_dense_pair(a: nn.Module, b: nn.Module) -> bool:
    """`fuse_same_input` for two dense (unquantized) weights [N1, K] / [N2, K] of one dtype and device: one buffer,
    a's rows first, both `weight` parameters re-pointed to row views of it. Returns whether they are fused now."""
    wa, wb = a.weight, b.weight
    if wa.is_meta or wa.dtype != wb.dtype or wa.device != wb.device or wa.shape[1:] != wb.shape[1:]:
        return False
    if dense_joint_weight(a, b) is not None:
        return True
    w = torch.cat([wa.detach(), wb.detach()])
    n1 = wa.shape[0]
    a.weight, b.weight = _view_param(wa, w[:n1]), _view_param(wb, w[n1:])
    return True


def _pairs(model: nn.Module) -> Iterator[tuple[Linear, Linear]]:
    for m in model.modules():
        pairs = getattr(m, "same_input_linears", None)
        if pairs is not None:
            yield from pairs()


def fuse_model_pairs(model: nn.Module) -> int:
    """`fuse_same_input` on every pair a module lists in its ``same_input_linears()`` and `fuse_dense_pair` on every
    pair it lists in ``same_input_dense()``; the number fused. Call after the weights are loaded and before a CUDA
    graph is captured."""
    dense = [p for m in model.modules() if hasattr(m, "same_input_dense") for p in m.same_input_dense()]
    return sum(fuse_same_input(a, b) for a, b in _pairs(model)) + sum(fuse_dense_pair(a, b) for a, b in dense)
