"""`MoEDispatch`: how a MoE layer reaches its routed experts. The engine's MoE calls `run` and does not know
whether the experts live on this rank (`LocalDispatch`, one process) or are spread over an EP group
(`EPDispatch`: dispatch -> this rank's experts on the rows it received -> combine, docs/parallel.md "Engine
integration").

`LocalExperts` is the expert computation of one rank: `(x [R, hidden], weights [R, k] float32, ids [R, k]
int64 local expert / slot ids) -> [R, hidden] float32 = sum_k weights[r, k] * Expert_{ids[r, k]}(x[r])`
(the engine's `Experts` module, `deepinfer_kernels.moe.moe_experts` over stacked weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from deepinfer_parallel.ep.dispatcher import DispatchMode, EPDispatcher
from deepinfer_parallel.ep.placement import ExpertPlacement
from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["EPDispatch", "LocalDispatch", "LocalExperts", "MoEDispatch"]

LocalExperts = Callable[[Tensor, Tensor, Tensor], Tensor]


@runtime_checkable
class MoEDispatch(Protocol):
    """The routed-expert part of a MoE layer."""

    def run(
        self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, local_experts: LocalExperts, *,
        layer: int | None = None,
    ) -> Tensor:  # fmt: skip
        """x `[T, hidden]`, topk_weights `[T, k] float32`, topk_ids `[T, k] int64` LOGICAL expert ids of this
        rank's tokens -> `[T, hidden] float32` sum of the routed experts (no shared expert). layer: the MoE layer
        index (placement and load statistics)."""
        ...


class LocalDispatch:
    """Every expert on this rank: the local experts run on all tokens with the logical ids (one process)."""

    def run(
        self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, local_experts: LocalExperts, *,
        layer: int | None = None,
    ) -> Tensor:  # fmt: skip
        del layer  # one placement: logical id = local expert index
        return local_experts(x, topk_weights, topk_ids)


class EPDispatch:
    """Experts spread over the EP group of `dispatcher`: logical ids -> physical slots (`placement`, or the
    identity when None: slot = expert id, no redundant experts), all-to-all dispatch, this rank's experts on the
    rows it received (`local_experts` indexed by LOCAL slot 0..slots_per_rank-1), all-to-all combine.

    mode: "throughput" (prefill-sized steps) or "low_latency" (fixed decode buffers). Every rank of the EP group
    must call `run` for every layer in the same order, also with T = 0 tokens.
    """

    def __init__(
        self, dispatcher: EPDispatcher, *, placement: ExpertPlacement | None = None,
        mode: DispatchMode = "throughput",
    ) -> None:  # fmt: skip
        if mode not in ("throughput", "low_latency"):
            raise ParallelConfigError(f"EPDispatch.mode: expected 'throughput' or 'low_latency', found {mode!r}")
        self.dispatcher, self.placement, self.mode = dispatcher, placement, mode

    def run(
        self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, local_experts: LocalExperts, *,
        layer: int | None = None,
    ) -> Tensor:  # fmt: skip
        d = self.dispatcher
        if self.placement is None:
            slots = topk_ids
        else:
            if layer is None:
                raise ParallelConfigError("EPDispatch.run: a placement needs the layer index (layer=None found)")
            slots = self.placement.map_to_physical(layer, topk_ids, ep_rank=d.state.ep_rank)
        out = d.dispatch(x, slots, mode=self.mode, layer=layer)
        # one (token, expert) pair per received row: weight 1, its local slot; padding rows (slot -1) compute on
        # slot 0 and are never read back by combine
        valid = out.recv_slot >= 0
        ids = torch.where(valid, out.recv_slot, torch.zeros_like(out.recv_slot))[:, None]
        ones = valid.to(torch.float32)[:, None]
        y = local_experts(out.recv_x, ones, ids)
        return d.combine(y.to(d.dtype), out.handle, topk_weights).to(torch.float32)
