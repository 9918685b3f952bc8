"""Online recalibration of the survivals the cost policy prices, per sampling class (docs/dspark.md "Verification
policies").

The Confidence Head is trained towards the acceptance probability of speculative SAMPLING (1 - TV(p_draft,
p_target)) and calibrated offline by per-position temperature scaling (`calibrate.fit_sts`). A greedy request
accepts a draft when it is the target's argmax, another event: on the testbed, greedy drafts whose survival was
0.3-0.5 were accepted about 0% of the time, those at 0.05-0.2 1-5% (docs/perf.md). The cost policy reads survivals
as expected accepted tokens, so at temperature 0 it verified drafts that a fixed cut at 0.5 rightly left out.

`SurvivalCalibration` maps a survival to the acceptance rate the engine has seen at that level, separately for
greedy and sampled rows: per survival bin, the verified drafts and how many were accepted, decayed per round so
the map follows a changing load; the map is the non-decreasing (isotonic) fit of the bins' rates, each bin shrunk
towards the identity by `prior` pseudo-drafts (a bin without data keeps the head's value), interpolated linearly
between the bins' mean survivals. It is monotone, so a request's calibrated survivals stay non-increasing in depth
and the ranking of candidates is the head's, up to ties.

Exactness: the map at a round is fitted to outcomes of earlier rounds only, so a choice priced with it is as
non-anticipating as one priced with the raw survivals (`schedule` module docstring); every verified draft still goes
through exact verification.
"""

from __future__ import annotations

import numpy as np

from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError
from deepinfer_dspark.latency import isotonic

__all__ = ["SurvivalCalibration"]


class SurvivalCalibration:
    """Survival -> observed acceptance, per class (0 = sampled rows, 1 = greedy rows). Mutable runtime state, so a
    plain class.

    bins: equal-width survival bins on [0, 1]. prior: pseudo-drafts per bin at the identity (the head's own value).
    decay: the weight each round keeps of the earlier ones (1 = never forget)."""

    def __init__(self, bins: int = 20, prior: float = 20.0, decay: float = 0.99) -> None:
        if not isinstance(bins, int) or bins < 1:
            raise DSparkConfigError(f"SurvivalCalibration.bins: expected an int >= 1, found {bins!r}")
        if not prior > 0:
            raise DSparkConfigError(f"SurvivalCalibration.prior: expected > 0, found {prior!r}")
        if not 0.0 < decay <= 1.0:
            raise DSparkConfigError(f"SurvivalCalibration.decay: expected in (0, 1], found {decay!r}")
        self.bins, self.prior, self.decay = bins, float(prior), float(decay)
        self._edges = np.linspace(0.0, 1.0, bins + 1)
        self._centers = (self._edges[:-1] + self._edges[1:]) / 2
        # per class and bin: decayed verified drafts, summed survivals, accepted drafts
        self.drafts = np.zeros((2, bins))
        self.survival = np.zeros((2, bins))
        self.accepted = np.zeros((2, bins))
        self._maps: list[tuple[np.ndarray, np.ndarray] | None] = [None, None]

    def update(self, survival: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray,
               greedy: np.ndarray) -> None:
        """One round's outcomes: `survival [B, N]` the head's survivals (before this map), `num_drafts [B]` verified
        and `num_accepted [B]` accepted drafts per request, `greedy [B]` bool. Draft j of request b counts when it
        was verified (j < num_drafts[b]); it was accepted when j < num_accepted[b]. NaN survivals are skipped."""
        a = np.asarray(survival, dtype=np.float64)
        ver, acc = np.asarray(num_drafts, dtype=np.int64), np.asarray(num_accepted, dtype=np.int64)
        g = np.asarray(greedy, dtype=bool)
        if a.ndim != 2 or ver.shape != (a.shape[0],) or acc.shape != ver.shape or g.shape != ver.shape:
            raise DSparkInputError(f"SurvivalCalibration.update: expected survival [B, N] with [B] drafts, accepted "
                                   f"and greedy, found {a.shape}, {ver.shape}, {acc.shape}, {g.shape}")
        depth = np.arange(a.shape[1])[None, :]
        verified = (depth < ver[:, None]) & ~np.isnan(a)
        vals = np.clip(a[verified], 0.0, 1.0)
        index = np.minimum((vals * self.bins).astype(np.int64), self.bins - 1)
        index += self.bins * np.broadcast_to(g[:, None], a.shape)[verified]
        hits = (depth < acc[:, None])[verified]
        size = 2 * self.bins
        if self.decay < 1.0:
            for x in (self.drafts, self.survival, self.accepted):
                x *= self.decay
        self.drafts += np.bincount(index, minlength=size).reshape(2, self.bins)
        self.survival += np.bincount(index, weights=vals, minlength=size).reshape(2, self.bins)
        self.accepted += np.bincount(index, weights=hits, minlength=size).reshape(2, self.bins)
        self._maps = [None, None]

    def curve(self, greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        """(x, y): the map of a class at the bins' mean survivals (the bin centres where no draft was seen),
        interpolated linearly between them (`apply`)."""
        c = int(bool(greedy))
        got = self._maps[c]
        if got is None:
            n = self.drafts[c]
            x = np.where(n > 0, self.survival[c] / np.maximum(n, 1e-300), self._centers)
            rate = (self.accepted[c] + self.prior * x) / (n + self.prior)
            got = self._maps[c] = (x, np.asarray(isotonic(rate.tolist(), (n + self.prior).tolist())))
        return got

    def map(self, values: np.ndarray, greedy: bool) -> np.ndarray:
        """`float64` the calibrated values of survivals of one class, elementwise (any shape; NaN stays NaN). The
        cost policy prices a one-class batch's ranked survivals with it (`cost_budget(price=)`)."""
        x, y = self.curve(greedy)
        # np.interp holds the end values outside the bins' range (as a clip to [0, 1] would) and maps NaN to NaN
        return np.interp(values, x, y)

    def apply(self, survival: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """`[B, N] float64` the calibrated survivals of `survival [B, N]` (rows of each class through its map; NaN
        stays NaN)."""
        a = np.asarray(survival, dtype=np.float64)
        g = np.asarray(greedy, dtype=bool)
        if a.ndim != 2 or g.shape != (a.shape[0],):
            raise DSparkInputError(f"SurvivalCalibration.apply: expected survival [B, N] and greedy [B], found "
                                   f"{a.shape}, {g.shape}")
        greedy_rows = int(np.count_nonzero(g))
        if greedy_rows in (0, g.size):  # one class: the usual batch, one call
            return self.map(a, bool(greedy_rows))
        out = np.empty_like(a)
        for cls in (False, True):
            out[g == cls] = self.map(a[g == cls], cls)
        return out
