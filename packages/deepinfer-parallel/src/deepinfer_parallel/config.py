"""ParallelConfig: the data-parallel attention / expert-parallel MoE layout of one engine (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["EPBackend", "ParallelConfig"]

# "a2a": variable all_to_all_single dispatch/combine (prefill-friendly, docs/parallel.md "Dispatch and combine");
# "agrs": all-gather -> local experts -> reduce-scatter (static shapes, decode graphs; not implemented yet);
# "deepep": DeepEP buffers when installed; not implemented in this package yet.
EPBackend = Literal["a2a", "agrs", "deepep"]
_BACKENDS: tuple[str, ...] = ("a2a", "agrs", "deepep")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One process per GPU, no tensor parallelism (docs/parallel.md, "Process layout").

    dp_size: attention data-parallel ranks (= GPUs of the engine); every rank holds all non-expert weights.
    ep_size: ranks of one expert-parallel group; EP groups are contiguous blocks of ranks, so ep_size divides
        dp_size (ep_size == dp_size: one group over all ranks).
    num_redundant_experts: extra physical expert slots per MoE layer used by EPLB to replicate hot experts;
        (num_experts + num_redundant_experts) must be divisible by ep_size (checked by `check_experts`).
    backend: dispatch/combine implementation, see `EPBackend`.
    enable_eplb: rebalance experts while running (EPLBState); eplb_window_size: steps of expert load kept in the
        sliding window; eplb_step_interval: steps between rebalances (the first comes after a quarter of it, to fix
        a cold start quickly); the window must not exceed the interval. Names and defaults follow vLLM.
    """

    dp_size: int = 1
    ep_size: int = 1
    num_redundant_experts: int = 0
    backend: EPBackend = "a2a"
    enable_eplb: bool = False
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000

    def __post_init__(self) -> None:
        for name in ("dp_size", "ep_size", "num_redundant_experts", "eplb_window_size", "eplb_step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelConfigError(f"ParallelConfig.{name}: expected an int, found {value!r}")
        if self.dp_size < 1:
            raise ParallelConfigError(f"ParallelConfig.dp_size: expected >= 1, found {self.dp_size}")
        if self.ep_size < 1:
            raise ParallelConfigError(f"ParallelConfig.ep_size: expected >= 1, found {self.ep_size}")
        if self.dp_size % self.ep_size != 0:
            raise ParallelConfigError(
                f"ParallelConfig.ep_size: expected a divisor of dp_size={self.dp_size} "
                f"(EP groups are contiguous blocks of ranks), found {self.ep_size}"
            )
        if self.num_redundant_experts < 0:
            raise ParallelConfigError(
                f"ParallelConfig.num_redundant_experts: expected >= 0, found {self.num_redundant_experts}"
            )
        if not isinstance(self.enable_eplb, bool):
            raise ParallelConfigError(f"ParallelConfig.enable_eplb: expected a bool, found {self.enable_eplb!r}")
        for name in ("eplb_window_size", "eplb_step_interval"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"ParallelConfig.{name}: expected >= 1, found {getattr(self, name)}")
        if self.eplb_window_size > self.eplb_step_interval:
            raise ParallelConfigError(
                f"ParallelConfig.eplb_window_size: expected <= eplb_step_interval={self.eplb_step_interval} (a "
                f"rebalance would count steps of the previous placement), found {self.eplb_window_size}"
            )
        if self.backend not in _BACKENDS:
            raise ParallelConfigError(f"ParallelConfig.backend: expected one of {_BACKENDS}, found {self.backend!r}")

    @property
    def world_size(self) -> int:
        return self.dp_size

    @property
    def num_ep_groups(self) -> int:
        return self.dp_size // self.ep_size

    def num_physical_experts(self, num_experts: int) -> int:
        """Physical expert slots per MoE layer (logical experts + redundant copies)."""
        return num_experts + self.num_redundant_experts

    def check_experts(self, num_experts: int) -> None:
        """Raise unless `num_experts` logical experts + the redundant slots split evenly over the EP group."""
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ParallelConfigError(f"num_experts: expected an int >= 1, found {num_experts!r}")
        total = self.num_physical_experts(num_experts)
        if total % self.ep_size != 0:
            raise ParallelConfigError(
                f"ParallelConfig.num_redundant_experts: {num_experts} experts + {self.num_redundant_experts} "
                f"redundant = {total} slots, not divisible by ep_size={self.ep_size}; use "
                f"num_redundant_experts={-num_experts % self.ep_size} (+ a multiple of {self.ep_size})"
            )

    def experts_per_rank(self, num_experts: int) -> int:
        self.check_experts(num_experts)
        return self.num_physical_experts(num_experts) // self.ep_size

    def ep_group_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank: expected 0 <= rank < {self.world_size}, found {rank}")
        return rank // self.ep_size

    def ep_rank_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank: expected 0 <= rank < {self.world_size}, found {rank}")
        return rank % self.ep_size
