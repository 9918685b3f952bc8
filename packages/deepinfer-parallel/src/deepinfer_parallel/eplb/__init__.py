"""Expert-parallel load balancing: load recording and the placement policy (pure pieces).

The runtime pieces that need the expert placement live in `eplb.state` (EPLBState) and `eplb.shuffle` (weight
movement); they are not imported here because `ep.placement` itself builds on `eplb.algorithm`.
"""

from deepinfer_parallel.eplb.algorithm import (
    balanced_packing,
    build_log2phy,
    gpu_loads,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_parallel.eplb.recorder import ExpertLoadRecorder

__all__ = ["ExpertLoadRecorder", "balanced_packing", "build_log2phy", "gpu_loads", "rebalance_experts", "replicate_experts"]
