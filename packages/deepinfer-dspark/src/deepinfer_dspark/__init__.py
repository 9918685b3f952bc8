"""deepinfer-dspark: see the package README for what it owns and what it may import."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_dspark.calibrate import fit_sts
from deepinfer_dspark.config import DSparkConfig
from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError
from deepinfer_dspark.latency import FLAT_SIGMAS, LatencyModel, isotonic
from deepinfer_dspark.propose import (
    block_confidence,
    check_sampling,
    confidence,
    markov_bias,
    propose,
    sample_block,
    sample_core,
    sts_divisors,
)
from deepinfer_dspark.protocol import DraftBlock, DraftHeads, DraftModel, DraftProposal
from deepinfer_dspark.rng import (
    DRAW_ACCEPT,
    DRAW_DRAFT,
    DRAW_FINAL,
    counter_uniforms,
    verify_counter_uniforms,
    verify_counter_uniforms_host,
)
from deepinfer_dspark.schedule import (
    POLICIES,
    StepPadding,
    VerifyPolicy,
    allocate,
    allocate_above,
    cost_budget,
    cost_cutoff,
    schedule_verification,
)
from deepinfer_dspark.schedule_device import DevicePlan, plan_schedule, schedule_on_device
from deepinfer_dspark.stats import AcceptanceStats
from deepinfer_dspark.survival_calibration import SurvivalCalibration
from deepinfer_dspark.verify import (
    AcceptResult,
    TargetLogits,
    greedy_accept,
    probs_from_logits,
    rejection_accept,
    row_plan,
    verify,
    verify_uniforms,
)

try:
    __version__ = version("deepinfer-dspark")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = [
    "DRAW_ACCEPT",
    "DRAW_DRAFT",
    "DRAW_FINAL",
    "FLAT_SIGMAS",
    "POLICIES",
    "AcceptResult",
    "TargetLogits",
    "AcceptanceStats",
    "DSparkConfig",
    "DSparkConfigError",
    "DSparkInputError",
    "DevicePlan",
    "DraftBlock",
    "DraftHeads",
    "DraftModel",
    "DraftProposal",
    "LatencyModel",
    "StepPadding",
    "SurvivalCalibration",
    "VerifyPolicy",
    "__version__",
    "allocate",
    "allocate_above",
    "block_confidence",
    "check_sampling",
    "confidence",
    "cost_budget",
    "cost_cutoff",
    "counter_uniforms",
    "fit_sts",
    "greedy_accept",
    "isotonic",
    "markov_bias",
    "plan_schedule",
    "probs_from_logits",
    "propose",
    "rejection_accept",
    "row_plan",
    "sample_block",
    "sample_core",
    "schedule_on_device",
    "schedule_verification",
    "sts_divisors",
    "verify",
    "verify_counter_uniforms",
    "verify_counter_uniforms_host",
    "verify_uniforms",
]
