"""deepinfer-dspark: see the package README for what it owns and what it may import."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_dspark.config import DSparkConfig
from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError
from deepinfer_dspark.protocol import DraftModel, DraftProposal
from deepinfer_dspark.stats import AcceptanceStats
from deepinfer_dspark.verify import (
    AcceptResult,
    greedy_accept,
    probs_from_logits,
    rejection_accept,
    verify,
    verify_uniforms,
)

try:
    __version__ = version("deepinfer-dspark")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = [
    "AcceptResult",
    "AcceptanceStats",
    "DSparkConfig",
    "DSparkConfigError",
    "DSparkInputError",
    "DraftModel",
    "DraftProposal",
    "__version__",
    "greedy_accept",
    "probs_from_logits",
    "rejection_accept",
    "verify",
    "verify_uniforms",
]
