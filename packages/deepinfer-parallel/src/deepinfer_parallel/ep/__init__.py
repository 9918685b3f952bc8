"""Expert-parallel MoE runtime pieces: expert placement (logical -> physical slots), dispatch/combine, references."""

from deepinfer_parallel.ep.dispatcher import (
    DispatchMode,
    DispatchOutput,
    EPDispatcher,
    LowLatencyHandle,
    ThroughputHandle,
)
from deepinfer_parallel.ep.moe_dispatch import EPDispatch, LocalDispatch, LocalExperts, MoEDispatch
from deepinfer_parallel.ep.placement import REPLICA_HASH_PRIME, ExpertPlacement
from deepinfer_parallel.ep.reference import reference_moe, run_local_experts, swiglu_local_experts

__all__ = [
    "REPLICA_HASH_PRIME",
    "DispatchMode",
    "DispatchOutput",
    "EPDispatch",
    "EPDispatcher",
    "ExpertPlacement",
    "LocalDispatch",
    "LocalExperts",
    "LowLatencyHandle",
    "MoEDispatch",
    "ThroughputHandle",
    "reference_moe",
    "run_local_experts",
    "swiglu_local_experts",
]
