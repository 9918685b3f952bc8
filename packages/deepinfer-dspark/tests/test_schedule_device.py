"""The decision on the device (`schedule_on_device` over a `plan_schedule`) against the host policies it stands
for (`schedule_verification`, `allocate`): the same drafts per request on random and degenerate survivals (ties,
NaN, values outside [0, 1], requests with fewer or no drafts), curves (affine, jagged, flat, floors, steps past
the last bucket) and calibration maps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from deepinfer_dspark import (
    DevicePlan,
    DSparkInputError,
    LatencyModel,
    StepPadding,
    VerifyPolicy,
    allocate,
    plan_schedule,
    schedule_on_device,
    schedule_verification,
)
from torch.utils._python_dispatch import TorchDispatchMode


class _NoReads(TorchDispatchMode):
    """Fails on any op that reads a tensor's value to the host (on a GPU: a sync that would stall the round)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"a host read in the device decision: {func}")
        return func(*args, **(kwargs or {}))


def _decide(plan: DevicePlan, survival: torch.Tensor, max_drafts: torch.Tensor) -> torch.Tensor:
    with _NoReads():
        return schedule_on_device(plan, survival, max_drafts)


def _survivals(rng: random.Random, batch: int, width: int) -> torch.Tensor:
    style = rng.choice(["spread", "coarse", "bimodal", "nan", "outside"])
    if style == "spread":
        c = torch.rand(batch, width, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    elif style == "coarse":  # few distinct values: ties across requests and depths
        c = torch.tensor([[rng.choice([0.0, 0.5, 1.0]) for _ in range(width)] for _ in range(batch)])
    elif style == "bimodal":  # greedy rounds: confident drafts and hopeless ones
        c = torch.tensor([[rng.choice([rng.uniform(0.9, 1.0), rng.uniform(0.0, 0.1)]) for _ in range(width)]
                          for _ in range(batch)])
    elif style == "nan":
        c = torch.tensor([[float("nan") if rng.random() < 0.05 else rng.random() for _ in range(width)]
                          for _ in range(batch)])
    else:  # a head whose values leave [0, 1] (clamped by the ranking: ties at the ends)
        c = torch.tensor([[rng.uniform(-0.2, 1.3) for _ in range(width)] for _ in range(batch)])
    return torch.cumprod(c.reshape(batch, width).float(), dim=1) if style != "outside" else c.reshape(batch, width)


def _curve(rng: random.Random, top: int) -> LatencyModel:
    style = rng.choice(["affine", "steep", "profiled", "flat"])
    if style == "affine":
        lat = LatencyModel.affine(rng.uniform(1e-3, 2e-2), rng.uniform(1e-6, 1e-4), max(top, 2))
    elif style == "steep":
        lat = LatencyModel.affine(rng.uniform(1e-3, 5e-3), rng.uniform(1e-4, 2e-3), max(top, 2))
    elif style == "flat":
        lat = LatencyModel.affine(5e-3, 0.0, max(top, 2))
    else:  # steps and plateaus, as a bucketed profile shows them
        sizes = sorted(rng.sample(range(1, max(top, 10) + 1), rng.randint(2, 6)))
        lat = LatencyModel(sizes, [4e-3 + 2e-5 * s + rng.choice([0.0, 1e-3]) * rng.random() for s in sizes])
    if rng.random() < 0.5:
        lat.observe_overhead(rng.uniform(0.0, 5e-3))
    if rng.random() < 0.3:
        lat.observe_floor(rng.choice([0.5, 1.0, 1.5]) * lat.forward(max(top // 2, 1)))
    return lat


def _price(rng: random.Random) -> tuple[np.ndarray, np.ndarray] | None:
    if rng.random() < 0.3:
        return None
    n = rng.choice([1, 2, 5, 20])
    x = np.sort(np.asarray(rng.sample(range(1, 1000), n), dtype=np.float64) / 1000)
    y = np.sort(np.asarray([rng.choice([0.0, 0.3, rng.random()]) for _ in range(n)]))  # flat stretches: ties
    return x, y


@pytest.mark.parametrize("seed", range(3))
def test_device_decisions_equal_the_host_policies(seed: int) -> None:
    _compare_with_the_host(random.Random(77 + seed), torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_device_decisions_equal_the_host_policies() -> None:
    """On CUDA: the sort, the scan and the reductions of another backend. Its scan sums in another order, so K that
    tie exactly on the host (zero-valued candidates between them, a floor pricing them alike) differ by ulps there:
    the device takes ties within `TIE` and their first, as the host does with exact ones (such a case failed before:
    3 drafts for a request where the host verified 1)."""
    for seed in range(3):
        _compare_with_the_host(random.Random(77 + seed), torch.device("cuda"))


def _parallel_cumsum(x: torch.Tensor, dim: int = 0, **kw) -> torch.Tensor:
    """A cumulative sum associated as a parallel (Hillis-Steele) scan does, each prefix a tree of its own, not left
    to right: the same sums, rounded differently."""
    y, step = x.clone(), 1
    while step < y.shape[0]:
        y = torch.cat([y[:step], y[step:] + y[:-step]])
        step *= 2
    return y


def test_decisions_survive_a_scan_rounded_in_another_order(monkeypatch) -> None:
    """The host's exact ties become ulp-level differences under another summation order (what failed on CUDA): the
    decisions still equal the host's, and without the tie tolerance they would not."""
    from deepinfer_dspark import schedule_device

    monkeypatch.setattr(torch, "cumsum", _parallel_cumsum)
    for seed in range(3):
        _compare_with_the_host(random.Random(77 + seed), torch.device("cpu"))
    monkeypatch.setattr(schedule_device, "TIE", 0.0)
    with pytest.raises(AssertionError):
        for seed in range(3):
            _compare_with_the_host(random.Random(77 + seed), torch.device("cpu"))


def _compare_with_the_host(rng: random.Random, device: torch.device) -> None:
    planned = {"all": 0, "threshold": 0, "top_k": 0, "search": 0}
    for _ in range(70):
        batch, width = rng.choice([1, 2, 3, 7, 16, 64, 200]), rng.choice([1, 2, 5, 5])
        host_surv = _survivals(rng, batch, width)
        m = np.asarray([rng.choice([width, width, rng.randint(0, width)]) for _ in range(batch)], dtype=np.int64)
        m_dev, surv = torch.from_numpy(m.copy()).to(device), host_surv.to(device)
        base = rng.choice([0, 0, 2, 40])
        top = base + batch * (width + 1)
        lat = _curve(rng, top + 1)
        # row buckets that hold the step, and ones it outgrows (priced per K past the largest)
        sizes = tuple(range(batch, top + rng.choice([4, -batch]), rng.choice([1, 4, 16])))
        padding = rng.choice([None, StepPadding(8, sizes, ragged=True)]) if sizes and sizes[0] >= 1 else None
        knots = _price(rng)
        price = None if knots is None else (lambda v, k=knots: np.interp(v, *k))
        host = host_surv.numpy()
        for policy in (VerifyPolicy(kind="cost", exact=False), VerifyPolicy(kind="cost")):
            plan = plan_schedule(policy, m, latency=lat, base_tokens=base, deterministic=True, padding=padding,
                                 price=knots)
            want = schedule_verification(policy, m, survival=host, latency=lat, base_tokens=base,
                                         deterministic=True, padding=padding, price=price)
            got = _decide(plan, surv, m_dev)
            assert got.dtype == torch.int64 and got.tolist() == want.tolist(), (plan.kind, surv, m, base, padding)
            planned[plan.kind] += 1
        for budget in (0, 1, int(m.sum()) // 3, int(m.sum()), int(m.sum()) + 2):
            plan = plan_schedule(VerifyPolicy(kind="cost", lagged=True), m, latency=lat, budget=budget)
            assert _decide(plan, surv, m_dev).tolist() == allocate(host, m, budget).tolist()
            planned[plan.kind] += 1
        finite = [float(v) for v in host_surv.flatten().tolist() if v == v]
        for t in (0.0, 1.0, 0.5, *rng.sample(finite, min(2, len(finite)))):
            pol = VerifyPolicy(kind="threshold", threshold=min(max(t, 0.0), 1.0))
            plan = plan_schedule(pol, m)
            got = _decide(plan, surv, m_dev)
            assert got.tolist() == schedule_verification(pol, m, survival=host).tolist(), (t, surv, m)
            planned[plan.kind] += 1
        assert schedule_on_device(plan_schedule(VerifyPolicy(kind="verify_all"), m), surv, m_dev).tolist() == \
            m.tolist()
    # every kind of plan was exercised, searches most
    assert min(planned.values()) > 20 and planned["search"] > 60, planned


def test_a_search_picks_the_bucket_that_pays_and_its_first_k() -> None:
    """Hand-checked: 4 requests of 5 drafts on a curve whose 8-row buckets cost the same inside; the first two
    requests' drafts are sure, the others' worthless. E(K) = 4 + min(K, 10); T = 1 + 0.1 per bucket of 8 rows
    (Q = 4 + K), so the best rate is in the bucket of 16 rows (14 / 1.2), where K = 11, 12 add nothing: the first K
    of the bucket that reaches its E, 10, is taken. A worthless draft that still adds a little is taken (K = 12)."""
    surv = torch.tensor([[1.0] * 5, [1.0] * 5, [0.0] * 5, [0.0] * 5])
    lat = LatencyModel([8, 16, 24, 32], [1.1, 1.2, 1.3, 1.4])
    padding = StepPadding(4, (8, 16, 24, 32), ragged=True)
    m = np.full(4, 5)
    plan = plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat, deterministic=True, padding=padding)
    assert plan.kind == "search" and plan.ends.tolist() == [4, 12, 20] and plan.starts.tolist() == [0, 5, 13]
    got = schedule_on_device(plan, surv, torch.from_numpy(m))
    assert got.tolist() == [5, 5, 0, 0]
    want = schedule_verification(VerifyPolicy(kind="cost"), m, survival=surv.numpy(), latency=lat, deterministic=True,
                                 padding=padding)
    assert got.tolist() == want.tolist()
    surv[2:] = 1e-9
    assert schedule_on_device(plan, surv, torch.from_numpy(m)).tolist() == [5, 5, 2, 0]


def test_plans_left_to_the_host_and_bad_plans() -> None:
    m = np.full(3, 5)
    lat = LatencyModel.affine(1e-3, 1e-3, 64)
    # the early-stop search of sampled rows is sequential, and a padded step chooses a cap: the host decides
    assert plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat) is None
    assert plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat, deterministic=True,
                         padding=StepPadding(4, (1, 2, 6))) is None
    assert plan_schedule(VerifyPolicy(kind="cost"), m, deterministic=True) is None  # no curve
    assert plan_schedule(VerifyPolicy(kind="cost", exact=False), m, latency=lat).kind == "search"
    with pytest.raises(DSparkInputError, match="budget"):
        plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat, budget=-1)
    for x, y in (([0.5, 0.2], [0.1, 0.2]),  # x decreasing
                 ([0.2, 0.2], [0.1, 0.2]),  # x not strictly increasing
                 ([0.2, 0.5], [0.3, 0.2]),  # y decreasing
                 ([0.2, 0.5], [-0.1, 0.2]),  # y below 0
                 ([0.2, np.nan], [0.1, 0.2]), ([0.2, 0.5], [0.1, np.nan]), ([np.nan], [0.5]),  # NaN knots
                 ([0.2, 0.5], [0.1, 0.2, 0.3]),  # lengths differ
                 ([], []),  # no knot
                 ([[0.2, 0.5]], [[0.1, 0.2]])):  # not 1-D
        with pytest.raises(DSparkInputError, match="price"):
            plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat, deterministic=True,
                          price=(np.asarray(x), np.asarray(y)))
    ok = plan_schedule(VerifyPolicy(kind="cost"), m, latency=lat, deterministic=True,
                       price=(np.asarray([0.5]), np.asarray([0.0])))
    assert ok.kind == "search" and ok.price is not None
    with pytest.raises(DSparkInputError, match="kind"):
        DevicePlan(kind="cap")
    with pytest.raises(DSparkInputError, match="search"):
        DevicePlan(kind="search")


def test_the_price_map_is_numpys_interpolation_bit_for_bit() -> None:
    from deepinfer_dspark.schedule_device import _interp

    rng = np.random.default_rng(5)
    x = np.sort(rng.uniform(0.0, 1.0, 20))
    y = np.sort(rng.uniform(0.0, 1.0, 20))
    v = np.concatenate([rng.uniform(-0.1, 1.1, 500), x, [np.nan, 0.0, 1.0]])
    slopes = (y[1:] - y[:-1]) / (x[1:] - x[:-1])
    got = _interp(*(torch.from_numpy(a) for a in (v, x, y, slopes))).numpy()
    np.testing.assert_array_equal(got, np.interp(v, x, y))
