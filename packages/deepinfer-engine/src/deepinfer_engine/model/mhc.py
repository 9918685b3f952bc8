"""mHC parameter groups and their use (docs/model.md §A.3, docs/model.md §C.2), on top of `deepinfer_kernels.hyper_conn`.

The checkpoint stores the mixes as flat attributes of the block (`layers.{l}.hc_attn_fn`, `..._base`, `..._scale`)
and the V4 head as `hc_head_{fn,base,scale}`; these helpers register and apply them under exactly those names.
"""

from __future__ import annotations

import torch
from deepinfer_kernels.hyper_conn import hc_head, hc_mix, hc_post, hc_post_pre, hc_pre
from torch import Tensor, nn

from deepinfer_engine.model.linear import split_counters

__all__ = [
    "add_hc_head_params", "add_hc_mix_params", "apply_hc_head", "apply_hc_mix", "hc_post", "hc_post_pre", "hc_pre",
]


def add_hc_mix_params(module: nn.Module, prefix: str, args: object) -> None:
    """Register `{prefix}_fn [(2+n)n, n*d]`, `{prefix}_base [(2+n)n]`, `{prefix}_scale [3]` (fp32) on module."""
    n, d = args.hc_mult, args.hidden_size
    m = (2 + n) * n
    module.register_parameter(f"{prefix}_fn", nn.Parameter(torch.zeros(m, n * d, dtype=torch.float32)))
    module.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(m, dtype=torch.float32)))
    module.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))


def apply_hc_mix(module: nn.Module, prefix: str, r: Tensor, args: object) -> tuple[Tensor, Tensor, Tensor]:
    """pre [T, n], post [T, n], comb [T, n, n] fp32 of the sub-layer `prefix` for streams r [T, n, d]. The Triton
    kernel's split arrivals use `module`'s own counters (left zero by every launch: no fill per call)."""
    return hc_mix(
        r,
        getattr(module, f"{prefix}_fn"),
        getattr(module, f"{prefix}_base"),
        getattr(module, f"{prefix}_scale"),
        sinkhorn_iters=args.hc_sinkhorn_iters,
        hc_eps=args.hc_eps,
        rms_eps=args.rms_norm_eps,
        backend=getattr(module, "kernel_backend", "auto"),
        counters=split_counters(module, r.device),
    )


def add_hc_head_params(module: nn.Module, args: object) -> None:
    """Register the V4 learned head `hc_head_fn [n, n*d]`, `hc_head_base [n]`, `hc_head_scale [1]` (fp32)."""
    n, d = args.hc_mult, args.hidden_size
    module.hc_head_fn = nn.Parameter(torch.zeros(n, n * d, dtype=torch.float32))
    module.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
    module.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))


def apply_hc_head(module: nn.Module, r: Tensor, args: object) -> Tensor:
    """[T, d] collapse of r [T, n, d] with the module's learned hc_head."""
    return hc_head(
        r, module.hc_head_fn, module.hc_head_base, module.hc_head_scale, hc_eps=args.hc_eps, rms_eps=args.rms_norm_eps
    )
