"""Acceptance statistics of speculative decoding (docs/dspark.md): histogram of accepted drafts, mean accepted
length tau (includes the bonus/correction token), per-position acceptance, verification efficiency, confidence
calibration error and the calibration of the survivals the policies rank by. Host-side accumulators (plain ints /
floats); imports torch only to read tensors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError

__all__ = ["RELIABILITY_EDGES", "AcceptanceStats"]

# survival bins of the reliability table (`AcceptanceStats.survival_reliability`): finer where the policies cut
RELIABILITY_EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


# the inner edges as an array, for the bins' one search per update (read-only: shared by every accumulator)
_INNER_EDGES = np.asarray(RELIABILITY_EDGES[1:-1])
_INNER_EDGES.flags.writeable = False


def _as_counts(name: str, values: Sequence[int] | Tensor) -> np.ndarray:
    """`[B] int64` counts per request (a tensor is read once; other values as `int` reads them)."""
    if isinstance(values, Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point:
            raise DSparkInputError(f"{name}: expected a [B] integer tensor, found {tuple(values.shape)} {values.dtype}")
        return values.detach().cpu().numpy().astype(np.int64)
    out = np.asarray(values)
    if out.ndim != 1:
        raise DSparkInputError(f"{name}: expected [B] counts, found shape {out.shape}")
    return out.astype(np.int64)


class AcceptanceStats:
    """Accumulates verification outcomes over steps (mutable runtime state, so a plain class).

    One "request-step" = one request verified in one step. For block size N:
      histogram[k]      request-steps that accepted exactly k drafts (k = 0..N);
      verified[j]       request-steps that verified a draft at position j (num_drafts > j);
      reached[j]        ... that verified position j and accepted every draft before it;
      accepted[j]       ... that accepted the draft at position j (num_accepted > j);
      predicted[j]      sum of the predicted survivals a[j] (P(drafts 1..j+1 all accepted)) over the request-steps
                        that verified position j, when the caller passes them: a calibrated Confidence Head gives
                        predicted[j] ~ accepted[j] (the policies' expected accepted tokens are these sums); a
                        NaN survival (a broken head) adds nothing, so one bad round does not void the run's sums;
      reliability       per survival bin (RELIABILITY_EDGES) [verified drafts, summed survival, accepted drafts]:
                        the calibration by level, where the policies' cuts fall (a calibrated sum can hide an
                        overconfident tail behind an underconfident head).
    Token counters (the engine's per-request / per-run metrics): num_draft_tokens (proposed), num_verified_tokens
    (drafts the target checked), num_accepted_tokens; steps = batch steps (update calls).
    """

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise DSparkInputError(f"block_size: expected an int >= 1, found {block_size!r}")
        self.block_size = block_size
        self.request_steps = 0
        self.histogram = [0] * (block_size + 1)
        self.verified = [0] * block_size
        self.reached = [0] * block_size
        self.accepted = [0] * block_size
        self._conf_abs_err = 0.0
        self._conf_count = 0
        self.predicted = [0.0] * block_size
        self._predicted_steps = 0  # request-steps whose survivals were given
        self.reliability = [[0, 0.0, 0] for _ in RELIABILITY_EDGES[1:]]
        self.num_draft_tokens = 0
        self.steps = 0

    def update(
        self,
        num_accepted: Sequence[int] | Tensor,
        num_drafts: Sequence[int] | Tensor,
        *,
        confidence: Tensor | None = None,
        accept_prob: Tensor | None = None,
        num_proposed: Sequence[int] | Tensor | None = None,
        survival: np.ndarray | Tensor | None = None,
    ) -> None:
        """Add one step: `num_accepted [B]`, `num_drafts [B]` (verified drafts per request); `num_proposed [B]`
        drafts proposed per request (default: block_size each); optionally the
        predicted `confidence [B, N]` and the analytic `accept_prob [B, N]` (AcceptResult.accept_prob) to track
        mean |c - accept_prob| over verified positions; optionally the survivals `[B, N]` the step was scheduled
        by (host array or tensor), summed over the verified positions (`predicted`)."""
        # counted as arrays: the engine updates once per speculative round with every request of the batch, and
        # after the round's forward each NumPy call costs microseconds, so the counts come from one joint table
        acc_np = _as_counts("num_accepted", num_accepted)
        ver_np = _as_counts("num_drafts", num_drafts)
        batch = ver_np.size
        if acc_np.size != batch:
            raise DSparkInputError(f"num_accepted / num_drafts: lengths differ ({acc_np.size} vs {batch})")
        n = self.block_size
        bad = (acc_np < 0) | (acc_np > ver_np) | (ver_np > n)  # accepted >= 0 and <= drafts: drafts >= 0 too
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DSparkInputError(
                f"num_accepted / num_drafts: expected 0 <= accepted <= drafts <= {n}, found "
                f"accepted={acc_np[i]}, drafts={ver_np[i]}"
            )
        if num_proposed is None:
            self.num_draft_tokens += n * batch
        else:
            prop = _as_counts("num_proposed", num_proposed)
            if prop.size != batch or bool(((prop < ver_np) | (prop > n)).any()):
                raise DSparkInputError(
                    f"num_proposed: expected {batch} values with num_drafts <= proposed <= {n}, "
                    f"found {prop.tolist()}"
                )
            self.num_draft_tokens += int(prop.sum())
        self.steps += 1
        self.request_steps += batch
        # table[v][a]: request-steps that verified v drafts and accepted a of them. Position j is verified while
        # j < v, reached while j <= a as well, accepted while j < a
        table = np.bincount(ver_np * (n + 1) + acc_np, minlength=(n + 1) ** 2).reshape(n + 1, n + 1)
        # at_least[v, a]: request-steps with >= v verified and >= a accepted
        at_least = table[::-1, ::-1].cumsum(0).cumsum(1)[::-1, ::-1]
        hist, verified, reached, accepted = (table.sum(0).tolist(), at_least[1:, 0].tolist(),
                                             at_least[np.arange(1, n + 1), np.arange(n)].tolist(),
                                             at_least[0, 1:].tolist())
        for j in range(n):
            self.verified[j] += verified[j]
            self.reached[j] += reached[j]
            self.accepted[j] += accepted[j]
        for k in range(n + 1):
            self.histogram[k] += hist[k]
        if survival is not None:
            a = survival.detach().cpu().numpy() if isinstance(survival, Tensor) else np.asarray(survival)
            if a.shape != (batch, n):
                raise DSparkInputError(f"survival: expected [{batch}, {n}], found {a.shape}")
            depth = np.arange(n)[None, :]
            # a NaN survival adds to no sum and to no bin
            counted = (depth < ver_np[:, None]) & (a == a)
            vals = np.where(counted, a, 0.0)
            for j, v in enumerate(vals.sum(0).tolist()):
                self.predicted[j] += v
            self._predicted_steps += batch
            # bin i holds [edge i, edge i + 1); the last one 1.0 and clamped overshoots: bins x 2 + accepted, and
            # the drafts not counted in a bin of their own past the end
            nb = len(self.reliability)
            bins = np.minimum(np.searchsorted(_INNER_EDGES, vals, side="right"), nb - 1)
            index = np.where(counted, 2 * bins + (depth < acc_np[:, None]), 2 * nb).reshape(-1)
            drafts = np.bincount(index, minlength=2 * nb + 1).tolist()
            sums = np.bincount(index, weights=vals.reshape(-1), minlength=2 * nb + 1).tolist()
            for i, row in enumerate(self.reliability):
                row[0] += drafts[2 * i] + drafts[2 * i + 1]
                row[1] += sums[2 * i] + sums[2 * i + 1]
                row[2] += drafts[2 * i + 1]
        if (confidence is None) != (accept_prob is None):
            raise DSparkInputError("confidence / accept_prob: pass both or neither")
        if confidence is not None and accept_prob is not None:
            if confidence.shape != accept_prob.shape or confidence.dim() != 2 or confidence.shape[0] != batch:
                raise DSparkInputError(
                    f"confidence / accept_prob: expected equal [{batch}, N] shapes, found {tuple(confidence.shape)} "
                    f"and {tuple(accept_prob.shape)}"
                )
            cols = torch.arange(confidence.shape[1], device=confidence.device)
            mask = cols[None, :] < torch.from_numpy(ver_np).to(confidence.device)[:, None]
            err = (confidence.to(torch.float64) - accept_prob.to(torch.float64)).abs()[mask]
            self._conf_abs_err += float(err.sum())
            self._conf_count += int(err.numel())

    # -- derived numbers ------------------------------------------------------------------------------------------
    @property
    def generated_tokens(self) -> int:
        """Tokens emitted = accepted drafts + one correction/bonus token per request-step."""
        return sum(k * n for k, n in enumerate(self.histogram)) + self.request_steps

    @property
    def num_verified_tokens(self) -> int:
        """Draft tokens the target verified (the anchor row of each request-step is not counted)."""
        return sum(self.verified)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def verified_tokens_per_step(self) -> float:
        """Verified draft tokens per batch step (0.0 before any update)."""
        return self.num_verified_tokens / self.steps if self.steps else 0.0

    @property
    def verified_tokens_per_request_step(self) -> float:
        return self.num_verified_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau = generated tokens per request-step (1.0 = no draft ever accepted); 0.0 before any update."""
        return self.generated_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def verification_efficiency(self) -> float:
        """Accepted drafts / verified drafts (0.0 when nothing was verified)."""
        total = sum(self.verified)
        return sum(self.accepted) / total if total else 0.0

    def acceptance_by_position(self) -> list[float]:
        """accepted[j] / verified[j]: the chance that a verified draft at position j is emitted."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted, self.verified)]

    def conditional_acceptance_by_position(self) -> list[float]:
        """accepted[j] / reached[j]: P(d_j accepted | all earlier drafts accepted) — what the confidence head
        predicts."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def predicted_acceptance_by_position(self) -> list[float] | None:
        """predicted[j] / verified[j]: the mean predicted survival of the verified drafts at position j, to hold
        against `acceptance_by_position`; None when no survivals were given."""
        if not self._predicted_steps:
            return None
        return [p / v if v else 0.0 for p, v in zip(self.predicted, self.verified)]

    @property
    def survival_calibration(self) -> float | None:
        """Predicted over accepted drafts, summed over the verified positions (1.0: the survivals the policies rank
        by are calibrated; below 1 they under-predict, and the policies prune drafts worth verifying). None
        without survivals or accepted drafts."""
        total = sum(self.accepted)
        if not self._predicted_steps or not total:
            return None
        return sum(self.predicted) / total

    def survival_reliability(self) -> list[dict[str, float]]:
        """Per survival bin with verified drafts: its edges, the drafts (`n`), their mean survival (`predicted`) and
        the share accepted (`realized`); [] without survivals."""
        edges = RELIABILITY_EDGES
        return [{"lo": edges[i], "hi": edges[i + 1], "n": n, "predicted": p / n, "realized": k / n}
                for i, (n, p, k) in enumerate(self.reliability) if n]

    @property
    def confidence_error(self) -> float | None:
        """Mean |confidence - analytic acceptance| over verified positions, None if never given."""
        return self._conf_abs_err / self._conf_count if self._conf_count else None

    def merge(self, other: AcceptanceStats) -> None:
        """Add another accumulator's counts (e.g. from another DP rank)."""
        if other.block_size != self.block_size:
            raise DSparkInputError(f"other.block_size: expected {self.block_size}, found {other.block_size}")
        self.request_steps += other.request_steps
        for mine, theirs in ((self.histogram, other.histogram), (self.verified, other.verified),
                             (self.reached, other.reached), (self.accepted, other.accepted)):
            for i, v in enumerate(theirs):
                mine[i] += v
        self.num_draft_tokens += other.num_draft_tokens
        self.steps += other.steps
        self._conf_abs_err += other._conf_abs_err
        self._conf_count += other._conf_count
        self.predicted = [a + b for a, b in zip(self.predicted, other.predicted)]
        self._predicted_steps += other._predicted_steps
        for mine, theirs in zip(self.reliability, other.reliability):
            mine[0] += theirs[0]
            mine[1] += theirs[1]
            mine[2] += theirs[2]

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "request_steps": self.request_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_verified_tokens": self.num_verified_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "verified_tokens_per_step": self.verified_tokens_per_step,
            "generated_tokens": self.generated_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "verification_efficiency": self.verification_efficiency,
            "histogram": list(self.histogram),
            "acceptance_by_position": self.acceptance_by_position(),
            "conditional_acceptance_by_position": self.conditional_acceptance_by_position(),
            "confidence_error": self.confidence_error,
            "predicted_acceptance_by_position": self.predicted_acceptance_by_position(),
            "survival_calibration": self.survival_calibration,
            "survival_reliability": self.survival_reliability(),
        }
