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


def column_probe(e: int, d: int, inter: int, device: str) -> tuple:
    """Inputs of a down-GEMM launch that read back single weight columns: t = 2 * inter tokens, token t routed to
    expert t % e with one-hot activations at column (t // e) % inter, so output row t is that column of its expert
    (exact in any accumulation order). Returns (tok [t] cpu, pairs, bexp (`align_pairs` with 16-row blocks),
    h [blocks * 16, inter] bf16, rows [t, d] fp32 empty, ones [t] routing weights) on device; the expected rows are
    `want[tok % e, :, (tok // e) % inter]` for the dense experts want [e, d, inter]."""
    from deepinfer_kernels.moe import triton as mt

    t = 2 * inter
    ids = (torch.arange(t) % e).view(t, 1).to(device)
    pairs, bexp = mt.align_pairs(ids, e, 16)
    h = torch.zeros((bexp.numel() * 16, inter), dtype=torch.bfloat16, device=device)
    valid = pairs < t
    h[valid.nonzero().squeeze(1), (pairs[valid] // e).long() % inter] = 1.0
    rows = torch.empty((t, d), dtype=torch.float32, device=device)
    return torch.arange(t), pairs, bexp, h, rows, torch.ones(t, device=device)
