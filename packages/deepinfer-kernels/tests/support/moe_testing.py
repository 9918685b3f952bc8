"""Test support for the routed-expert kernels: random FP4 expert stacks, random routing, the relative error the
MoE tests state their tolerances in."""

from __future__ import annotations

import torch
from deepinfer_kernels.moe import StackedExperts
from deepinfer_kernels.quant import quant_fp4

__all__ = ["quantized_fp4_experts", "random_fp4_stack", "rel", "routing"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def routing(t: int, k: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k] fp32 in [0, 1), ids [t, k] int64: k distinct experts of e per token)."""
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


def quantized_fp4_experts(e: int, inter: int, d: int, g: torch.Generator) -> StackedExperts:
    """e experts of Gaussian weights (scaled by 1/sqrt(fan-in)) quantized to FP4 with their UE8M0 scales (CPU)."""
    packed = {k: [] for k in ("w1", "w3", "w2", "s1", "s3", "s2")}
    for _ in range(e):
        for w, s, shape in (("w1", "s1", (inter, d)), ("w3", "s3", (inter, d)), ("w2", "s2", (d, inter))):
            q, sc = quant_fp4(torch.randn(*shape, generator=g) / shape[1] ** 0.5)
            packed[w].append(q)
            packed[s].append(sc)
    return StackedExperts(*(torch.stack(packed[k]) for k in ("w1", "w3", "w2", "s1", "s3", "s2")), fmt="fp4")


def random_fp4_stack(e: int, inter: int, d: int, g: torch.Generator, device: str) -> StackedExperts:
    """e experts of random FP4 codes with scale codes 122..125 (weights of magnitude <= 0.375), on `device`: cheap
    at real widths."""

    def packed(o, i):
        return torch.randint(-128, 128, (e, o, i // 2), generator=g, dtype=torch.int8).to(device)

    def scale(o, i):
        codes = torch.randint(122, 126, (e, o, i // 32), generator=g, dtype=torch.uint8)
        return codes.view(torch.float8_e8m0fnu).to(device)

    return StackedExperts(packed(inter, d), packed(inter, d), packed(d, inter), scale(inter, d), scale(inter, d),
                          scale(d, inter), fmt="fp4")  # fmt: skip
