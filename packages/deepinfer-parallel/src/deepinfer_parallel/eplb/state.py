"""EPLBState: expert-parallel load balancing inside a running engine (docs/parallel.md, "EPLB").

The loop, per engine step:
  1. every dispatch of MoE layer l calls `record(l, topk_slots)` (pass `eplb.record` as the EPDispatcher's
     load_hook): the physical slots are folded to logical experts and counted on device, no host sync;
  2. after the step, `step()` closes the step into the sliding window of `eplb_window_size` steps and returns True
     when a rebalance is due (every `eplb_step_interval` steps, the first after a quarter of it);
  3. then every rank of the EP group calls `rearrange(layer_tensors)`: loads are summed over the EP group, the
     placement policy picks new slots, every layer's expert tensors are moved (`move_expert_weights`) and the
     placement maps are overwritten in place, so routing (`placement.map_to_physical`) follows immediately and
     tensors captured by CUDA graphs stay valid.
The window is cleared after a rebalance: its counts described the old placement's traffic, not the new one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.ep.placement import ExpertPlacement
from deepinfer_parallel.eplb.algorithm import gpu_loads, rebalance_experts
from deepinfer_parallel.eplb.recorder import ExpertLoadRecorder
from deepinfer_parallel.eplb.shuffle import move_expert_weights
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.state import ParallelState

__all__ = ["EPLBState"]

LayerTensors = Callable[[int], Sequence[Tensor]] | Sequence[Sequence[Tensor]]


class EPLBState:
    """Load statistics, the current placement and the rebalance trigger of one EP group's MoE layers.

    config: the ParallelConfig (enable_eplb, num_redundant_experts, eplb_window_size, eplb_step_interval).
    state: this rank's ParallelState. num_layers / num_experts: MoE layers and logical experts per layer.
    placement: the start-up placement (default `ExpertPlacement.initial`); its maps are copied into tensors this
        object owns (log2phy padded to 1 + num_redundant_experts replicas, the most any expert can get), which keep
        their addresses for the whole run.
    """

    def __init__(
        self,
        *,
        config: ParallelConfig,
        state: ParallelState,
        num_layers: int,
        num_experts: int,
        placement: ExpertPlacement | None = None,
    ) -> None:
        config.check_experts(num_experts)
        if config.ep_size != state.ep_size:
            raise ParallelConfigError(
                f"ParallelConfig.ep_size: expected the state's ep_size={state.ep_size}, found {config.ep_size}"
            )
        self.config = config
        self.state = state
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_physical = config.num_physical_experts(num_experts)
        if placement is None:
            placement = ExpertPlacement.initial(num_layers=num_layers, num_experts=num_experts,
                                                num_physical=self.num_physical)
        if (placement.num_layers, placement.num_logical, placement.num_physical) != (
                num_layers, num_experts, self.num_physical):
            raise ParallelConfigError(
                f"placement: expected {num_layers} layers x {num_experts} experts x {self.num_physical} slots, found "
                f"{placement.num_layers} x {placement.num_logical} x {placement.num_physical}"
            )
        device = state.device
        width = 1 + config.num_redundant_experts
        self._phy2log = placement.phy2log.to(device=device, dtype=torch.int64).clone()
        self._logcnt = placement.logcnt.to(device=device, dtype=torch.int64).clone()
        self._log2phy = torch.full((num_layers, num_experts, width), -1, dtype=torch.int64, device=device)
        self._log2phy[..., : placement.max_replicas] = placement.log2phy.to(device)
        self.recorder = ExpertLoadRecorder(num_layers=num_layers, num_experts=num_experts,
                                           window=config.eplb_window_size, device=device)
        self.steps = 0
        self.num_rearrangements = 0
        self._placement = ExpertPlacement(phy2log=self._phy2log, log2phy=self._log2phy, logcnt=self._logcnt)

    @property
    def placement(self) -> ExpertPlacement:
        """The current placement: always the same object, whose map tensors are updated in place by `rearrange`."""
        return self._placement

    def record(self, layer: int, topk_slots: Tensor) -> None:
        """Count one dispatch of `layer`: `topk_slots [T, top_k]` physical slots (-1 = none). No host sync; usable
        as EPDispatcher's load_hook."""
        slots = topk_slots.to(torch.int64)
        logical = self._phy2log[layer].index_select(0, slots.clamp(min=0).reshape(-1)).view_as(slots)
        self.recorder.record(layer, torch.where(slots >= 0, logical, slots), check=False)

    def step(self) -> bool:
        """Close the current step; True when every rank should now call `rearrange` (same answer on every rank,
        since all ranks step in lock-step)."""
        self.recorder.step()
        self.steps += 1
        if not self.config.enable_eplb or self.config.num_redundant_experts == 0 and self.config.ep_size == 1:
            return False
        interval = self.config.eplb_step_interval
        return self.steps == max(interval // 4, 1) or self.steps % interval == 0

    def global_load(self) -> Tensor:
        """Window load summed over the EP group: `[num_layers, num_experts] int64` (collective)."""
        load = self.recorder.load()
        if self.state.world_group is not None and self.state.ep_size > 1:
            dist.all_reduce(load, group=self.state.ep_group)
        return load

    def balancedness(self, load: Tensor | None = None) -> Tensor:
        """Mean / max expected tokens per rank for every layer under the current placement (`[num_layers]` float64,
        1.0 = perfectly even), from `load` or the window (collective when load is None)."""
        load = self.global_load() if load is None else load
        per_rank = gpu_loads(load.cpu(), self._phy2log.cpu(), self._logcnt.cpu(), self.state.ep_size)
        return per_rank.mean(1) / per_rank.amax(1).clamp(min=1e-9)

    def rearrange(self, layer_tensors: LayerTensors, *, load: Tensor | None = None) -> ExpertPlacement:
        """Rebalance every layer (collective over the EP group).

        layer_tensors: per layer, the rank's expert tensors `[slots_per_rank, ...]` (any dtype: packed FP4 + scales,
        FP8 + scales, ...), as a sequence or a function of the layer index; they are rewritten in place.
        load: override the window load (`[num_layers, num_experts]`, identical on every rank), e.g. for tests.
        Returns the new placement (also installed in place).
        """
        load = self.global_load() if load is None else load.to(torch.int64)
        phy2log, log2phy, logcnt = rebalance_experts(load.cpu(), self.num_physical, 1, 1, self.state.ep_size)
        ExpertPlacement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)  # validates before any weight moves
        old = self._phy2log.cpu()
        for layer in range(self.num_layers):
            tensors = layer_tensors(layer) if callable(layer_tensors) else layer_tensors[layer]
            move_expert_weights(tensors, old[layer], phy2log[layer], self.state)
        self._phy2log.copy_(phy2log)
        self._logcnt.copy_(logcnt)
        self._log2phy.fill_(-1)
        self._log2phy[..., : log2phy.shape[2]] = log2phy.to(self._log2phy.device)
        self.recorder.reset()
        self.num_rearrangements += 1
        return self._placement
