"""How many drafts each request verifies this step: the `verify_all`, `threshold` and `cost` policies, and the
latency model the cost policy reads (docs/dspark.md "Verification policies").

Survival a[b, j] = prod_{k <= j} c[b, k] is the predicted probability that drafts 1..j+1 of request b are all
accepted; verifying j+1 drafts of request b is expected to yield 1 + sum_{i <= j} a[b, i] tokens (the correction /
bonus token always comes). Candidates (b, j) are ranked by a[b, j], non-increasing in j, so every top-K set of the
stable ranking is a prefix per request (ties keep request-major, depth-minor order).

cost: with S requests and K admitted drafts the step processes Q = S + K query tokens and is expected to yield
E(K) = S + (sum of the K largest survivals); its expected time is T(Q) from `LatencyModel`. The policy picks K by
  - exact=True  (default) greedy admission with early stop: K grows while E(K+1)/T(K+1) > E(K)/T(K). Whether a
    draft (b, j) is admitted depends only on candidates ranked before it, i.e. on survivals of OTHER requests and
    on a[b, <= j], which depend on drafts d_1..d_j of b but not on d_{j+1} itself: the choice is non-anticipating
    and rejection sampling stays exact. For an affine T (base + slope * Q) this K is also the global optimum
    (E is concave in K, so E/T is unimodal).
  - exact=False the global argmax of E(K)/T(K) over all K (optimal for any curve, e.g. jagged CUDA-graph buckets)
    but anticipating: with sampling it biases the output unless the survivals that choose K are a round older
    than the drafts (use `cost_budget` on last round's survivals, then `allocate` with this round's).
  - deterministic=True (every request of the step greedy): the drafts are not random, so no choice of K can bias
    the output (greedy verification emits the target's argmax whatever is verified); the global argmax is used.
  The early-stop search reads the greatest convex non-decreasing curve below T (`LatencyModel.host_convex_curve`:
  the lower convex hull of the points, then T'(Q) = min over Q' >= Q): a step over more tokens never takes less
  time, and interference only adds time, so a profiled point above a later one is noise; and with E concave, E/T'
  is unimodal only for a convex T'. A curve with a step up followed by a flat stretch (a kernel's tile boundary:
  on the H200 the testbed's verify forward rose 0.69 ms from 256 to 288 rows, then 0.72 ms more to 768) otherwise
  stops the search at the step, although the flat stretch behind it pays for itself: at 128 requests and
  temperature 1 a fifth of the rounds verified about one draft per request there (docs/perf.md, "DSpark in steady
  state"). Over the hull the step's cost is spread over the stretch behind it, as a global argmax would weigh it.
padded steps (`StepPadding`, a replayed CUDA graph): every sequence of the step is padded to the longest chunk's
  bucket Q (e.g. 1, 2, 4, 6 rows), so the step costs T(batch * Q) and a draft below the longest chunk costs
  nothing. The choice is then a cap c per step (c + 1 a bucket, or the largest max_drafts): each request verifies
  min(max_drafts, c), E(c) = S + (survivals of depth <= c), and the policy maximises E(c) / T(batch * (c + 1)).
  Pruning the top-K candidates instead would lose accepted tokens whenever one request keeps a long chunk, and
  save no time. The same three modes: deterministic / exact=False take the argmax over the caps; exact=True raises
  c bucket by bucket while the rate improves, deciding to admit depths c+1..c' from survivals up to depth c+1 only
  (a_{c+1} depends on the drafts up to d_c, all admitted), the deeper ones extrapolated with each request's last
  conditional confidence: non-anticipating, as above.
ragged steps (`StepPadding(..., ragged=True)`, a replayed ragged CUDA graph): the sequences' rows lie back to back
  and the step's rows round up to the next of `sizes` (total-row buckets), so it costs T(bucket(base + S + K)):
  every draft counts, but only across a bucket boundary. deterministic / exact=False: the argmax of E(K) /
  T(bucket(.)) over all K (always a K that fills a bucket, or all candidates). exact=True: the early-stop search on
  the unbucketed curve picks K, then the candidates ranked next fill the rest of K's bucket (they cost nothing
  more). Non-anticipating: the bucket of K follows from candidates ranked up to K + 1, and a request's candidates
  are ranked in depth order, so a candidate admitted by the fill was decided on survivals of other requests and of
  its own shallower drafts only.
  A curve that is flat within its measured noise (`LatencyModel.flat`) verifies every draft: a rise smaller than
  the noise is no evidence that a larger step costs more, and pruning on it loses accepted tokens for nothing
  (seen on the H200, where a tiny model's step is launch overhead: docs/perf.md, DSpark policies on the H200).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError

__all__ = [
    "FLAT_SIGMAS",
    "POLICIES",
    "LatencyModel",
    "StepPadding",
    "VerifyPolicy",
    "allocate",
    "cost_budget",
    "isotonic",
    "schedule_verification",
]

POLICIES = ("verify_all", "threshold", "cost")
# A curve is flat when its rise stays within this many standard errors of the difference of two of its points
# (about a 0.2% one-sided false-growth rate for Gaussian noise).
FLAT_SIGMAS = 3.0
# LatencyModel.observe: the prior weight that keeps the online growth term at the profile's (in observations at
# sizes one profile span apart)
RIDGE_WEIGHT = 1.0
# survival / max_drafts dtypes the policies read in place on the host (others are copied once)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)


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


@dataclass(frozen=True)
class StepPadding:
    """The shape a verify step runs in when every sequence is padded to a common length (a replayed CUDA graph):
    `batch` sequences (the step's sequences rounded up to a graph batch size, non-speculating ones included) of
    Q rows each, Q = the smallest of `sizes` (ascending tokens-per-sequence buckets) that holds the longest
    chunk (1 + its drafts). The step then costs T(batch * Q) whatever the other chunks verify.

    ragged: the graph lays the sequences' rows back to back instead, and `sizes` are its total-row buckets: a step
    of R rows costs T(the smallest size >= R) (past the largest: T(R), run eagerly)."""

    batch: int
    sizes: tuple[int, ...]
    ragged: bool = False

    def __post_init__(self) -> None:
        sizes = tuple(int(q) for q in self.sizes)
        if not isinstance(self.batch, int) or self.batch < 1:
            raise DSparkConfigError(f"StepPadding.batch: expected an int >= 1, found {self.batch!r}")
        if not sizes or sizes[0] < 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise DSparkConfigError(f"StepPadding.sizes: expected strictly increasing ints >= 1, found {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)

    def rows(self, longest: int) -> int | None:
        """Rows of the padded step whose longest chunk has `longest` tokens (None: no bucket holds it); ragged: the
        rows of a step of `longest` rows in all."""
        for q in self.sizes:
            if q >= longest:
                return q if self.ragged else self.batch * q
        return None

    def bucketed(self, rows: np.ndarray) -> np.ndarray:
        """`[n] int64` the rows ragged steps of `rows` rows run (their buckets; rows past the largest unchanged)."""
        sizes = np.asarray(self.sizes, dtype=np.int64)
        i = np.searchsorted(sizes, rows, side="left")
        return np.where(i < sizes.size, sizes[np.minimum(i, sizes.size - 1)], rows)


@dataclass(frozen=True, kw_only=True)
class VerifyPolicy:
    """kind: one of POLICIES. threshold: survival threshold of `threshold` (verify the prefix with a_j >=
    threshold). exact: `cost` search mode (module docstring)."""

    kind: str = "cost"
    threshold: float = 0.5
    exact: bool = True

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise DSparkConfigError(f"VerifyPolicy.kind: expected one of {POLICIES}, found {self.kind!r}")
        if not isinstance(self.threshold, (int, float)) or not 0.0 <= self.threshold <= 1.0:
            raise DSparkConfigError(f"VerifyPolicy.threshold: expected a float in [0, 1], found {self.threshold!r}")
        if not isinstance(self.exact, bool):
            raise DSparkConfigError(f"VerifyPolicy.exact: expected a bool, found {self.exact!r}")


class LatencyModel:
    """Expected seconds of one target step as a function of its query tokens Q (piecewise linear through the
    profiled points, extrapolated with the last segment's slope), corrected online.

    Mutable runtime state (online-corrected points), so a plain class. `observe(q, seconds)` corrects the profile
    by an affine term a + b q fitted to the errors of the engine's steps (`observe`): the level follows them at
    once, the growth only as far as steps of different sizes show it.
    noise: standard error of one point in seconds (0 = an exact curve, e.g. `affine`); `flat` compares the
    curve's rise with it. overhead: seconds every step spends outside the profiled forward (the draft pass),
    added to every Q: it moves the level of T, not its growth (`observe_overhead`).
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
        self.seconds = seconds
        self.ema = ema
        self.noise = float(noise)
        self.overhead = 0.0
        self.overhead_observations = 0
        self.observations = 0
        self.measured: list[float] | None = None
        self._profile = list(seconds)  # the points before any online correction
        self._sums = [0.0] * 5  # decayed sums of w, w x, w x^2, w e, w x e (x = q / the last size, e = the error)

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
        point) is within FLAT_SIGMAS standard errors of a difference of two points: no evidence that verifying
        more drafts costs more time. An exact curve (noise 0) is flat only when it does not rise at all."""
        rise = self.seconds[-1] - min(self.seconds)
        return rise <= FLAT_SIGMAS * math.sqrt(2.0) * self.noise

    def observe_overhead(self, seconds: float) -> None:
        """Online correction of the per-step time spent outside the profiled forward: the first observation sets
        it (an EMA from 0 would price the first tens of steps as if they had none), later ones move it by `ema`."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise DSparkInputError(f"LatencyModel.observe_overhead: expected seconds >= 0, found {seconds}")
        self.overhead += (1.0 if self.overhead_observations == 0 else self.ema) * (seconds - self.overhead)
        self.overhead_observations += 1

    def _segment(self, q: float) -> tuple[int, float]:
        """(index i of the left point, weight of the right point) for q, clamped to the first / last segment."""
        s = self.sizes
        i = 0
        while i < len(s) - 2 and q > s[i + 1]:
            i += 1
        return i, (q - s[i]) / (s[i + 1] - s[i])

    def _at(self, points: list[float], q: float) -> float:
        """`points` (one per profiled size) interpolated at q, the last segment extrapolated."""
        i, w = self._segment(float(q))
        return max(points[i] + w * (points[i + 1] - points[i]), 1e-12)

    def _forward(self, q: float) -> float:
        return self._at(self.seconds, q)

    def predict(self, q: float) -> float:
        """Seconds of a step of q query tokens: the profiled forward plus the overhead."""
        return self._forward(q) + self.overhead

    def host_curve(self, lo: int, hi: int) -> np.ndarray:
        """`[hi - lo + 1] float64` predicted seconds for Q = lo .. hi (`predict` over a range, in NumPy)."""
        return self.host_at(np.arange(lo, hi + 1, dtype=np.float64))

    def host_at(self, q: np.ndarray) -> np.ndarray:
        """`[n] float64` predicted seconds at the query-token counts `q` (`predict` over an array, in NumPy)."""
        return _interpolate(self.sizes, self.seconds, q) + self.overhead

    def host_convex_curve(self, lo: int, hi: int) -> np.ndarray:
        """`[hi - lo + 1] float64` the greatest convex curve below `predict` (the lower convex hull of the points,
        extended past the first and last with the hull's end slopes, plus the overhead) at Q = lo .. hi."""
        hx: list[float] = []
        hy: list[float] = []
        for x, y in zip(self.sizes, self.seconds):
            # drop the last hull point while it lies on or above the chord from the one before it to (x, y)
            while len(hx) >= 2 and (hy[-1] - hy[-2]) * (x - hx[-2]) >= (y - hy[-2]) * (hx[-1] - hx[-2]):
                hx.pop()
                hy.pop()
            hx.append(float(x))
            hy.append(float(y))
        return _interpolate(hx, hy, np.arange(lo, hi + 1, dtype=np.float64)) + self.overhead

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
        self.seconds = [max(t + a + b * size / sizes[-1], 1e-9) for t, size in zip(prof, sizes)]


def _interpolate(xs: Sequence[float], ys: Sequence[float], q: np.ndarray) -> np.ndarray:
    """`[n] float64` the piecewise-linear curve through (xs, ys) at q, the end segments extended (as
    `LatencyModel._segment`), floored at 1e-12."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    i = np.minimum(np.maximum(np.searchsorted(x, q, side="left") - 1, 0), x.size - 2)
    w = (q - x[i]) / (x[i + 1] - x[i])
    return np.maximum(y[i] + w * (y[i + 1] - y[i]), 1e-12)


def _host_array(x: Tensor | np.ndarray) -> np.ndarray:
    """The values as a NumPy array: the array itself, a view of a CPU tensor (no copy, no device read), else one
    copy (float64 / int64, which hold every value of the narrower dtypes)."""
    if isinstance(x, np.ndarray):
        return x
    if _on_host(x):
        return (x.detach() if x.requires_grad else x).numpy()
    return x.detach().to(torch.float64 if x.dtype.is_floating_point else torch.int64).cpu().numpy()


def _on_host(x: Tensor | np.ndarray) -> bool:
    return isinstance(x, np.ndarray) or (x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES)


def _device(survival: Tensor | np.ndarray | None) -> torch.device:
    return survival.device if isinstance(survival, Tensor) else torch.device("cpu")


def _tensor(values: np.ndarray, device: torch.device) -> Tensor:
    counts = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    return counts if device.type == "cpu" else counts.to(device)


def _check(survival: Tensor | np.ndarray, max_drafts: Sequence[int] | Tensor | np.ndarray) -> np.ndarray:
    """`[B] int64` max_drafts on the host, validated against the `[B, N]` survivals."""
    if isinstance(survival, np.ndarray):
        ok = survival.ndim == 2 and survival.dtype.kind == "f"
    else:
        ok = isinstance(survival, Tensor) and survival.dim() == 2 and survival.dtype.is_floating_point
    if not ok:
        raise DSparkInputError(f"survival: expected a [B, N] float tensor, found {getattr(survival, 'shape', survival)}")
    batch, width = survival.shape
    m = _counts(max_drafts)
    if m.shape != (batch,):
        raise DSparkInputError(f"max_drafts: expected shape ({batch},), found {tuple(m.shape)}")
    if m.size and (int(m.min()) < 0 or int(m.max()) > width):
        raise DSparkInputError(f"max_drafts: expected values in [0, {width}], found {m.tolist()}")
    return m


def _counts(max_drafts: Sequence[int] | Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(_host_array(max_drafts) if isinstance(max_drafts, Tensor) else max_drafts).astype(np.int64)


def _ranked(survival: Tensor | np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates sorted by survival (stable, descending): (values `[C]` float64, request index `[C]` int64).

    On the host: the inputs are a few hundred values and the engine reads them there anyway, so a handful of NumPy
    calls replace tens of torch op launches. A NaN survival ranks first (as in a descending torch sort)."""
    width = survival.shape[1]
    valid = np.arange(width)[None, :] < m[:, None]
    a = _host_array(survival).astype(np.float64)  # a copy; np.clip's wrapper costs more than the two ufuncs
    np.minimum(np.maximum(a, 0.0, out=a), 1.0, out=a)
    a[~valid] = -1.0
    a = a.reshape(-1)
    key = -a
    key[np.isnan(a)] = -np.inf
    order = np.argsort(key, kind="stable")[: int(valid.sum())]
    return a[order], order // max(width, 1)


def _budget(vals: np.ndarray, batch: int, latency: LatencyModel, *, exact: bool, base_tokens: int,
            deterministic: bool) -> int:
    """K over the ranked candidate survivals `vals` (module docstring)."""
    count = vals.size
    if batch == 0 or count == 0:
        return 0
    if latency.flat():  # no measured growth: a pruned draft saves no time (module docstring)
        return count
    expected = np.zeros(count + 1)  # E(K), K = 0..C
    np.cumsum(vals, out=expected[1:])
    expected += batch
    q0 = base_tokens + batch
    if not exact or deterministic:
        return int(np.argmax(expected / latency.host_curve(q0, q0 + count)))  # first maximum of E(K) / T(base + S + K)
    seconds = latency.host_convex_curve(q0, q0 + count)
    rate = expected / np.minimum.accumulate(seconds[::-1])[::-1]
    worse = rate[1:] <= rate[:-1]  # adding candidate K+1 does not improve the rate
    return int(np.argmax(worse)) if bool(worse.any()) else count


def _ragged(vals: np.ndarray, batch: int, latency: LatencyModel, padding: StepPadding, *, exact: bool,
            base_tokens: int, deterministic: bool) -> int:
    """K over the ranked candidate survivals `vals` of a ragged step (module docstring, "ragged steps")."""
    count = vals.size
    if batch == 0 or count == 0 or latency.flat():
        return count
    q0 = base_tokens + batch
    if exact and not deterministic:
        k = _budget(vals, batch, latency, exact=True, base_tokens=base_tokens, deterministic=False)
        return min(count, int(padding.bucketed(np.asarray([q0 + k]))[0]) - q0)
    expected = np.zeros(count + 1)
    np.cumsum(vals, out=expected[1:])
    expected += batch
    sizes = np.asarray(padding.sizes, dtype=np.int64)
    if q0 + count <= sizes[-1] and not np.isnan(expected[-1]):
        # every K lies in a bucket, and within one the time is constant while E(K) does not decrease, so a
        # bucket's best rate is at its last K: the buckets are priced at their ends (a dozen curve points instead
        # of every K; the policy's host time is round time too), and the first K of the first best bucket that
        # reaches its rate is the first maximum over all K, as below
        ends = np.append(sizes[(sizes >= q0) & (sizes - q0 < count)] - q0, count)
        seconds = latency.host_at(padding.bucketed(q0 + ends))
        best = int(np.argmax(expected[ends] / seconds))
        start = int(ends[best - 1]) + 1 if best else 0
        return start + int(np.argmax(expected[start: int(ends[best]) + 1] / seconds[best]))
    rows = padding.bucketed(np.arange(q0, q0 + count + 1, dtype=np.int64))
    lo = int(rows.min())
    seconds = latency.host_curve(lo, int(rows.max()))[rows - lo]
    return int(np.argmax(expected / seconds))  # first maximum


def _padded(survival: Tensor | np.ndarray, m: np.ndarray, latency: LatencyModel, padding: StepPadding, *,
            exact: bool, deterministic: bool) -> np.ndarray:
    """`[B] int64` drafts per request of a padded step (module docstring, "padded steps"): min(max_drafts, c) for
    the cap c of the best bucket."""
    width = survival.shape[1]
    top = int(m.max()) if m.size else 0
    if top == 0 or latency.flat():
        return m
    caps = [c for c in sorted({q - 1 for q in padding.sizes if 0 <= q - 1 < top} | {top})
            if padding.rows(c + 1) is not None]
    if not caps or caps[-1] != top:
        raise DSparkInputError(f"padding: a chunk of {top + 1} tokens fits none of the sizes {padding.sizes}")
    a = _host_array(survival).astype(np.float64)
    a[np.isnan(a)] = 1.0  # ranked first by the unpadded policy too
    np.minimum(np.maximum(a, 0.0, out=a), 1.0, out=a)
    a[np.arange(width)[None, :] >= m[:, None]] = 0.0
    # a handful of NumPy calls on [B, N], then plain floats over the (at most a few) caps
    expected = [float(survival.shape[0])]  # E(c), c = 0..N
    for x in a.sum(0).tolist():
        expected.append(expected[-1] + x)
    seconds = [latency.predict(padding.rows(c + 1)) for c in caps]
    rates = [expected[c] / t for c, t in zip(caps, seconds)]
    if not exact or deterministic:
        return np.minimum(m, caps[rates.index(max(rates))])
    for i in range(len(seconds) - 2, -1, -1):  # the non-decreasing lower envelope, as unpadded
        seconds[i] = min(seconds[i], seconds[i + 1])
    # raising the cap from c to c' admits drafts c+1 .. c' together, on survivals up to draft c+1 only
    # (non-anticipating): the deeper ones are extrapolated with each request's last conditional confidence
    # r = a_{c+1} / a_c, i.e. a_{c+1} (1 + r + ... + r^(n-1)) for the n drafts request b gains
    lo, hi = np.asarray(caps[:-1]), np.asarray(caps[1:])
    first = a[:, lo]
    prev = np.concatenate((np.ones((a.shape[0], 1)), a), 1)[:, lo]
    r = np.divide(first, prev, out=np.zeros_like(first), where=prev > 0)
    n = np.maximum(np.minimum(m[:, None], hi[None, :]) - lo[None, :], 0)
    below = r < 1.0
    series = np.where(below, (1.0 - r**n) / np.where(below, 1.0 - r, 1.0), n)
    gain = (first * series).sum(0).tolist()
    i = 0
    while i + 1 < len(caps) and (expected[caps[i]] + gain[i]) / seconds[i + 1] > expected[caps[i]] / seconds[i]:
        i += 1
    return np.minimum(m, caps[i])


def allocate(
    survival: Tensor | np.ndarray, max_drafts: Sequence[int] | Tensor | np.ndarray, budget: int | Tensor
) -> Tensor:
    """`[B] int64` drafts per request: the `budget` highest-survival candidates (a prefix per request)."""
    m = _check(survival, max_drafts)
    _, req = _ranked(survival, m)
    k = min(int(budget), req.size)
    if k < 0:
        raise DSparkInputError(f"budget: expected >= 0, found {int(budget)}")
    return _tensor(np.bincount(req[:k], minlength=survival.shape[0]), _device(survival))


def cost_budget(
    survival: Tensor | np.ndarray,
    max_drafts: Sequence[int] | Tensor | np.ndarray,
    latency: LatencyModel,
    *,
    exact: bool = True,
    base_tokens: int = 0,
    deterministic: bool = False,
) -> int:
    """K, the number of drafts to verify in the whole batch (module docstring); 0 <= K <= sum(max_drafts).

    base_tokens: query tokens the same step processes besides the S anchors and the K drafts (prefill chunks,
    requests that do not speculate): the step time is T(base_tokens + S + K).
    deterministic: every request is greedy (module docstring): the global argmax, as exact=False."""
    m = _check(survival, max_drafts)
    if base_tokens < 0:
        raise DSparkInputError(f"base_tokens: expected >= 0, found {base_tokens}")
    vals, _ = _ranked(survival, m)
    return _budget(vals, survival.shape[0], latency, exact=exact, base_tokens=base_tokens,
                   deterministic=deterministic)


def schedule_verification(
    policy: VerifyPolicy,
    max_drafts: Sequence[int] | Tensor | np.ndarray,
    *,
    survival: Tensor | np.ndarray | None = None,
    latency: LatencyModel | None = None,
    base_tokens: int = 0,
    deterministic: bool = False,
    padding: StepPadding | None = None,
) -> Tensor:
    """`[B] int64` drafts each request verifies this step (0 .. max_drafts[b]), on survival's device (CPU without
    survivals).

    max_drafts: `[B]` upper bounds per request (block size, or fewer near max_tokens / the context limit).
    survival: `[B, N]` a = cumprod(confidence) (`DraftProposal.survival()`); required by threshold and cost.
    latency: required by cost. base_tokens: the step's other query tokens (`cost_budget`).
    deterministic: every request of the step is greedy (`cost_budget`).
    padding: cost only: the step runs padded (a replayed CUDA graph, `StepPadding`); the policy then picks a cap
    on the drafts of every request (module docstring, "padded steps") and base_tokens is not read (the other
    sequences are in padding.batch); or ragged (`padding.ragged`): the top-K candidates priced by the step's row
    bucket ("ragged steps").

    survival and max_drafts may be NumPy arrays: the engine reads the survivals to the host with the drafts, and
    on the host every policy runs in NumPy and launches one torch op (the result tensor; a CPU tensor's `.numpy()`
    view adds a few no-op dispatches). Survivals on another device: threshold stays there in torch ops (no device
    read); cost reads them once, as its search is sequential anyway.
    """
    if policy.kind == "verify_all":
        m = _counts(max_drafts)
        if m.ndim != 1 or (m.size and int(m.min()) < 0):
            raise DSparkInputError(f"max_drafts: expected a [B] tensor of values >= 0, found {m.tolist()}")
        where = survival if survival is not None else max_drafts if isinstance(max_drafts, Tensor) else None
        return _tensor(m, _device(where))
    if survival is None:
        raise DSparkInputError(f"survival: the {policy.kind!r} policy needs confidences (a Confidence Head), found None")
    m = _check(survival, max_drafts)
    width = survival.shape[1]
    if policy.kind == "threshold":
        if _on_host(survival):
            a = _host_array(survival)
            # compared in the survivals' dtype, as torch compares a tensor with a Python scalar
            ok = (a >= a.dtype.type(policy.threshold)) & (np.arange(width)[None, :] < m[:, None])
            return _tensor(np.logical_and.accumulate(ok, axis=1).sum(1), _device(survival))
        mt = torch.from_numpy(m).to(survival.device)
        ok = (survival >= policy.threshold) & (torch.arange(width, device=survival.device)[None, :] < mt[:, None])
        return torch.cumprod(ok.to(torch.int64), dim=1).sum(1)
    if latency is None:
        raise DSparkInputError("latency: the 'cost' policy needs a LatencyModel, found None")
    if base_tokens < 0:
        raise DSparkInputError(f"base_tokens: expected >= 0, found {base_tokens}")
    if padding is not None and not padding.ragged:
        return _tensor(_padded(survival, m, latency, padding, exact=policy.exact, deterministic=deterministic),
                       _device(survival))
    vals, req = _ranked(survival, m)
    if padding is not None:
        k = _ragged(vals, survival.shape[0], latency, padding, exact=policy.exact, base_tokens=base_tokens,
                    deterministic=deterministic)
    else:
        k = _budget(vals, survival.shape[0], latency, exact=policy.exact, base_tokens=base_tokens,
                    deterministic=deterministic)
    return _tensor(np.bincount(req[:k], minlength=survival.shape[0]), _device(survival))
