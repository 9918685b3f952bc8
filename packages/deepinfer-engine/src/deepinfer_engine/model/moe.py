"""MoE of every layer (architecture.md §A.8, §C.5): Gate (sqrtsoftplus, bias for selection, V4 hash routing by
`tid2eid`, V4.1 `bias_vl` at image positions, docs/fidelity.md §2), routed experts (clamped SwiGLU) and the
shared expert."""

from __future__ import annotations

import torch
from deepinfer_kernels.moe import moe_experts, swiglu_expert
from deepinfer_kernels.routing import gate_scores, select_experts
from torch import Tensor, nn

from deepinfer_engine.model.attention import Linear
from deepinfer_engine.model.image_ids import image_positions

__all__ = ["Expert", "Gate", "MoE"]


class Gate(nn.Module):
    """`ffn.gate.{weight [E, d], bias [E] f32 | tid2eid [V, k] i64, bias_vl [E] f32}`."""

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__()
        E, k = plan.n_routed_experts, plan.num_experts_per_tok
        self.topk = k
        self.score_func = args.scoring_func
        self.route_scale = args.routed_scaling_factor
        self.renormalize = args.norm_topk_prob
        self.is_hash = plan.is_hash_layer
        self.vocab_size = args.vocab_size
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size, dtype=dtype))
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, k, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        # DSpark stages never route with bias_vl: a release may carry mtp.{k}.ffn.gate.bias_vl, which the loader
        # accepts and drops (an optional inventory tensor, docs/fidelity.md §1)
        self.bias_vl = (
            nn.Parameter(torch.zeros(E, dtype=torch.float32)) if (args.has_gate_bias_vl and not plan.is_draft) else None
        )

    def forward(self, x: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, d], input_ids [T] -> (weights [T, k] f32, ids [T, k] i64)."""
        scores = gate_scores(x, self.weight, self.score_func)
        if self.is_hash:
            return select_experts(
                scores, self.topk, hash_ids=self.tid2eid[input_ids], route_scale=self.route_scale,
                renormalize=self.renormalize,
            )  # fmt: skip
        bias: Tensor = self.bias
        if self.bias_vl is not None:
            is_img = image_positions(input_ids, self.vocab_size)  # ids past the vocabulary, never text ids
            bias = torch.where(is_img[:, None], self.bias_vl[None, :], self.bias[None, :])
        return select_experts(
            scores, self.topk, bias=bias, route_scale=self.route_scale, renormalize=self.renormalize
        )


class Expert(nn.Module):
    """`w1` (gate) [I, d], `w3` (up) [I, d], `w2` (down) [d, I]; clamped SwiGLU (§2)."""

    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, dtype)
        self.w2 = Linear(inter, dim, dtype)
        self.w3 = Linear(dim, inter, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_expert(x, self.w1.weight, self.w3.weight, self.w2.weight, self.limit)


class MoE(nn.Module):
    """`ffn.*`: gate + routed experts + shared expert. y = Σ_k w_k Expert_{id_k}(x) + Shared(x)."""

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__()
        d, inter = args.hidden_size, args.moe_intermediate_size
        self.limit = args.swiglu_limit
        self.gate = Gate(args, plan, dtype)
        self.experts = nn.ModuleList(Expert(d, inter, self.limit, dtype) for _ in range(plan.n_routed_experts))
        self.shared_experts = Expert(d, inter * args.n_shared_experts, self.limit, dtype)

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        """x [T, d] (ffn_norm output), input_ids [T] raw ids -> [T, d] in x's dtype."""
        weights, ids = self.gate(x, input_ids)
        experts = [(e.w1.weight, e.w3.weight, e.w2.weight) for e in self.experts]
        y = moe_experts(x, weights, ids, experts, self.limit)
        return (y + self.shared_experts(x).float()).to(x.dtype)
