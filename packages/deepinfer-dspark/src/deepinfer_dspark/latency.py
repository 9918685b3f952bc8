"""The cost policy's price of a verify step: `LatencyModel`, the expected seconds of a target step over Q query
tokens, profiled at start-up and corrected online (docs/dspark.md "Verification policies")."""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError

__all__ = ["FLAT_SIGMAS", "LatencyModel", "isotonic"]

# A curve is flat when its rise stays within this many standard errors of the difference of two of its points
# (about a 0.2% one-sided false-growth rate for Gaussian noise).
FLAT_SIGMAS = 3.0
# LatencyModel.observe: the prior weight that keeps the online growth term at the profile's (in observations at
# sizes one profile span apart)
RIDGE_WEIGHT = 1.0

def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent violators): each run
    of points that decreases is replaced by its weighted mean. A running max would instead carry one noisy peak
    into every later point."""
    w = [1.0] * len(values) if weights is None else [float(x) for x in weights]
    if len(w) != len(values) or any(not x > 0 for x in w):
        raise DSparkConfigError(f"isotonic: expected {len(values)} positive weights, found {w}")
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, x in zip(values, w):
        blocks.append([float(v), x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


class LatencyModel:
    """Expected seconds of one target step as a function of its query tokens Q (piecewise linear through the
    profiled points, extrapolated with the last segment's slope), corrected online.

    Mutable runtime state (online-corrected points), so a plain class. `observe(q, seconds)` corrects the profile
    by an affine term a + b q fitted to the errors of the engine's steps (`observe`): the level follows them at
    once, the growth only as far as steps of different sizes show it.
    noise: standard error of one point in seconds (0 = an exact curve, e.g. `affine`); `flat` compares the
    curve's rise with it. overhead: seconds every step spends outside the profiled forward (the draft pass),
    added to every Q: it moves the level of T, not its growth (`observe_overhead`).
    floor: seconds the host itself spends between the forward's launch and the round's read (launching the forward
    and the verification, the lagged search; `observe_floor`). The device runs the forward while the host does
    that work, so a forward shorter than the floor costs no time: T(Q) = overhead + max(floor, forward(Q)). On the
    H200 the testbed's launch phase (2.5-5 ms) outlasts its forward at 32 requests, where a round took the same
    time whatever a policy verified; priced by the forward alone, the cost policy pruned drafts that were free.
    measured: the raw per-size statistics of a profile before the non-decreasing fit (None otherwise).
    """

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], *, ema: float = 0.05,
                 noise: float = 0.0) -> None:
        sizes, seconds = [int(s) for s in sizes], [float(t) for t in seconds]
        if len(sizes) < 2 or len(sizes) != len(seconds):
            raise DSparkConfigError(
                f"LatencyModel: expected >= 2 (size, seconds) points of equal count, found {len(sizes)} sizes and "
                f"{len(seconds)} times"
            )
        if any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] < 1:
            raise DSparkConfigError(f"LatencyModel.sizes: expected strictly increasing ints >= 1, found {sizes}")
        if any(not (t > 0 and math.isfinite(t)) for t in seconds):
            raise DSparkConfigError(f"LatencyModel.seconds: expected finite times > 0, found {seconds}")
        if not 0.0 <= ema <= 1.0:
            raise DSparkConfigError(f"LatencyModel.ema: expected a float in [0, 1], found {ema!r}")
        if not (noise >= 0 and math.isfinite(noise)):
            raise DSparkConfigError(f"LatencyModel.noise: expected finite seconds >= 0, found {noise!r}")
        self.sizes = sizes
        self._x = np.asarray(sizes, dtype=np.float64)  # the points as arrays, for the policy's NumPy reads
        self.seconds = seconds
        self.ema = ema
        self.noise = float(noise)
        self.overhead = 0.0
        self.overhead_observations = 0
        self.floor = 0.0
        self.floor_observations = 0
        self.observations = 0
        self.measured: list[float] | None = None
        self._profile = list(seconds)  # the points before any online correction
        self._correction = (0.0, 0.0)  # (a, b) of the online correction: points = profile + a + b * size / last
        self._hull: np.ndarray | None = None  # the profile's lower convex hull at Q = 0 .. last (`host_convex_curve`)
        self._hull_points: tuple[list[int], list[float]] = ([], [])  # its vertices, for Q past the last size
        self._sums = [0.0] * 5  # decayed sums of w, w x, w x^2, w e, w x e (x = q / the last size, e = the error)

    @property
    def seconds(self) -> list[float]:
        """The curve's points (the profile's, online-corrected), one per size."""
        return self._seconds

    @seconds.setter
    def seconds(self, values: list[float]) -> None:
        self._seconds = list(values)
        self._y = np.asarray(self._seconds, dtype=np.float64)

    @classmethod
    def affine(cls, base: float, per_token: float, max_tokens: int, *, ema: float = 0.05) -> LatencyModel:
        """T(Q) = base + per_token * Q (two points, exact extrapolation)."""
        return cls([1, max(2, max_tokens)], [base + per_token, base + per_token * max(2, max_tokens)], ema=ema)

    @classmethod
    def profile(
        cls,
        step: Callable[[int], object],
        sizes: Sequence[int],
        *,
        warmup: int = 1,
        repeats: int = 5,
        timer: Callable[[], float] = time.perf_counter,
        ema: float = 0.05,
    ) -> LatencyModel:
        """Time `step(q)` (a target forward over q query tokens, synchronised by the caller) at each size.

        `warmup` untimed calls per size first, then `repeats` rounds that each time every size once (interleaved,
        so a slow spell of the machine hits all sizes alike instead of one). Per size the median (robust to a
        stray slow call); the curve is the isotonic (non-decreasing) fit of the medians, since a larger verify
        step is never cheaper. noise = the larger of the medians' standard error (from the per-size median
        absolute deviation) and the scatter of the medians around the fit (a curve that goes down and up again is
        noise too)."""
        if repeats < 1 or warmup < 0:
            raise DSparkConfigError(f"LatencyModel.profile: expected repeats >= 1, warmup >= 0, found {repeats}, {warmup}")
        sizes = [int(q) for q in sizes]
        for q in sizes:
            for _ in range(warmup):
                step(q)
        runs: list[list[float]] = [[] for _ in sizes]
        for _ in range(repeats):
            for i, q in enumerate(sizes):
                t0 = timer()
                step(q)
                runs[i].append(timer() - t0)
        med = [max(statistics.median(r), 1e-9) for r in runs]
        fit = isotonic(med)
        # 1.4826 MAD estimates a Gaussian sigma; the median of r samples has about 1.2533 sigma / sqrt(r) error
        sigma = statistics.median(1.4826 * statistics.median([abs(x - m) for x in r]) for r, m in zip(runs, med))
        within = 1.2533 * sigma / math.sqrt(repeats)
        scatter = math.sqrt(statistics.fmean((m - f) ** 2 for m, f in zip(med, fit)))
        model = cls(sizes, fit, ema=ema, noise=max(within, scatter))
        model.measured = med
        return model

    def flat(self) -> bool:
        """True when the curve's rise over its points (the non-decreasing lower envelope's last minus first
        point, both raised to the floor) is within FLAT_SIGMAS standard errors of a difference of two points: no
        evidence that verifying more drafts costs more time. An exact curve (noise 0) is flat only when it does not
        rise at all."""
        rise = max(self.seconds[-1], self.floor) - max(min(self.seconds), self.floor)
        return rise <= FLAT_SIGMAS * math.sqrt(2.0) * self.noise

    def observe_overhead(self, seconds: float) -> None:
        """Online correction of the per-step time spent outside the profiled forward: the first observation sets
        it (an EMA from 0 would price the first tens of steps as if they had none), later ones move it by `ema`."""
        self.overhead, self.overhead_observations = self._follow(
            "observe_overhead", self.overhead, self.overhead_observations, seconds)

    def observe_floor(self, seconds: float) -> None:
        """Online estimate of the floor (class docstring): the host's own seconds from the forward's launch to the
        round's read, before it waits for the device. Set by the first observation, then moved by `ema`, as the
        overhead. Only a device that runs asynchronously to the host has one (on the CPU the forward is host work)."""
        self.floor, self.floor_observations = self._follow("observe_floor", self.floor, self.floor_observations,
                                                           seconds)

    def _follow(self, name: str, value: float, count: int, seconds: float) -> tuple[float, int]:
        """(value, count) after one observation: the first sets the value, later ones move it by `ema`."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise DSparkInputError(f"LatencyModel.{name}: expected seconds >= 0, found {seconds}")
        return value + (1.0 if count == 0 else self.ema) * (seconds - value), count + 1

    def _at_each(self, points: list[float], qs: Sequence[float]) -> list[float]:
        """`points` (one per profiled size) interpolated at each q, the end segments extended, floored at 1e-12; in
        plain floats: the cost policy prices a dozen row buckets per round, where NumPy's per-call overhead exceeds
        the work."""
        s, last, out = self.sizes, len(self.sizes) - 2, []
        for q in qs:
            i = min(max(bisect.bisect_left(s, q) - 1, 0), last)  # the first i with q <= s[i + 1], as searchsorted
            w = (q - s[i]) / (s[i + 1] - s[i])
            out.append(max(points[i] + w * (points[i + 1] - points[i]), 1e-12))
        return out

    def _at(self, points: list[float], q: float) -> float:
        return self._at_each(points, (float(q),))[0]

    def forward(self, q: float) -> float:
        """Seconds of the forward of a step of q query tokens (the online-corrected profile), without the floor
        and the overhead."""
        return self._at(self.seconds, q)

    def predict(self, q: float) -> float:
        """Seconds of a step of q query tokens: the forward or the floor, whichever is longer, plus the overhead."""
        return max(self.forward(q), self.floor) + self.overhead

    def predict_each(self, qs: Sequence[int]) -> list[float]:
        """`predict` at each of a few step sizes (`_at_each`)."""
        floor, overhead = self.floor, self.overhead
        return [max(f, floor) + overhead for f in self._at_each(self.seconds, qs)]

    def host_curve(self, lo: int, hi: int) -> np.ndarray:
        """`[hi - lo + 1] float64` predicted seconds for Q = lo .. hi (`predict` over a range, in NumPy)."""
        return self.host_at(np.arange(lo, hi + 1, dtype=np.float64))

    def host_at(self, q: np.ndarray) -> np.ndarray:
        """`[n] float64` predicted seconds at the query-token counts `q` (`predict` over an array, in NumPy)."""
        return np.maximum(_interpolate(self._x, self._y, q), self.floor) + self.overhead

    def host_convex_curve(self, lo: int, hi: int) -> np.ndarray:
        """`[hi - lo + 1] float64` the greatest convex curve below `predict` (the lower convex hull of the points,
        extended past the first and last with the hull's end slopes, raised to the floor, plus the overhead) at
        Q = lo .. hi (the maximum of a convex curve and a constant is convex).

        The policy reads it every round, so the profile's hull is evaluated once at every Q up to the last size
        and kept; the online correction adds an affine term to every point (`observe`), and adding an affine
        function keeps which points lie on the lower hull, so the corrected hull is the kept one plus that term."""
        last = self.sizes[-1]
        if self._hull is None:
            xs, ys, hull = self.sizes, self._profile, []
            for j in range(len(xs)):
                # drop the last vertex while it lies on or above the chord from the one before it to point j
                while len(hull) >= 2 and ((ys[hull[-1]] - ys[hull[-2]]) * (xs[j] - xs[hull[-2]])
                                          >= (ys[j] - ys[hull[-2]]) * (xs[hull[-1]] - xs[hull[-2]])):
                    hull.pop()
                hull.append(j)
            self._hull_points = ([xs[j] for j in hull], [ys[j] for j in hull])
            self._hull = _interpolate(*self._hull_points, np.arange(last + 1, dtype=np.float64))
        q = np.arange(lo, hi + 1, dtype=np.float64)
        base = self._hull[lo: hi + 1] if 0 <= lo and hi <= last else _interpolate(*self._hull_points, q)
        a, b = self._correction
        return np.maximum(base + a + (b / last) * q, max(self.floor, 1e-12)) + self.overhead

    def fresh(self) -> LatencyModel:
        """A copy of the profiled curve (points, noise, raw medians, ema) without any online correction, floor or
        observations: what a new engine would start from."""
        model = LatencyModel(self.sizes, self._profile, ema=self.ema, noise=self.noise)
        model.measured = None if self.measured is None else list(self.measured)
        return model

    def curve(self, max_tokens: int, device: torch.device | str = "cpu") -> Tensor:
        """`[max_tokens + 1] float64` predicted seconds for Q = 0 .. max_tokens (entry 0 unused by the policies)."""
        return torch.from_numpy(self.host_curve(0, max_tokens)).to(device)

    def observe(self, q: int, seconds: float) -> None:
        """Online correction with one measured step of q query tokens (the span the engine times: the forward as
        profiled plus its input preparation and the verification, without the overhead).

        The points become the profile's plus a + b q, the ridge least-squares fit of the errors e = seconds -
        profile(q) of the observations so far, each weighted (1 - ema)^age (ema = 0: no correction), with a
        penalty of RIDGE_WEIGHT observations on b (q in units of the last profiled size). Steps of one size fit
        the level only (b = 0); steps of several sizes (the engine's exploration rounds verify every draft)
        fit growth too, shrunk towards the profile's. Why not move the points around q (an earlier version): the
        steps a policy runs cluster at a few sizes, and the span's part outside the profiled forward, which hardly
        grows with q, then became growth at the edge of those sizes (on the H200 a false rise of about 60 us per
        row at 64 rows, where the profile had 3), and the cost policy pruned drafts that paid for themselves.
        A step past the last profiled size is counted but not fitted: verify-shaped steps stay within the profile
        (it reaches the largest verify step the scheduler makes), so such a step carries prefill rows, whose cost
        the profile does not model, and at that distance one of them would set the fitted growth alone."""
        if not (seconds > 0 and math.isfinite(seconds)) or q < 1:
            raise DSparkInputError(f"LatencyModel.observe: expected q >= 1 and seconds > 0, found {q}, {seconds}")
        self.observations += 1
        if self.ema == 0.0 or q > self.sizes[-1]:
            return
        x = q / self.sizes[-1]
        sizes, prof = self.sizes, self._profile
        e = seconds - self._at(prof, q)
        keep = 1.0 - self.ema
        self._sums = [s * keep + v for s, v in zip(self._sums, (1.0, x, x * x, e, x * e))]
        s0, s1, s2, se, sxe = self._sums
        mx, me = s1 / s0, se / s0
        b = (sxe - s1 * me) / (s2 - s1 * mx + RIDGE_WEIGHT)
        a = me - b * mx
        self._correction = (a, b)
        self.seconds = [max(t + a + b * size / sizes[-1], 1e-9) for t, size in zip(prof, sizes)]


def _interpolate(xs: Sequence[float], ys: Sequence[float], q: np.ndarray) -> np.ndarray:
    """`[n] float64` the piecewise-linear curve through (xs, ys) at q, the end segments extended (as
    `LatencyModel._at_each`), floored at 1e-12."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    i = np.minimum(np.maximum(np.searchsorted(x, q, side="left") - 1, 0), x.size - 2)
    w = (q - x[i]) / (x[i + 1] - x[i])
    return np.maximum(y[i] + w * (y[i + 1] - y[i]), 1e-12)
