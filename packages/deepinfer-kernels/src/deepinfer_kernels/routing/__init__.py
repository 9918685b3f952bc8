"""MoE gate scores and top-k selection (docs/model.md §A.8/§C.5): torch references; Triton fused top-k."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.routing import reference

__all__ = ["gate_scores", "route_logits", "select_experts"]

_TRITON_MAX_E = 8192  # all scores of a token live in one program's registers


def gate_scores(x: Tensor, weight: Tensor, score_func: str) -> Tensor:
    """x [T, d], weight [E, d] -> [T, E] fp32."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gate_scores: expected x [T,d], weight [E,d]; found {tuple(x.shape)}, {tuple(weight.shape)}")
    return reference.gate_scores(x, weight, score_func)


def select_experts(
    scores: Tensor,
    topk: int,
    *,
    bias: Tensor | None = None,
    hash_ids: Tensor | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """scores [T, E] fp32 -> (weights [T, topk] fp32, ids [T, topk] int64).
    backend: "auto" | "torch" | "triton" (the Triton kernel covers the biased top-k path, not hash_ids; it breaks
    exact score ties toward the lower expert id, torch.topk's tie order is unspecified)."""
    if topk < 1 or topk > scores.shape[-1]:
        raise ValueError(f"select_experts: topk {topk} not in [1, {scores.shape[-1]}]")
    if hash_ids is not None and hash_ids.shape != (scores.shape[0], topk):
        raise ValueError(f"select_experts: hash_ids shape {tuple(hash_ids.shape)}, expected ({scores.shape[0]}, {topk})")
    if bias is not None and bias.shape[-1] != scores.shape[-1]:
        raise ValueError(f"select_experts: bias last dim {bias.shape[-1]}, expected {scores.shape[-1]}")
    if _use_triton("select_experts", backend, scores, bias, hash_ids, topk):
        from deepinfer_kernels.routing import triton as triton_backend

        return triton_backend.route_topk(
            scores, bias, topk, sqrtsoftplus=False, route_scale=route_scale, renormalize=renormalize
        )
    return reference.select_experts(
        scores, topk, bias=bias, hash_ids=hash_ids, route_scale=route_scale, renormalize=renormalize
    )


def route_logits(
    logits: Tensor,
    topk: int,
    *,
    score_func: str = "sqrtsoftplus",
    bias: Tensor | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
    bias_alt: Tensor | None = None,
    alt_rows: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Gate logits [T, E] fp32 (x @ gate.weight^T) -> (weights [T, topk] fp32, ids [T, topk] int64): the score
    function, biased selection, renormalisation and scale in one step (= reference gate score + select_experts).
    bias_alt [E] fp32 with alt_rows [T] bool (both or neither; bias [E] then): flagged rows select with bias_alt
    instead of bias (V4.1 `bias_vl` at image positions), = bias `where(alt_rows[:, None], bias_alt, bias)`, picked
    inside the kernel. Triton fuses it all for score_func="sqrtsoftplus" (V4 / V4.1); other score functions use
    the reference."""
    if logits.dim() != 2 or topk < 1 or topk > logits.shape[-1]:
        raise ValueError(f"route_logits: expected logits [T, E] and 1 <= topk <= E; found {tuple(logits.shape)}, {topk}")
    if bias is not None and bias.shape[-1] != logits.shape[-1]:
        raise ValueError(f"route_logits: bias last dim {bias.shape[-1]}, expected {logits.shape[-1]}")
    if (bias_alt is None) != (alt_rows is None):
        raise ValueError("route_logits: bias_alt and alt_rows go together (found one of them)")
    if bias_alt is not None:
        if bias is None or bias.dim() != 1 or bias_alt.shape != bias.shape or alt_rows.shape != logits.shape[:1]:
            raise ValueError(
                f"route_logits: bias_alt needs bias [E] and alt_rows [T]; found bias "
                f"{None if bias is None else tuple(bias.shape)}, bias_alt {tuple(bias_alt.shape)}, alt_rows "
                f"{tuple(alt_rows.shape)}, logits {tuple(logits.shape)}"
            )
    if score_func == "sqrtsoftplus" and _use_triton("route_logits", backend, logits, bias, None, topk):
        from deepinfer_kernels.routing import triton as triton_backend

        return triton_backend.route_topk(
            logits, bias, topk, sqrtsoftplus=True, route_scale=route_scale, renormalize=renormalize,
            bias_alt=bias_alt, alt_rows=alt_rows,
        )
    if bias_alt is not None:
        bias = torch.where(alt_rows[:, None], bias_alt[None, :], bias[None, :])
    if score_func == "sqrtsoftplus":
        scores = torch.sqrt(torch.nn.functional.softplus(logits.float()))
    elif score_func == "sigmoid":
        scores = torch.sigmoid(logits.float())
    elif score_func == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        raise ValueError(f"route_logits: unknown score_func {score_func!r}")
    return reference.select_experts(scores, topk, bias=bias, route_scale=route_scale, renormalize=renormalize)


def _use_triton(op: str, backend: str, x: Tensor, bias: Tensor | None, hash_ids: Tensor | None, topk: int) -> bool:
    ok = (
        hash_ids is None
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.shape[-1] <= _TRITON_MAX_E
        and topk <= 64
        and (bias is None or bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == x.shape[0]))
    )
    why = f"x {x.dtype} {tuple(x.shape)}, topk {topk}, hash_ids {hash_ids is not None}; needs the biased top-k path"
    tensors = tuple(a for a in (x, bias) if a is not None)
    return resolve_backend(op, backend, *tensors, triton_ok=ok, why_not=why) == "triton"
