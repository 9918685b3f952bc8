"""deepinfer-parallel: see the package README for what it owns and what it may import."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_parallel.config import EPBackend, ParallelConfig
from deepinfer_parallel.ep import ExpertPlacement
from deepinfer_parallel.eplb import ExpertLoadRecorder, rebalance_experts
from deepinfer_parallel.errors import ParallelConfigError, PlacementError
from deepinfer_parallel.sizing import EPMemoryEstimate, estimate_gpu_memory, smallest_ep_that_fits

try:
    __version__ = version("deepinfer-parallel")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = [
    "EPBackend",
    "EPMemoryEstimate",
    "ExpertLoadRecorder",
    "ExpertPlacement",
    "ParallelConfig",
    "ParallelConfigError",
    "PlacementError",
    "__version__",
    "estimate_gpu_memory",
    "rebalance_experts",
    "smallest_ep_that_fits",
]
