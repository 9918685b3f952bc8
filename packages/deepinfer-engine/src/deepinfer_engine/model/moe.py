"""MoE of every layer (docs/model.md §A.8, docs/model.md §C.5): Gate (sqrtsoftplus, bias for selection, V4 hash routing by
`tid2eid`, V4.1 `bias_vl` at image positions, docs/fidelity.md §2), routed experts stacked `[E, ...]` (clamped
SwiGLU) and the shared expert."""

from __future__ import annotations

import torch
from deepinfer_kernels.activation import swiglu
from deepinfer_kernels.linear import linear_f32_out
from deepinfer_kernels.moe import StackedExperts, moe_experts
from deepinfer_kernels.moe.fp4_layout import CHUNK, chunk_codes_, chunk_scales_
from deepinfer_kernels.routing import gate_scores, route_logits, select_experts
from deepinfer_parallel.ep import LocalDispatch, MoEDispatch
from torch import Tensor, nn

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.image_ids import image_positions
from deepinfer_engine.model.linear import (
    Linear,
    new_param,
    split_counters,
    stacked_weight_loader,
    stored_torch_dtype,
)
from deepinfer_engine.model.linear_pair import linear_pair
from deepinfer_engine.model.overlap import run_beside

__all__ = ["EXPERT_LAYOUTS", "Expert", "ExpertWeight", "Experts", "Gate", "MoE", "chunk_model_experts"]

# Memory layouts of FP4 routed experts: the checkpoint's bytes, or the chunked layout the GPU kernels read
# coalesced (deepinfer_kernels.moe.fp4_layout, docs/moe_fp4_kernel.md), applied once after loading.
EXPERT_LAYOUTS = ("checkpoint", "chunked")


def _chunked_codes_loader(param: Tensor, loaded: Tensor, expert_id: int | None = None) -> None:
    """`stacked_weight_loader` for codes held in the chunked layout: the checkpoint slot is repacked in place."""
    stacked_weight_loader(param, loaded, expert_id)
    chunk_codes_(param.data[expert_id])


def _chunked_scales_loader(param: Tensor, loaded: Tensor, expert_id: int | None = None) -> None:
    """`stacked_weight_loader` for scales held in the chunked layout."""
    stacked_weight_loader(param, loaded, expert_id)
    chunk_scales_(param.data[expert_id])


class Gate(nn.Module):
    """`ffn.gate.{weight [E, d], bias [E] f32 | tid2eid [V, k] i64, bias_vl [E] f32}`."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

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

    def forward(self, x: Tensor, input_ids: Tensor, image_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [T, d], input_ids [T] -> (weights [T, k] f32, ids [T, k] i64). image_mask: [T] bool image positions
        of input_ids when the caller has them (ForwardContext.image_mask), else computed here."""
        if self.is_hash:
            scores = gate_scores(x, self.weight, self.score_func)
            return select_experts(
                scores, self.topk, hash_ids=self.tid2eid[input_ids], route_scale=self.route_scale,
                renormalize=self.renormalize, backend=self.kernel_backend,
            )  # fmt: skip
        is_img = None
        if self.bias_vl is not None:
            # ids past the vocabulary, never text ids; the router picks bias_vl at those rows itself
            is_img = image_positions(input_ids, self.vocab_size) if image_mask is None else image_mask
        # fp32 logits without widening the [E, d] weight to fp32 each step (the reference's x.float() @ W.float()ᵀ
        # up to the summation order); the score function, biased top-k and renormalisation in one routing call
        logits = linear_f32_out(x, self.weight, backend=self.kernel_backend, counters=split_counters(self, x.device))
        return route_logits(
            logits, self.topk, score_func=self.score_func, bias=self.bias, route_scale=self.route_scale,
            renormalize=self.renormalize, bias_alt=None if is_img is None else self.bias_vl, alt_rows=is_img,
            backend=self.kernel_backend,
        )  # fmt: skip


class Expert(nn.Module):
    """`w1` (gate) [I, d], `w3` (up) [I, d], `w2` (down) [d, I]; clamped SwiGLU (§2). The shared expert: its
    Linears hold FP8 weights once the model uses the checkpoint formats."""

    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, dtype)
        self.w2 = Linear(inter, dim, dtype)
        self.w3 = Linear(dim, inter, dtype)

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

    def same_input_linears(self) -> tuple[tuple[Linear, Linear], ...]:
        """The Linears that read the same input: w1 and w3 (one GEMM once fused, linear_pair.py)."""
        return ((self.w1, self.w3),)

    def forward(self, x: Tensor) -> Tensor:
        # the arithmetic of deepinfer_kernels.moe.swiglu_expert: gate / up in fp32, h in x's dtype
        g, u = linear_pair(x, self.w1, self.w3)  # one GEMM launch when the pair is fused
        h = swiglu(g, u, self.limit, x.dtype, backend=self.kernel_backend)
        return self.w2(h)


