"""Expert-parallel load balancing: load recording and the pure placement policy (runtime.md §5)."""

from deepinfer_parallel.eplb.algorithm import (
    balanced_packing,
    build_log2phy,
    gpu_loads,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_parallel.eplb.recorder import ExpertLoadRecorder

__all__ = ["ExpertLoadRecorder", "balanced_packing", "build_log2phy", "gpu_loads", "rebalance_experts", "replicate_experts"]
