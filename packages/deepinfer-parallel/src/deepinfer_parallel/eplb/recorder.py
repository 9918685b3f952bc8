"""Per-layer expert load counter fed from routing top-k ids, with a sliding window of recent steps
(docs/parallel.md, "EPLB"). Mutable runtime state, so a plain class; imports torch only."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["ExpertLoadRecorder"]


class ExpertLoadRecorder:
    """Counts tokens routed to each logical expert of each MoE layer.

    `record(layer, topk_ids)` adds one step's routing decisions of one layer into the open step; `step()` closes the
    step, moving its counts into a ring of the last `window` closed steps (the oldest falls out). `load()` is the
    `[num_layers, num_experts]` input of `rebalance_experts`. Counting stays on `device` (`index_add_`); with
    `check=False` recording never synchronises with the host. Ids < 0 (padding / dropped tokens) are ignored.
    """

    def __init__(self, *, num_layers: int, num_experts: int, window: int, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"ExpertLoadRecorder.{name}: expected an int >= 1, found {value!r}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self._current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._ring = torch.zeros(window, num_layers, num_experts, dtype=torch.int64, device=device)
        self._next = 0  # ring row the next closed step goes to
        self._closed = 0  # closed steps so far (the ring holds min(closed, window) of them)

    @property
    def device(self) -> torch.device:
        return self._current.device

    @property
    def num_steps(self) -> int:
        """Closed steps currently in the window."""
        return min(self._closed, self.window)

    def record(self, layer: int, topk_ids: Tensor, *, check: bool = True) -> None:
        """Add `topk_ids [num_tokens, top_k] int` (logical expert ids of one MoE layer, -1 = none) to the open step.

        check: raise on ids >= num_experts (costs one host sync). Such ids make `index_add_` fail on the CPU and are
        undefined behaviour on CUDA, so pass check=False only for ids that come straight from the gate.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ParallelConfigError(f"layer: expected 0 <= layer < {self.num_layers}, found {layer!r}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool or topk_ids.dim() != 2:
            raise ParallelConfigError(
                f"topk_ids: expected a [num_tokens, top_k] integer tensor, found {tuple(topk_ids.shape)} {topk_ids.dtype}"
            )
        ids = topk_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        valid = ids >= 0
        if check and bool((ids >= self.num_experts).any()):
            raise ParallelConfigError(
                f"topk_ids: expected ids < num_experts={self.num_experts}, found max {int(ids.max())}"
            )
        self._current[layer].index_add_(0, ids.clamp(min=0), valid.to(torch.int64))

    def step(self) -> None:
        """Close the open step: it enters the window (replacing the oldest step once the window is full)."""
        self._ring[self._next].copy_(self._current)
        self._current.zero_()
        self._next = (self._next + 1) % self.window
        self._closed += 1

    def current(self) -> Tensor:
        """Counts of the open step `[num_layers, num_experts] int64` (a copy)."""
        return self._current.clone()

    def load(self, *, reduce: str = "sum") -> Tensor:
        """Load over the closed steps in the window: `[num_layers, num_experts]`, int64 for "sum", float32 for "mean"
        (mean over the closed steps; zeros before the first step is closed)."""
        total = self._ring.sum(0)
        if reduce == "sum":
            return total
        if reduce == "mean":
            return total.to(torch.float32) / max(self.num_steps, 1)
        raise ParallelConfigError(f"reduce: expected 'sum' or 'mean', found {reduce!r}")

    def per_step(self) -> Tensor:
        """The closed steps in the window, oldest first: `[num_steps, num_layers, num_experts] int64`."""
        n = self.num_steps
        if self._closed <= self.window:
            return self._ring[:n].clone()
        return torch.roll(self._ring, shifts=-self._next, dims=0).clone()

    def reset(self) -> None:
        self._current.zero_()
        self._ring.zero_()
        self._next = 0
        self._closed = 0