class ExpertWeight(nn.Module):
    """One of `experts.{w1,w2,w3}` stacked over the layer's experts: `weight [E, out, in]` dense, or as stored
    (FP4 `[E, out, in/2] int8` + `scale [E, out, in/32]` e8m0; FP8 `[E, out, in]` + block `scale`). Checkpoint
    tensor `experts.{e}.{w}.weight` fills slot e (stacked_weight_loader)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = (num_experts, out_features, in_features)
        self.fmt = "dense"
        self.block: tuple[int, int] = (1, 32)
        self.weight = new_param(self.shape, dtype, torch.empty(0), stacked_weight_loader)
        self.scale: nn.Parameter | None = None

    def use_checkpoint_format(self, stored: str, scale_dtype: str, block: tuple[int, int]) -> None:
        e, o, i = self.shape
        b0, b1 = block
        if stored == "fp4_e2m1x2":
            self.fmt, shape = "fp4", (e, o, i // 2)
        elif stored == "f8_e4m3":
            self.fmt, shape = "fp8", (e, o, i)
        else:
            raise ModelConfigError(f"routed experts: stored format {stored!r}, expected fp4_e2m1x2 or f8_e4m3")
        self.weight = new_param(shape, stored_torch_dtype(stored), self.weight, stacked_weight_loader)
        scale_shape = (e, -(-o // b0), -(-i // b1))
        self.scale = new_param(scale_shape, stored_torch_dtype(scale_dtype), self.weight, stacked_weight_loader)
        self.block = (b0, b1)

    def _loaders(self) -> tuple[object, object]:
        if self.fmt == "fp4_chunked":
            return _chunked_codes_loader, _chunked_scales_loader
        return stacked_weight_loader, stacked_weight_loader

    def resize_slots(self, num_slots: int) -> None:
        """Hold `num_slots` stacked experts instead of all (expert parallelism: this rank's slots only), in the
        current format; call before the weights are loaded (the storage is replaced, uninitialized)."""
        self.shape = (num_slots, *self.shape[1:])
        wl, sl = self._loaders()
        self.weight = new_param((num_slots, *self.weight.shape[1:]), self.weight.dtype, self.weight, wl)
        if self.scale is not None:
            self.scale = new_param((num_slots, *self.scale.shape[1:]), self.scale.dtype, self.weight, sl)

    def can_chunk(self) -> bool:
        """FP4 in the checkpoint layout with whole 128-column chunks (the chunked layout's condition)."""
        return self.fmt == "fp4" and self.shape[2] % CHUNK == 0 and self.block == (1, 32)

    def use_chunked_layout(self) -> None:
        """Repack the loaded FP4 codes and scales in place into the chunked layout (one expert matrix of temporary
        memory at a time); later checkpoint loads into a slot are repacked by the weight loaders too."""
        if not self.can_chunk():
            raise ModelConfigError(
                f"routed experts: chunked layout of fmt {self.fmt!r}, in_features {self.shape[2]}; expected fp4 "
                f"with in_features a multiple of {CHUNK}"
            )
        chunk_codes_(self.weight.data)
        chunk_scales_(self.scale.data)
        self.fmt = "fp4_chunked"
        self.weight.weight_loader, self.scale.weight_loader = self._loaders()  # type: ignore[union-attr]


class Experts(nn.Module):
    """`ffn.experts.*`: the routed experts of one layer, stacked; no per-expert module, no loop in the forward
    (the grouped kernel on CUDA; the torch reference decodes the experts a step uses)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

    def __init__(self, num_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = ExpertWeight(num_experts, inter, dim, dtype)
        self.w2 = ExpertWeight(num_experts, dim, inter, dtype)
        self.w3 = ExpertWeight(num_experts, inter, dim, dtype)

    def __len__(self) -> int:
        return self.w1.shape[0]

    @property
    def held_experts(self) -> tuple[int, ...] | None:
        """Checkpoint (logical) expert of each stacked slot when this rank holds a subset of the layer's experts
        (`hold_experts`, expert parallelism); None when slot e holds expert e for every expert."""
        return getattr(self, "_held", None)

    def hold_experts(self, experts: list[int] | tuple[int, ...], num_experts: int) -> None:
        """Keep only these of the layer's `num_experts` checkpoint experts, slot j = experts[j] (an expert may
        fill several slots: EPLB replicas); call before loading, the loader fills each slot from its expert's
        checkpoint tensors. Slots hold whatever later expert moves put there: update with `set_held`."""
        self.set_held(experts, num_experts)
        for w in (self.w1, self.w2, self.w3):
            w.resize_slots(len(self._held))

    def set_held(self, experts: list[int] | tuple[int, ...], num_experts: int) -> None:
        experts = tuple(int(e) for e in experts)
        if not experts or any(not 0 <= e < num_experts for e in experts):
            raise ModelConfigError(f"hold_experts: expected expert ids in [0, {num_experts}), found {list(experts)}")
        self._held = experts

    def use_chunked_layout(self) -> bool:
        """Repack w1, w3 and w2 into the chunked FP4 layout when all three can be (else change nothing); returns
        whether they were. Whole-slot copies (expert moves) stay valid: every slot holds the same layout."""
        ws = (self.w1, self.w2, self.w3)
        if not all(w.can_chunk() for w in ws):
            return False
        for w in ws:
            w.use_chunked_layout()
        return True

    def tensors(self) -> list[Tensor]:
        """Every per-slot tensor (weights and scales), each `[slots, ...]`: what an expert move rewrites (in the
        layout the slots hold, `ExpertWeight.fmt`)."""
        return [t for w in (self.w1, self.w2, self.w3) for t in (w.weight, w.scale) if t is not None]

    def stacked(self) -> StackedExperts:
        w1, w2, w3 = self.w1, self.w2, self.w3
        return StackedExperts(
            w1.weight, w3.weight, w2.weight, w1.scale, w3.scale, w2.scale, fmt=w1.fmt, block=w1.block
        )

    def forward(
        self, x: Tensor, weights: Tensor, ids: Tensor, shared: Tensor | None = None,
        shared_ready: torch.cuda.Event | None = None,
    ) -> Tensor:
        """x [T, d], routing weights [T, k] f32, ids [T, k] -> [T, d] f32 (Σ_k w_k Expert_{id_k}(x)); with
        shared [T, d] (the shared expert's output): (Σ + shared) in x's dtype, combined in one pass.
        shared_ready: the event that completes `shared` on a side stream (joined right before the combine)."""
        return moe_experts(x, weights, ids, self.stacked(), self.limit, shared=shared, shared_ready=shared_ready,
                           backend=self.kernel_backend)  # fmt: skip


class MoE(nn.Module):
    """`ffn.*`: gate + routed experts + shared expert. y = Σ_k w_k Expert_{id_k}(x) + Shared(x).

    The routed sum goes through `dispatch` (deepinfer-parallel `MoEDispatch`): `LocalDispatch` (default, every
    expert on this rank) or an expert-parallel strategy set by the caller that builds the EP group."""

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__()
        d, inter = args.hidden_size, args.moe_intermediate_size
        self.limit = args.swiglu_limit
        self.gate = Gate(args, plan, dtype)
        self.experts = Experts(plan.n_routed_experts, d, inter, self.limit, dtype)
        self.shared_experts = Expert(d, inter * args.n_shared_experts, self.limit, dtype)
        self.layer_id = plan.layer_id
        self.dispatch: MoEDispatch = LocalDispatch()

    def forward(
        self, x: Tensor, input_ids: Tensor, image_mask: Tensor | None = None, side: torch.cuda.Stream | None = None
    ) -> Tensor:
        """x [T, d] (ffn_norm output), input_ids [T] raw ids (image_mask: their image positions [T] bool, if
        known) -> [T, d] in x's dtype. side: a CUDA stream the shared expert runs on, beside the router and the
        routed experts (overlap.py; same kernels, same result)."""
        if side is not None and type(self.dispatch) is LocalDispatch:
            shared = run_beside(side, self.shared_experts, x)
            weights, ids = self.gate(x, input_ids, image_mask)
            return self.experts(x, weights, ids, shared=shared.value, shared_ready=shared.done)
        weights, ids = self.gate(x, input_ids, image_mask)
        if type(self.dispatch) is LocalDispatch:
            # every expert is local: the routed k-sum, the shared expert's add and the cast run as one pass
            return self.experts(x, weights, ids, shared=self.shared_experts(x))
        y = self.dispatch.run(x, weights, ids, self.experts, layer=self.layer_id)
        # fp32 + the shared expert's output: type promotion upcasts inside the add (no separate fp32 copy)
        return (y.float() + self.shared_experts(x)).to(x.dtype)


def chunk_model_experts(model: nn.Module) -> int:
    """Repack the FP4 routed experts that live on a CUDA device into the chunked layout, in place (after loading);
    experts on other devices keep the checkpoint layout (the torch reference would only pay an unpack per step).
    Returns the number of repacked `Experts`."""
    n = 0
    for m in model.modules():
        if isinstance(m, Experts) and m.w1.weight.is_cuda:
            n += m.use_chunked_layout()
    return n
