"""The MoE side of one data-parallel rank (docs/parallel.md, "Engine integration"): which checkpoint experts the
rank loads, the expert-parallel dispatch every backbone MoE layer runs through, the empty MoE step of a rank
with nothing to run, and EPLB (load counted during dispatch, rebalances that move expert weights in place).

Without expert parallelism (pure DP) every rank holds all experts and its MoE layers keep `LocalDispatch`: no
MoE collective, nothing to line up. With it, the EP group is all DP ranks, each holding the experts of its slots
of the current placement (`ExpertPlacement`), and every rank must run every MoE layer in every step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from deepinfer_parallel import EPDispatch, EPDispatcher, EPLBState, ParallelConfigError, ParallelState
from deepinfer_parallel import ParallelConfig as Layout
from torch import nn

from deepinfer_engine.errors import ConfigError

__all__ = ["RankExperts", "fp8_dispatch_block"]

logger = logging.getLogger(__name__)


def fp8_dispatch_block(hidden_size: int, deployed: bool) -> int | None:
    """Block of the FP8 dispatch payload: with deployed numerics (kv_cache_dtype="auto") activations travel as
    FP8 e4m3 + UE8M0 scales per 128 (or 32) values, the format the production expert GEMM consumes; otherwise
    they travel in the compute dtype, so the expert-parallel engine computes exactly what one process does."""
    if not deployed:
        return None
    for block in (128, 32):
        if hidden_size % block == 0:
            return block
    return None


class RankExperts:
    """Expert placement, dispatch and EPLB of one rank; built before the model loads (`expert_slots` tells the
    loader what to read), `install`ed on the loaded model.

    layout: the deepinfer-parallel layout (ep_size = DP size with expert parallelism, else 1); num_layers /
    num_experts / hidden_size / top_k: the backbone MoE shape.
    """

    def __init__(self, state: ParallelState, layout: Layout, *, expert_parallel: bool, num_layers: int,
                 num_experts: int, hidden_size: int, top_k: int) -> None:
        self.state = state
        self.layout = layout
        self.expert_parallel = expert_parallel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.eplb: EPLBState | None = None
        self.dispatch: EPDispatch | None = None
        self._layers: list[nn.Module] = []
        if expert_parallel:
            try:
                layout.check_experts(num_experts)
                self.eplb = EPLBState(config=layout, state=state, num_layers=num_layers, num_experts=num_experts)
            except ParallelConfigError as exc:
                raise ConfigError(str(exc)) from exc

    # ------------------------------------------------------------------ loading
    def expert_slots(self, layer: int) -> list[int]:
        """Checkpoint experts of this rank's slots in backbone MoE layer `layer` (the loader reads only these)."""
        assert self.eplb is not None
        return self.eplb.placement.local_experts(layer, self.state.ep_rank, self.state.ep_size).tolist()

    @property
    def loader_slots(self):
        """`expert_slots` for `EngineCore.from_config`, or None (pure DP: every expert)."""
        return self.expert_slots if self.expert_parallel else None

    def install(self, model: nn.Module, *, max_tokens_per_rank: int, dtype: torch.dtype,
                fp8_block: int | None) -> None:
        """Route every backbone MoE layer of `model` through one EPDispatch (DSpark / MTP draft layers, which
        this engine loop does not run, keep their local experts). max_tokens_per_rank: the largest decode step
        of a rank (max_num_seqs), the size of the low-latency buffers."""
        self._layers = [layer.ffn for layer in model.layers]
        if not self.expert_parallel:
            return
        assert self.eplb is not None
        hook = self.eplb.record if self.layout.enable_eplb else None
        dispatcher = EPDispatcher(
            self.state, num_physical_experts=self.layout.num_physical_experts(self.num_experts),
            hidden_size=self.hidden_size, top_k=self.top_k, max_tokens_per_rank=max_tokens_per_rank, dtype=dtype,
            fp8_block=fp8_block, load_hook=hook,
        )  # fmt: skip
        self.dispatch = EPDispatch(dispatcher, placement=self.eplb.placement, mode="throughput")
        for moe in self._layers:
            moe.dispatch = self.dispatch

    # ------------------------------------------------------------------ per step
    def set_mode(self, kind: str) -> None:
        """The agreed step kind picks the dispatch mode: throughput for steps with prefill tokens on any rank,
        low latency (fixed buffers, no host read) for decode-only steps."""
        if self.dispatch is not None:
            self.dispatch.mode = "throughput" if kind == "prefill" else "low_latency"

    @torch.inference_mode()
    def empty_step(self, device: torch.device, dtype: torch.dtype) -> None:
        """A rank with nothing to run still takes part in every MoE layer's dispatch / combine (T = 0), in the
        order a forward runs them, so its peers' collectives line up."""
        if self.dispatch is None:
            return
        x = torch.empty(0, self.hidden_size, dtype=dtype, device=device)
        w = torch.empty(0, self.top_k, dtype=torch.float32, device=device)
        ids = torch.empty(0, self.top_k, dtype=torch.int64, device=device)
        for moe in self._layers:
            self.dispatch.run(x, w, ids, moe.experts, layer=moe.layer_id)

    def after_step(self) -> bool:
        """Close the step in the EPLB window; rebalance when due (collective; every rank steps in lock-step, so
        all agree). Returns True when experts moved."""
        if self.eplb is None or not self.layout.enable_eplb or not self.eplb.step():
            return False
        load = self.eplb.global_load()
        before = self.eplb.balancedness(load)
        with torch.no_grad():
            self.eplb.rearrange(lambda layer: self._layers[layer].experts.tensors(), load=load)
        for layer, moe in enumerate(self._layers):
            moe.experts.set_held(self.expert_slots(layer), self.num_experts)
        after = self.eplb.balancedness(load)
        if self.state.is_driver:
            logger.info("EPLB rebalance %d: window balancedness (mean / max tokens per rank) %.3f -> %.3f",
                        self.eplb.num_rearrangements, float(before.mean()), float(after.mean()))
        return True

    @property
    def num_rearrangements(self) -> int:
        return 0 if self.eplb is None else self.eplb.num_rearrangements

    def held_experts(self) -> list[Sequence[int]]:
        """Per backbone MoE layer, the checkpoint expert of each of this rank's slots."""
        return [m.experts.held_experts or tuple(range(len(m.experts))) for m in self._layers]
