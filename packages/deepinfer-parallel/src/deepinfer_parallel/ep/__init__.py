"""Expert-parallel MoE runtime pieces: expert placement (logical -> physical slots) and dispatch/combine."""

from deepinfer_parallel.ep.dispatch import DispatchHandle, combine, dispatch, reference_moe
from deepinfer_parallel.ep.placement import REPLICA_HASH_PRIME, ExpertPlacement

__all__ = ["REPLICA_HASH_PRIME", "DispatchHandle", "ExpertPlacement", "combine", "dispatch", "reference_moe"]
