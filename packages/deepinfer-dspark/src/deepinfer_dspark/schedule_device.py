"""The verification policies' decision as tensor ops on the drafts' device, planned on the host beforehand
(docs/dspark.md "The decision on the device").

A speculative round reads its drafts and survivals to the host, decides how many drafts each request verifies
(`schedule.schedule_verification`, NumPy) and only then launches the verify step: the device idles through the
decision (0.1-0.28 ms per round on the H200's host, 1-3% of a round). Everything the decision needs besides the
survivals is known before they are: the policy, the carried budget, the step's shape and the latency curve's
prices at its candidate sizes, the calibration map. `plan_schedule` turns that into a `DevicePlan` on the host
(plain floats, a few curve points) while the device still runs the draft pass, `schedule_on_device` enqueues the
decision right behind it, and the round's one host read brings the counts with the drafts.

The decisions are `schedule_verification`'s: the same ranking (descending survival clamped to [0, 1], NaN first,
candidates past max_drafts last, ties in request-major / depth-minor order), the same first maximum of E(K) / T(K)
over the same candidate K, the same prices. On the CPU the float64 sums are taken in the same order and the counts
equal the host's bit for bit; a GPU's scan rounds sums in another order, so the device takes rates (and yields)
within `TIE` (1e-12, relative) of each other as equal and the first of them, as the host takes the first of an
exact tie. It differs from the host only where candidates worth less than 1e-12 of the step's yield decide.

Planned: `verify_all`, `threshold`, the cost policy's allocation of a carried budget (`VerifyPolicy(lagged=True)`,
rounds with sampled rows) and its global argmax (`deterministic=True` or `exact=False`: all-greedy rounds) over a
ragged or unpadded step. Not planned (`plan_schedule` returns None, the host decides): the early-stop search
(`exact=True` with sampled rows and no budget) and padded steps, whose decisions are sequential or per cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError
from deepinfer_dspark.latency import LatencyModel
from deepinfer_dspark.schedule import (
    StepPadding,
    VerifyPolicy,
    _bucket_prices,
    _every_k_seconds,
    _free,
)

__all__ = ["DevicePlan", "plan_schedule", "schedule_on_device"]

KINDS = ("all", "threshold", "top_k", "search")
# relative gap under which two rates, or two expected yields, count as equal: a GPU's scan sums in another order
# than the host's sequential one, so K that tie exactly on the host (candidates worth 0 between them) differ there
# by a few ulps (about 1e-16 per addition); the first of such a tie is taken, as the host does
TIE = 1e-12


@dataclass(frozen=True, eq=False)
class DevicePlan:
    """What `schedule_on_device` computes (`plan_schedule` builds it; module docstring).

    kind: "all" (every request verifies max_drafts), "threshold" (the prefix with survival >= `threshold`),
    "top_k" (the `budget` highest-ranked candidates), "search" (the K of the first maximum of E(K) / T(K) over the
    candidate ends, then its top K).
    search: `ends [E] int64` the candidate K (ascending, the last = every candidate), `starts [E] int64` the
    smallest K whose step costs what ends[i]'s does (a row bucket's first K; = ends for an unbucketed step),
    `seconds [E] float64` the predicted step time at each end, `batch` S (E(K) = S + the K largest priced
    survivals), `price` (x, y) knots of a piecewise-linear non-decreasing map of the survivals (`np.interp`'s
    semantics: the end values held outside the knots, NaN kept), or None."""

    kind: str
    threshold: float = 0.0
    budget: int = 0
    batch: int = 0
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    price: tuple[np.ndarray, np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DSparkInputError(f"DevicePlan.kind: expected one of {KINDS}, found {self.kind!r}")
        if self.kind == "search" and not (self.ends.size == self.starts.size == self.seconds.size > 0):
            raise DSparkInputError(f"DevicePlan: a search needs as many ends, starts and seconds (> 0), found "
                                   f"{self.ends.size}, {self.starts.size}, {self.seconds.size}")


def plan_schedule(
    policy: VerifyPolicy,
    max_drafts: np.ndarray,
    *,
    latency: LatencyModel | None = None,
    base_tokens: int = 0,
    deterministic: bool = False,
    padding: StepPadding | None = None,
    budget: int | None = None,
    price: tuple[np.ndarray, np.ndarray] | None = None,
) -> DevicePlan | None:
    """The plan of `schedule_verification(policy, max_drafts, survival=..., latency=latency, base_tokens=,
    deterministic=, padding=, price=np.interp over `price`)` for survivals not yet known, or None where that
    decision needs the host (module docstring). budget: the cost policy's carried K (`allocate(survival,
    max_drafts, budget)` instead of a search). Host work in plain floats, a few curve points."""
    m = np.asarray(max_drafts, dtype=np.int64)
    if m.ndim != 1 or (m.size and int(m.min()) < 0):
        raise DSparkInputError(f"max_drafts: expected a [B] array of values >= 0, found {m.tolist()}")
    if policy.kind == "verify_all":
        return DevicePlan(kind="all")
    if policy.kind == "threshold":
        return DevicePlan(kind="threshold", threshold=float(policy.threshold))
    count, batch = int(m.sum()), int(m.size)
    if budget is not None:
        if budget < 0:
            raise DSparkInputError(f"budget: expected >= 0, found {budget}")
        return DevicePlan(kind="all") if budget >= count else DevicePlan(kind="top_k", budget=int(budget))
    if latency is None or (padding is not None and not padding.ragged) or (policy.exact and not deterministic):
        return None
    if base_tokens < 0:
        raise DSparkInputError(f"base_tokens: expected >= 0, found {base_tokens}")
    q0 = base_tokens + batch
    prices = _bucket_prices(latency, padding, q0, count)
    # `schedule_verification`'s order: every draft when none is predicted to cost time, or with nothing to rank
    if count == 0 or latency.flat() or _free(m, batch, latency, padding, base_tokens, prices):
        return DevicePlan(kind="all")
    if prices is not None:
        # a bucket's best rate is at its last K (`schedule._ragged`): its ends, and the first K of each bucket
        ends, seconds = prices
        starts = [0] + [e + 1 for e in ends[:-1]]
    else:  # every K priced (an unbucketed step, or one past the largest bucket)
        ends = starts = np.arange(count + 1, dtype=np.int64)
        seconds = _every_k_seconds(latency, padding, q0, count)
    knots = None
    if price is not None:
        x, y = (np.asarray(v, dtype=np.float64) for v in price)
        xs, ys = x.tolist(), y.tolist()
        # in plain floats over the few knots (NaN fails every comparison): this is the round's host time, where
        # each NumPy call costs microseconds in a cold cache (four of them took about 30 us on the CPU engine)
        if (x.ndim != 1 or len(xs) != len(ys) or y.ndim != 1 or not xs or not ys[0] >= 0.0 or not xs[0] <= xs[-1]
                or not all(a < b for a, b in zip(xs, xs[1:])) or not all(a <= b for a, b in zip(ys, ys[1:]))):
            raise DSparkInputError(f"price: expected (x, y) of one length >= 1, x increasing, y non-decreasing and >= "
                                   f"0 (a survival calibration), found {x}, {y}")
        knots = (x, y)
    return DevicePlan(kind="search", batch=batch, ends=np.asarray(ends, dtype=np.int64),
                      starts=np.asarray(starts, dtype=np.int64), seconds=np.asarray(seconds, dtype=np.float64),
                      price=knots)


Upload = Callable[[Sequence[tuple[np.ndarray, torch.dtype]]], list[Tensor]]


def schedule_on_device(plan: DevicePlan, survival: Tensor, max_drafts: Tensor, *,
                       upload: Upload | None = None) -> Tensor:
    """`[B] int64` drafts each request verifies, on survival's device, enqueued without reading anything back.

    survival: `[B, N]` float (`DraftProposal.survival()`); max_drafts: `[B] int64` on the same device, the values
    the plan was made for. upload: copies the plan's host arrays to the device (the engine's pinned staging, one
    non-blocking copy); default `torch.as_tensor(...).to(device)`."""
    if plan.kind == "all":
        return max_drafts.to(torch.int64)
    batch, width = survival.shape
    device = survival.device
    depth = torch.arange(width, device=device)
    valid = depth[None, :] < max_drafts[:, None]
    if plan.kind == "threshold":  # compared in the survivals' dtype, as the host does
        ok = (survival >= plan.threshold) & valid
        return torch.cumprod(ok.to(torch.int64), dim=1).sum(1)
    a = survival.to(torch.float64).clamp(0.0, 1.0)  # NaN stays NaN
    key = torch.where(valid, torch.nan_to_num(a, nan=torch.inf), -torch.inf).reshape(-1)
    ranked, order = torch.sort(key, descending=True, stable=True)
    if plan.kind == "top_k":
        k: Tensor | int = plan.budget
    else:
        k = _search(plan, ranked, upload or _to_device(device))
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    return (rank < k).reshape(batch, width).sum(1)


def _search(plan: DevicePlan, ranked: Tensor, upload: Upload) -> Tensor:
    """`[1] int64` K of a "search" plan from the candidates' keys in ranking order (`schedule._ragged`, `_budget`)."""
    count = int(plan.ends[-1])
    parts = [(plan.ends, torch.int64), (plan.starts, torch.int64), (plan.seconds, torch.float64)]
    if plan.price is not None:
        x, y = plan.price
        # NumPy's own slopes (`np.interp` divides the same way), so the map agrees bit for bit
        parts += [(x, torch.float64), (y, torch.float64), ((y[1:] - y[:-1]) / (x[1:] - x[:-1]), torch.float64)]
    ends, starts, seconds, *knots = upload(parts)
    vals = ranked[:count]  # every valid candidate's key; NaN ranked first as +inf, priced as NaN
    vals = torch.where(torch.isposinf(vals), torch.nan, vals)
    if knots:
        vals = _interp(vals, *knots)
    expected = torch.cat([vals.new_zeros(1), torch.cumsum(vals, 0)]) + plan.batch  # E(K), K = 0 .. count
    # [1]-shaped indices throughout: a 0-d index tensor is read to the host (a sync). The first maximum, up to `TIE`,
    # by a min over the maximal positions (rates tie where the floor prices two K alike and the candidates between
    # them are worth 0; CUDA's argmax does not promise the first of equal values); a NaN rate is handled at the end
    rates = expected[ends] / seconds
    where = torch.arange(rates.numel(), device=rates.device)
    best = torch.where(rates >= rates.max() * (1.0 - TIE), where, rates.numel() - 1).min().reshape(1)
    # the first K of that bucket reaching its end's E up to `TIE` (E does not decrease: the priced values are >= 0),
    # the first maximum over every K
    k = torch.maximum(torch.searchsorted(expected, expected[ends[best]] * (1.0 - TIE)), starts[best])
    # a NaN price (ranked first) makes every E(K > 0) NaN, and the host's argmax stops at the first NaN rate: K = 1
    return torch.where(expected[-1:].isnan(), torch.ones_like(k), k)


def _interp(v: Tensor, x: Tensor, y: Tensor, slopes: Tensor) -> Tensor:
    """`np.interp(v, x, y)` in torch ops, with NumPy's arithmetic (slopes[j] * (v - x[j]) + y[j] for x[j] <= v <
    x[j + 1], slopes[j] = (y[j + 1] - y[j]) / (x[j + 1] - x[j])), so float64 values agree bit for bit: the end
    values outside [x[0], x[-1]], NaN kept (with one knot NumPy gives its value everywhere, NaN included)."""
    if x.numel() == 1:
        return y.expand_as(v).clone()
    j = (torch.searchsorted(x, v, right=True) - 1).clamp(0, x.numel() - 2)
    out = slopes[j] * (v - x[j]) + y[j]
    out = torch.where(v >= x[-1], y[-1], out)
    return torch.where(v < x[0], y[0], out)  # NaN fails both comparisons: stays NaN


def _to_device(device: torch.device) -> Upload:
    return lambda parts: [torch.as_tensor(np.ascontiguousarray(v), dtype=dt).to(device) for v, dt in parts]
