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
lagged (`VerifyPolicy(kind="cost", lagged=True)`, the engine's cost policy): a round's policy runs on the host
  between the drafts' read and the target step's launch, where the device waits for it; the search above took
  0.2-0.5 ms per round on the H200's host at 128-256 requests, 1-2% of a round, about what pruning gains on a
  shallow curve (docs/perf.md, "DSpark in steady state"). Lagged, the caller runs the global argmax (exact=False)
  on the previous round's survivals while that round's target step runs, and the round only allocates that many
  drafts by its own survivals (`allocate`: the top-K, a prefix per request). K depends on the previous round's
  drafts only, so the global argmax is non-anticipating at every temperature, and a K that fills a row bucket
  still fills it. A survival cutoff spending the budget instead (tried twice: the previous round's K-th survival
  as a threshold, and the survival between the searched K-th and next candidate, with and without the next-ranked
  candidates filling the count's bucket) loses that: the count above a carried cutoff varies by round and crosses
  row buckets (docs/perf.md, "The policies round by round ...").
  Greedy rounds carry a cutoff instead (below).
greedy rounds (`cost_cutoff`, `allocate_above`): at T = 0 the survivals are bimodal and the number of drafts worth
  verifying changes by about 12% from round to round, which a carried count does not follow; choosing in the round
  follows it (a greedy round's drafts are not random, so its own survivals may choose) but puts the search's host
  time on the round's critical path. The engine carries a price instead: the early-stop search (exact=True, over
  the convex curve) admits a candidate while its value exceeds the current rate times the curve's slope (the
  marginal rule of maximising E/T), so its K on an earlier round's survivals ends at a survival level, and the
  round verifies each request's drafts at or above that level: a threshold's host work, at a level that moves
  with the curve, the load and the calibration. The bucket fill is left out on purpose: a carried level admits a
  count that varies by round, and filling the searched round's bucket would set the level inside the low mode.
  Replayed on recorded greedy rounds it verified as many drafts as the best fixed threshold, at its tokens
  (docs/perf.md, "Greedy rounds by a carried cutoff").
price (`cost_budget`, `schedule_verification`): an elementwise non-decreasing map (the survival calibration of one
  sampling class) applied to the ranked survivals' values; the budget sums the mapped values, and the allocation
  ranks the survivals themselves, so the map's flat stretches do not reorder candidates.
  A curve that is flat within its measured noise (`LatencyModel.flat`) verifies every draft: a rise smaller than
  the noise is no evidence that a larger step costs more, and pruning on it loses accepted tokens for nothing
  (seen on the H200, where a tiny model's step is launch overhead: docs/perf.md, DSpark policies on the H200).
  Likewise a step whose largest choice is predicted to take no longer than any smaller one (`_free`): below the
  latency model's floor, the host's own launch time, a larger forward costs nothing. Both checks come
  before any sort, so a policy whose drafts are all free costs about what verify_all does on the host.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkConfigError, DSparkInputError
from deepinfer_dspark.latency import LatencyModel

__all__ = [
    "POLICIES",
    "StepPadding",
    "VerifyPolicy",
    "allocate",
    "allocate_above",
    "cost_budget",
    "cost_cutoff",
    "schedule_verification",
]

POLICIES = ("verify_all", "threshold", "cost")
# survival / max_drafts dtypes the policies read in place on the host (others are copied once)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)


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
        object.__setattr__(self, "_sizes", np.asarray(sizes, dtype=np.int64))  # for the policy's NumPy reads

    def rows(self, longest: int) -> int | None:
        """Rows of the padded step whose longest chunk has `longest` tokens (None: no bucket holds it); ragged: the
        rows of a step of `longest` rows in all."""
        for q in self.sizes:
            if q >= longest:
                return q if self.ragged else self.batch * q
        return None

    def bucketed(self, rows: np.ndarray) -> np.ndarray:
        """`[n] int64` the rows ragged steps of `rows` rows run (their buckets; rows past the largest unchanged)."""
        sizes = self._sizes
        i = np.searchsorted(sizes, rows, side="left")
        return np.where(i < sizes.size, sizes[np.minimum(i, sizes.size - 1)], rows)


@dataclass(frozen=True, kw_only=True)
class VerifyPolicy:
    """kind: one of POLICIES. threshold: survival threshold of `threshold` (verify the prefix with a_j >=
    threshold). exact: `cost` search mode (module docstring). lagged: `cost` as a caller that runs rounds in a
    loop applies it: each round allocates the budget that the search gave on the previous round's survivals
    (computed while that round's target step runs), so the round itself pays only a ranking's host time (module
    docstring, "lagged"); `schedule_verification` itself ignores the flag."""

    kind: str = "cost"
    threshold: float = 0.5
    exact: bool = True
    lagged: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise DSparkConfigError(f"VerifyPolicy.kind: expected one of {POLICIES}, found {self.kind!r}")
        if not isinstance(self.threshold, (int, float)) or not 0.0 <= self.threshold <= 1.0:
            raise DSparkConfigError(f"VerifyPolicy.threshold: expected a float in [0, 1], found {self.threshold!r}")
        if not isinstance(self.exact, bool):
            raise DSparkConfigError(f"VerifyPolicy.exact: expected a bool, found {self.exact!r}")
        if not isinstance(self.lagged, bool):
            raise DSparkConfigError(f"VerifyPolicy.lagged: expected a bool, found {self.lagged!r}")


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


def _clamped(survival: Tensor | np.ndarray) -> np.ndarray:
    """`[B * N]` the survivals on the host, clamped to [0, 1], flattened (a copy; NaN stays NaN)."""
    return np.minimum(np.maximum(_host_array(survival), 0.0), 1.0).reshape(-1)


def _values(survival: Tensor | np.ndarray, m: np.ndarray) -> np.ndarray:
    """`[C]` the candidates' survivals in ranking order (`_top_counts`) without the order itself: clamped to
    [0, 1], descending, NaN first (as in a descending torch sort). A budget needs only these, and the allocation
    only the K-th of them: a sort of the values, without an argsort's index work and gather, is all the ranking the
    policy's host time pays for (on the host the inputs are a few hundred values, so a handful of NumPy calls
    replace tens of torch op launches)."""
    width = survival.shape[1]
    flat = _clamped(survival)
    if m.size and int(m.min()) < width:
        flat = flat[(np.arange(width)[None, :] < m[:, None]).reshape(-1)]
    return np.sort(flat)[::-1].astype(np.float64)  # NumPy sorts NaN last: first here, as in the ranking


def _ranking(survival: Tensor | np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(vals, key): `[C]` the candidates' survivals in ranking order (`_values`), and the ranking keys of
    `_top_counts` when they are the survivals' own flat view: every candidate valid and every survival in [0, 1]
    (a product of sigmoids; NaN fails both bounds), the usual round. Then the values are a sort of that view and
    nothing else is copied: on the host each NumPy call costs microseconds after the forward has left the caches
    cold, more than its work on a few hundred values, and the policy's host time is round time."""
    width = survival.shape[1]
    a = _host_array(survival)
    if a.size and (not m.size or int(m.min()) >= width):
        ranked = np.sort(a, axis=None)  # flattened, ascending, NaN last: the ends bound every value
        if float(ranked[0]) >= 0.0 and float(ranked[-1]) <= 1.0:
            return ranked[::-1], a.reshape(-1)
    return _values(survival, m), None


def _budget(vals: np.ndarray, batch: int, latency: LatencyModel, *, exact: bool, base_tokens: int,
            deterministic: bool) -> int:
    """K over the ranked candidate survivals `vals` (module docstring)."""
    count = vals.size
    if batch == 0 or count == 0:
        return 0
    if latency.flat():  # no measured growth: a pruned draft saves no time (module docstring)
        return count
    expected = np.zeros(count + 1)  # E(K), K = 0..C
    np.cumsum(vals, dtype=np.float64, out=expected[1:])
    expected += batch
    q0 = base_tokens + batch
    if not exact or deterministic:
        return int(np.argmax(expected / latency.host_curve(q0, q0 + count)))  # first maximum of E(K) / T(base + S + K)
    seconds = latency.host_convex_curve(q0, q0 + count)
    rate = expected / np.minimum.accumulate(seconds[::-1])[::-1]
    worse = rate[1:] <= rate[:-1]  # adding candidate K+1 does not improve the rate
    return int(np.argmax(worse)) if bool(worse.any()) else count


def _ragged(vals: np.ndarray, batch: int, latency: LatencyModel, padding: StepPadding, *, exact: bool,
            base_tokens: int, deterministic: bool, prices: tuple[list[int], list[float]] | None = None) -> int:
    """K over the ranked candidate survivals `vals` of a ragged step (module docstring, "ragged steps"). prices:
    `_bucket_prices` of this step when the caller has them."""
    count = vals.size
    if batch == 0 or count == 0 or latency.flat():
        return count
    q0 = base_tokens + batch
    if exact and not deterministic:
        k = _budget(vals, batch, latency, exact=True, base_tokens=base_tokens, deterministic=False)
        return min(count, int(padding.bucketed(np.asarray([q0 + k]))[0]) - q0)
    total = np.cumsum(vals, dtype=np.float64)  # E(K) = batch + total[K - 1]
    if prices is None:
        prices = _bucket_prices(latency, padding, q0, count)
    if prices is not None and not math.isnan(total[-1]):
        # every K lies in a bucket, and within one the time is constant while E(K) does not decrease, so a
        # bucket's best rate is at its last K: the buckets are priced at their ends (a dozen curve points instead
        # of every K, in plain floats: the policy's host time is round time too), and the first K of the first
        # best bucket that reaches its rate is the first maximum over all K, as below
        ends, seconds = prices
        sums = total[[max(k - 1, 0) for k in ends]].tolist()
        expected = [batch + (x if k else 0.0) for k, x in zip(ends, sums)]
        rates = [e / t for e, t in zip(expected, seconds)]
        best = rates.index(max(rates))
        end = ends[best]
        start = ends[best - 1] + 1 if best else 0
        # the last K adds value: the first maximum is it
        if end == start or expected[best] > batch + (float(total[end - 2]) if end > 1 else 0.0):
            return end
        top = batch + np.concatenate(([0.0], total))[start: end + 1]  # non-decreasing: the first value equal to
        return start + int(np.argmax(top >= top[-1]))  # its end is its first maximum
    expected = batch + np.concatenate(([0.0], total))
    return int(np.argmax(expected / _every_k_seconds(latency, padding, q0, count)))  # first maximum


def _bucket_ends(sizes: tuple[int, ...], q0: int, count: int) -> tuple[list[int], list[int]]:
    """(ends, rows) of a ragged step of q0 rows besides its candidates, count candidates, q0 + count <= the largest
    size: each row bucket's last K (the last one: every candidate) and the rows that bucket runs."""
    inner = [q for q in sizes[bisect.bisect_left(sizes, q0):] if q - q0 < count]
    return [q - q0 for q in inner] + [count], inner + [sizes[bisect.bisect_left(sizes, q0 + count)]]


def _bucket_prices(latency: LatencyModel, padding: StepPadding | None, q0: int,
                   count: int) -> tuple[list[int], list[float]] | None:
    """(ends, seconds): a ragged step's bucket ends (`_bucket_ends`) and the predicted time of each, or None where a
    step is not priced by buckets (unbucketed, or past the largest size). The free check (`_free`) and the search
    read the same dozen predictions: each call on the policy's path costs its time again in a cold cache."""
    if padding is None or not padding.ragged or q0 + count > padding.sizes[-1]:
        return None
    ends, rows = _bucket_ends(padding.sizes, q0, count)
    return ends, latency.predict_each(rows)


def _every_k_seconds(latency: LatencyModel, padding: StepPadding | None, q0: int, count: int) -> np.ndarray:
    """`[count + 1] float64` the predicted time of the step at each K = 0 .. count (its row bucket's, ragged)."""
    rows = np.arange(q0, q0 + count + 1, dtype=np.int64)
    if padding is not None:
        rows = padding.bucketed(rows)
    lo = int(rows.min())
    return latency.host_curve(lo, int(rows.max()))[rows - lo]


def _free(m: np.ndarray, batch: int, latency: LatencyModel, padding: StepPadding | None, base_tokens: int,
          prices: tuple[list[int], list[float]] | None = None) -> bool:
    """Whether verifying every candidate is predicted to take no longer than any smaller choice (module docstring):
    then the largest choice, which yields the most tokens, is best. The curve is piecewise linear, so its least
    value over a range lies at an end or a profiled size; a padded step is priced at its buckets only. Plain
    floats: the policy calls it every round, and the usual answer (the largest step costs more than the smallest)
    takes two predictions. prices: the step's `_bucket_prices` when the caller has them: a ragged step's rows are
    then every bucket from the smallest choice's to the largest's, so the answer is read off them."""
    if prices is not None:
        return prices[1][-1] <= min(prices[1])
    q0 = base_tokens + batch
    q1 = q0 + int(m.sum())
    if padding is None:
        lo, hi, inner = q0, q1, latency.sizes
    elif padding.ragged:
        sizes = padding.sizes
        i, j = bisect.bisect_left(sizes, q0), bisect.bisect_left(sizes, q1)
        lo, hi, inner = (sizes[i] if i < len(sizes) else q0), (sizes[j] if j < len(sizes) else q1), sizes
    else:
        top = int(m.max()) if m.size else 0
        lo, hi = padding.rows(1), padding.rows(top + 1)
        if lo is None or hi is None:
            return False  # `_padded` reports it
        inner = [padding.batch * q for q in padding.sizes]
    end = latency.predict(hi)
    if end > latency.predict(lo):
        return False
    return all(latency.predict(q) >= end for q in inner if lo < q < hi)


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
    k = int(budget)
    if k < 0:
        raise DSparkInputError(f"budget: expected >= 0, found {k}")
    if k >= int(m.sum()):  # every candidate: no ranking (the lagged cost policy's budget on a flat curve)
        return _tensor(m, _device(survival))
    return _tensor(_top_counts(survival, m, k), _device(survival))


def _keys(survival: Tensor | np.ndarray, m: np.ndarray) -> np.ndarray:
    """`[B * N]` the candidates' ranking keys: the survivals clamped to [0, 1], NaN as +inf (ranked first, as in
    `_values`), candidates past max_drafts as -inf (after every valid one). Survivals already in [0, 1] (a
    product of sigmoids, the usual case; NaN fails both bounds) and every candidate valid: the values themselves,
    not copied, at the price of two reductions instead of four elementwise passes."""
    width = survival.shape[1]
    a = _host_array(survival)
    full = not m.size or int(m.min()) >= width
    if full and a.size and float(a.min()) >= 0.0 and float(a.max()) <= 1.0:
        return a.reshape(-1)
    flat = _clamped(survival)
    key = np.where(np.isnan(flat), np.inf, flat)
    if not full:
        key[(np.arange(width)[None, :] >= m[:, None]).reshape(-1)] = -np.inf
    return key


def _top_counts(survival: Tensor | np.ndarray, m: np.ndarray, k: int, kth: float | None = None,
                key: np.ndarray | None = None) -> np.ndarray:
    """`[B] int64` per request its candidates among the top k of the ranking (descending survival, NaN first, ties
    in flat request-major order), 0 <= k < the candidates, without sorting: the k-th largest key (`kth`, else by a
    partition), every key above it, and the first of the keys equal to it in flat order. The engine allocates every
    round, where a full stable argsort was most of the lagged cost policy's host time. key: `_keys` when the
    caller has them (`_ranking`)."""
    batch, width = survival.shape
    if k <= 0:
        return np.zeros(batch, dtype=np.int64)
    if key is None:
        key = _keys(survival, m)
    if kth is None:
        kth = np.partition(key, key.size - k)[key.size - k]
    take = key >= kth
    if int(np.count_nonzero(take)) > k:  # a tie at the boundary: the first of the equal keys in flat order
        take = key > kth
        equal = key == kth
        take |= equal & (np.cumsum(equal) <= k - int(np.count_nonzero(take)))
    return take.reshape(batch, width).sum(1)  # a bool sum: one reduction, where count_nonzero(axis=) takes two


def _search_inputs(
    survival: Tensor | np.ndarray, max_drafts: Sequence[int] | Tensor | np.ndarray, latency: LatencyModel,
    base_tokens: int, padding: StepPadding | None, caller: str,
) -> tuple[np.ndarray, tuple[list[int], list[float]] | None, bool]:
    """(max_drafts on the host, the step's `_bucket_prices`, whether every draft is free) for a search over a
    ragged or unpadded step, its inputs checked (`caller` names it in the padding error)."""
    m = _check(survival, max_drafts)
    if base_tokens < 0:
        raise DSparkInputError(f"base_tokens: expected >= 0, found {base_tokens}")
    if padding is not None and not padding.ragged:
        raise DSparkInputError(f"padding: {caller} ragged steps only; a padded step picks a cap per request "
                               "(schedule_verification)")
    batch, count = survival.shape[0], int(m.sum())
    prices = _bucket_prices(latency, padding, base_tokens + batch, count)
    return m, prices, latency.flat() or _free(m, batch, latency, padding, base_tokens, prices)


def cost_budget(
    survival: Tensor | np.ndarray,
    max_drafts: Sequence[int] | Tensor | np.ndarray,
    latency: LatencyModel,
    *,
    exact: bool = True,
    base_tokens: int = 0,
    deterministic: bool = False,
    padding: StepPadding | None = None,
    price: Callable[[np.ndarray], np.ndarray] | None = None,
) -> int:
    """K, the number of drafts to verify in the whole batch (module docstring); 0 <= K <= sum(max_drafts).

    base_tokens: query tokens the same step processes besides the S anchors and the K drafts (prefill chunks,
    requests that do not speculate): the step time is T(base_tokens + S + K).
    deterministic: every request is greedy (module docstring): the global argmax, as exact=False.
    padding: a ragged step (`StepPadding(..., ragged=True)`): K priced by its row bucket, the K whose top-K
    `schedule_verification(..., padding=padding)` verifies. A padded (non-ragged) step chooses a cap per request,
    not a K: use `schedule_verification`.
    price: an elementwise non-decreasing map from survivals to the values K is priced by (a recalibration,
    `SurvivalCalibration.map` of one sampling class; a batch of two classes passes its calibrated survivals as
    `survival` instead). It is applied to the ranked survivals (`[C] float64`, descending, so its values stay
    ranked) and only when the choice reads them (not on a flat curve or with every draft free): its host time is
    spent only where it matters."""
    m, prices, free = _search_inputs(survival, max_drafts, latency, base_tokens, padding, "cost_budget prices")
    batch, count = survival.shape[0], int(m.sum())
    if free:
        return count  # every draft, unsorted
    vals, _ = _ranking(survival, m)
    if price is not None:
        vals = price(vals)
    if padding is not None:
        return _ragged(vals, batch, latency, padding, exact=exact, base_tokens=base_tokens,
                       deterministic=deterministic, prices=prices)
    return _budget(vals, survival.shape[0], latency, exact=exact, base_tokens=base_tokens,
                   deterministic=deterministic)


def cost_cutoff(
    survival: Tensor | np.ndarray,
    max_drafts: Sequence[int] | Tensor | np.ndarray,
    latency: LatencyModel,
    *,
    base_tokens: int = 0,
    padding: StepPadding | None = None,
    price: Callable[[np.ndarray], np.ndarray] | None = None,
) -> float:
    """The survival cutoff at the cost policy's price of a draft on these survivals (module docstring, "greedy
    rounds"): verifying each request's drafts with survival >= the cutoff (`allocate_above`) verifies on this round
    the K of the early-stop search over the convex curve (exact=True, without the bucket fill), up to ties. 0.0
    where every draft is worth its row (a flat curve, every draft free, or K = every candidate), `math.inf` where
    none is. Arguments as `cost_budget`; padding: ragged or None (a padded step chooses a cap per request)."""
    m, _, free = _search_inputs(survival, max_drafts, latency, base_tokens, padding, "a survival cutoff prices")
    batch = survival.shape[0]
    if free or not m.any():
        return 0.0
    vals, _ = _ranking(survival, m)
    k = _budget(vals if price is None else price(vals), batch, latency, exact=True, base_tokens=base_tokens,
                deterministic=False)
    if k >= vals.size:
        return 0.0
    if k == 0:
        return math.inf
    # between the last admitted and the first refused survival; a NaN survival (ranked first) admits nothing
    # above it on a threshold's comparison, so a boundary at one verifies none of the finite ones
    hi, lo = float(vals[k - 1]), float(vals[k])
    return math.inf if math.isnan(hi) or math.isnan(lo) else (hi + lo) / 2


def allocate_above(
    survival: Tensor | np.ndarray, max_drafts: Sequence[int] | Tensor | np.ndarray, cutoff: float
) -> Tensor:
    """`[B] int64` drafts per request: the longest prefix (within max_drafts) whose survivals are >= `cutoff` (a
    `cost_cutoff` carried from an earlier round): a threshold's work on the host, on survival's device."""
    m = _check(survival, max_drafts)
    c = float(cutoff)
    if math.isnan(c) or c < 0.0:
        raise DSparkInputError(f"cutoff: expected a survival >= 0 (or inf), found {cutoff!r}")
    return _above(survival, m, c)


def _above(survival: Tensor | np.ndarray, m: np.ndarray, cutoff: float) -> Tensor:
    """`[B] int64` per request the longest prefix (within m) of drafts whose survival is >= cutoff."""
    width = survival.shape[1]
    if _on_host(survival):
        a = _host_array(survival)
        # compared in the survivals' dtype, as torch compares a tensor with a Python scalar
        ok = a >= a.dtype.type(cutoff)
        if m.size and int(m.min()) < width:
            ok &= np.arange(width)[None, :] < m[:, None]
        return _tensor(np.logical_and.accumulate(ok, axis=1).sum(1), _device(survival))
    mt = torch.from_numpy(m).to(survival.device)
    ok = (survival >= cutoff) & (torch.arange(width, device=survival.device)[None, :] < mt[:, None])
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(1)


def schedule_verification(
    policy: VerifyPolicy,
    max_drafts: Sequence[int] | Tensor | np.ndarray,
    *,
    survival: Tensor | np.ndarray | None = None,
    latency: LatencyModel | None = None,
    base_tokens: int = 0,
    deterministic: bool = False,
    padding: StepPadding | None = None,
    price: Callable[[np.ndarray], np.ndarray] | None = None,
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
    price: cost only: an elementwise non-decreasing map from survivals to the values the choice is priced by
    (`cost_budget`); the allocation ranks the survivals themselves, so the map's flat stretches (ties) do not
    reorder candidates.

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
    if policy.kind == "threshold":
        return _above(survival, m, policy.threshold)
    if latency is None:
        raise DSparkInputError("latency: the 'cost' policy needs a LatencyModel, found None")
    if base_tokens < 0:
        raise DSparkInputError(f"base_tokens: expected >= 0, found {base_tokens}")
    device = _device(survival)
    batch = survival.shape[0]
    prices = _bucket_prices(latency, padding, base_tokens + batch, int(m.sum()))
    if _free(m, batch, latency, padding, base_tokens, prices):
        return _tensor(m, device)  # every draft, unsorted
    survival = _host_array(survival)  # one read of survivals on another device
    if padding is not None and not padding.ragged:
        priced = survival if price is None else price(np.asarray(survival, dtype=np.float64))
        return _tensor(_padded(priced, m, latency, padding, exact=policy.exact, deterministic=deterministic), device)
    vals, key = _ranking(survival, m)
    priced = vals if price is None else price(vals)  # still descending: the map does not decrease
    if padding is not None:
        k = _ragged(priced, batch, latency, padding, exact=policy.exact, base_tokens=base_tokens,
                    deterministic=deterministic, prices=prices)
    else:
        k = _budget(priced, batch, latency, exact=policy.exact, base_tokens=base_tokens,
                    deterministic=deterministic)
    if k >= vals.size:  # every candidate (vals holds the valid ones)
        return _tensor(m, device)
    # the ranked survivals give the allocation's k-th key without a partition
    kth = float(vals[k - 1]) if k > 0 and not math.isnan(vals[k - 1]) else None
    return _tensor(_top_counts(survival, m, k, kth, key), device)
