"""deepinfer-parallel: see the package README for what it owns, what it may import and the engine-facing API."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_parallel.config import EPBackend, ParallelConfig
from deepinfer_parallel.ep import (
    DispatchOutput,
    EPDispatch,
    EPDispatcher,
    ExpertPlacement,
    LocalDispatch,
    MoEDispatch,
)
from deepinfer_parallel.eplb import ExpertLoadRecorder, rebalance_experts
from deepinfer_parallel.eplb.shuffle import move_expert_weights
from deepinfer_parallel.eplb.state import EPLBState
from deepinfer_parallel.errors import ParallelConfigError, PlacementError, RankFailedError
from deepinfer_parallel.launch import SpawnedRanks, spawn_ranks
from deepinfer_parallel.lockstep import StepAgreement, agree_step
from deepinfer_parallel.sizing import EPMemoryEstimate, estimate_gpu_memory, smallest_ep_that_fits
from deepinfer_parallel.state import ParallelState

try:
    __version__ = version("deepinfer-parallel")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = [
    "DispatchOutput",
    "EPBackend",
    "EPDispatch",
    "EPDispatcher",
    "EPLBState",
    "EPMemoryEstimate",
    "ExpertLoadRecorder",
    "ExpertPlacement",
    "LocalDispatch",
    "MoEDispatch",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelState",
    "PlacementError",
    "RankFailedError",
    "SpawnedRanks",
    "StepAgreement",
    "__version__",
    "agree_step",
    "estimate_gpu_memory",
    "move_expert_weights",
    "rebalance_experts",
    "smallest_ep_that_fits",
    "spawn_ranks",
]
