"""The host (NumPy) verification policies against the former all-torch implementation, kept here as the oracle:
the same drafts per request, bit for bit the same latency curve, on random and degenerate inputs (ties, B = 1,
empty batches, all-zero or NaN confidences, budgets beyond every draft, jagged curves, thresholds at float32
boundaries)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from deepinfer_dspark import (
    LatencyModel,
    StepPadding,
    VerifyPolicy,
    allocate,
    cost_budget,
    schedule_verification,
)
from torch import Tensor


# ---------------------------------------------------------------------------------------------- the torch oracle
def _old_curve(lat: LatencyModel, max_tokens: int, points: tuple[list, list] | None = None) -> Tensor:
    """The curve through the model's points (or `points`, (sizes, seconds)) at Q = 0 .. max_tokens."""
    xs, ys = points if points is not None else (lat.sizes, lat.seconds)
    sizes = torch.tensor(xs, dtype=torch.float64)
    secs = torch.tensor(ys, dtype=torch.float64)
    q = torch.arange(max_tokens + 1, dtype=torch.float64)
    i = (torch.searchsorted(sizes, q, right=False) - 1).clamp(0, len(xs) - 2)
    w = (q - sizes[i]) / (sizes[i + 1] - sizes[i])
    return (secs[i] + w * (secs[i + 1] - secs[i])).clamp(min=max(lat.floor, 1e-12)) + lat.overhead


def _old_convex_curve(lat: LatencyModel, max_tokens: int) -> Tensor:
    """`_old_curve` through the lower convex hull of the points, found by brute force: a point is a vertex unless it
    lies on or above the chord of some point before it and some point after it."""
    xs, ys = lat.sizes, lat.seconds
    keep = [k for k in range(len(xs)) if not any(
        (ys[k] - ys[i]) * (xs[j] - xs[i]) >= (ys[j] - ys[i]) * (xs[k] - xs[i])
        for i in range(k) for j in range(k + 1, len(xs)))]
    return _old_curve(lat, max_tokens, ([xs[k] for k in keep], [ys[k] for k in keep]))


def _old_check(survival: Tensor, max_drafts) -> Tensor:
    m = torch.as_tensor(max_drafts, dtype=torch.int64).to(survival.device)
    assert m.shape == (survival.shape[0],)
    assert not m.numel() or (int(m.min()) >= 0 and int(m.max()) <= survival.shape[1])
    return m


def _old_ranked(survival: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    batch, width = survival.shape
    valid = torch.arange(width, device=survival.device)[None, :] < m[:, None]
    a = torch.where(valid, survival.to(torch.float64).clamp(0, 1), torch.full_like(survival, -1, dtype=torch.float64))
    vals, order = torch.sort(a.reshape(-1), descending=True, stable=True)
    count = int(valid.sum())
    return vals[:count], (order[:count] // width)


def _old_allocate(survival: Tensor, max_drafts, budget: int) -> Tensor:
    m = _old_check(survival, max_drafts)
    _, req = _old_ranked(survival, m)
    k = min(int(budget), req.numel())
    return torch.bincount(req[:k], minlength=survival.shape[0]).to(torch.int64)


def _old_cost_budget(survival, max_drafts, latency, *, exact=True, base_tokens=0, deterministic=False) -> int:
    m = _old_check(survival, max_drafts)
    vals, _ = _old_ranked(survival, m)
    batch = survival.shape[0]
    if batch == 0 or vals.numel() == 0:
        return 0
    if latency.flat():
        return vals.numel()
    k = torch.arange(vals.numel() + 1, device=vals.device)
    expected = batch + torch.cat([vals.new_zeros(1), torch.cumsum(vals, 0)])
    q0 = base_tokens + batch
    if bool(_old_curve(latency, q0 + vals.numel())[q0:].min() >= _old_curve(latency, q0 + vals.numel())[-1]):
        return vals.numel()  # no smaller step is predicted faster (under the floor, e.g.): every draft
    if not exact or deterministic:
        return int(torch.argmax(expected / _old_curve(latency, q0 + vals.numel())[q0 + k]))
    seconds = _old_convex_curve(latency, q0 + vals.numel())[q0 + k]  # the early stop reads the convex minorant
    rate = expected / torch.flip(torch.cummin(torch.flip(seconds, (0,)), 0).values, (0,))
    worse = rate[1:] <= rate[:-1]
    return int(torch.argmax(worse.to(torch.int8))) if bool(worse.any()) else vals.numel()


def _old_schedule(policy, max_drafts, *, survival, latency=None, base_tokens=0, deterministic=False) -> Tensor:
    if policy.kind == "verify_all":
        return torch.as_tensor(max_drafts, dtype=torch.int64)
    m = _old_check(survival, max_drafts)
    if policy.kind == "threshold":
        width = survival.shape[1]
        ok = (survival >= policy.threshold) & (torch.arange(width, device=survival.device)[None, :] < m[:, None])
        return torch.cumprod(ok.to(torch.int64), dim=1).sum(1)
    k = _old_cost_budget(survival, m, latency, exact=policy.exact, base_tokens=base_tokens,
                         deterministic=deterministic)
    return _old_allocate(survival, m, k)


# ---------------------------------------------------------------------------------------------- random cases
def _confidences(rng: random.Random, batch: int, width: int) -> Tensor:
    kind = rng.choice(["uniform", "ties", "zero", "one", "high", "nan"])
    if kind == "uniform":
        c = [[rng.random() for _ in range(width)] for _ in range(batch)]
    elif kind == "ties":  # few distinct values: many equal survivals across requests and depths
        c = [[rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(width)] for _ in range(batch)]
    elif kind == "zero":
        c = [[0.0] * width for _ in range(batch)]
    elif kind == "one":
        c = [[1.0] * width for _ in range(batch)]
    elif kind == "high":
        c = [[rng.uniform(0.8, 1.0) for _ in range(width)] for _ in range(batch)]
    else:
        c = [[float("nan") if rng.random() < 0.1 else rng.random() for _ in range(width)] for _ in range(batch)]
    return torch.cumprod(torch.tensor(c, dtype=torch.float32).reshape(batch, width), dim=1)


def _latency(rng: random.Random, top: int) -> LatencyModel:
    kind = rng.choice(["affine", "steep", "jagged", "flat", "noisy"])
    if kind == "affine":
        lat = LatencyModel.affine(rng.uniform(1e-3, 0.1), rng.uniform(1e-6, 1e-3), max(top, 2))
    elif kind == "steep":
        lat = LatencyModel.affine(rng.uniform(1e-3, 0.01), rng.uniform(1e-3, 0.05), max(top, 2))
    elif kind == "flat":
        lat = LatencyModel.affine(0.01, 0.0, max(top, 2))
    else:  # a profiled curve: jagged (graph buckets, noise peaks), possibly beyond the last point
        sizes = sorted(rng.sample(range(1, max(top, 8) + 1), rng.randint(2, min(8, max(top, 8)))))
        secs = [0.01 + 1e-4 * s + rng.choice([0.0, 0.0, 0.002, 0.01]) * rng.random() for s in sizes]
        lat = LatencyModel(sizes, secs, noise=rng.choice([0.0, 1e-5, 1e-3]) if kind == "noisy" else 0.0)
    if rng.random() < 0.5:
        lat.observe_overhead(rng.uniform(0.0, 0.01))
    if rng.random() < 0.4:  # the host's launch time: below, within or above the curve's range
        lat.observe_floor(rng.choice([0.0, 0.5, 1.0, 2.0]) * lat.forward(max(top, 1)))
    return lat


# elementwise non-decreasing maps a cost policy may price survivals through (`price=`), NaN kept
_MAPS = (lambda v: np.minimum(v, 0.5), lambda v: np.sqrt(v), lambda v: np.floor(v * 4) / 4, lambda v: 0.5 * v + 0.1)


@pytest.mark.parametrize("chunk", range(4))
def test_policies_match_the_torch_oracle_on_random_cases(chunk: int):
    rng = random.Random(1000 + chunk)
    for _ in range(60):
        batch = rng.choice([0, 1, 1, 2, 3, 5, 8, 17, 64, 300])
        width = rng.choice([0, 1, 2, 5, 5, 5, 6])
        a = _confidences(rng, batch, width)
        if rng.random() < 0.2:
            a = a.double()
        m = [rng.choice([width, width, rng.randint(0, width)]) for _ in range(batch)]
        md = rng.choice([m, torch.tensor(m), np.asarray(m)])
        sa = rng.choice([a, a.numpy()])  # the engine passes host arrays
        base = rng.choice([0, 0, 3, 100])
        lat = _latency(rng, base + batch * (width + 1) + 1)
        for pol in (VerifyPolicy(kind="cost"), VerifyPolicy(kind="cost", exact=False)):
            for det in (False, True):
                got = schedule_verification(pol, md, survival=sa, latency=lat, base_tokens=base, deterministic=det)
                want = _old_schedule(pol, m, survival=a, latency=lat, base_tokens=base, deterministic=det)
                assert got.dtype == torch.int64 and got.tolist() == want.tolist(), (pol, det, a, m, base)
                assert cost_budget(sa, md, lat, exact=pol.exact, base_tokens=base, deterministic=det) == \
                    _old_cost_budget(a, m, lat, exact=pol.exact, base_tokens=base, deterministic=det)
            # a ragged step's budget from the values alone (`_values`) is the K of the ranking's top-K
            top = base + batch * (width + 1)
            pad = StepPadding(8, tuple(range(max(1, batch), top + 4, rng.choice([1, 3, 8]))), ragged=True)
            for det in (False, True):
                got = schedule_verification(pol, md, survival=sa, latency=lat, base_tokens=base, deterministic=det,
                                            padding=pad)
                assert cost_budget(sa, md, lat, exact=pol.exact, base_tokens=base, deterministic=det,
                                   padding=pad) == int(got.sum()), (pol, det, a, m, base, pad)
                assert got.tolist() == _old_allocate(a, m, int(got.sum())).tolist()
                # priced through a non-decreasing map (with flat stretches: ties), ranked by the survivals
                price = rng.choice(_MAPS)
                for step in (pad, None):
                    k = cost_budget(sa, md, lat, exact=pol.exact, base_tokens=base, deterministic=det, padding=step,
                                    price=price)
                    got = schedule_verification(pol, md, survival=sa, latency=lat, base_tokens=base,
                                                deterministic=det, padding=step, price=price)
                    assert got.tolist() == _old_allocate(a, m, k).tolist(), (pol, det, a, m, base, step)
        count = sum(m)
        for budget in {0, 1, count // 2, count, count + 7}:
            assert allocate(sa, md, budget).tolist() == _old_allocate(a, m, budget).tolist()
        vals = [float(v) for v in a.flatten().tolist() if v == v]
        for t in [0.0, 1.0, rng.random(), *rng.sample(vals, min(3, len(vals)))]:
            pol = VerifyPolicy(kind="threshold", threshold=t)
            got = schedule_verification(pol, md, survival=sa)
            assert got.tolist() == _old_schedule(pol, m, survival=a).tolist(), (t, a, m)
        got = schedule_verification(VerifyPolicy(kind="verify_all"), md, survival=sa)
        assert got.tolist() == m and got.dtype == torch.int64


def test_threshold_compares_in_the_survival_dtype():
    # float32(0.7) < 0.7: torch compares a float32 tensor with the scalar in float32, so the host path must too
    a = torch.tensor([[np.float32(0.7)] * 3, [np.nextafter(np.float32(0.7), np.float32(0))] * 3])
    pol = VerifyPolicy(kind="threshold", threshold=0.7)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = a.to(dtype)
        want = _old_schedule(pol, [3, 3], survival=x).tolist()
        assert schedule_verification(pol, [3, 3], survival=x).tolist() == want
        if dtype != torch.bfloat16:
            assert schedule_verification(pol, np.asarray([3, 3]), survival=x.numpy()).tolist() == want
    assert schedule_verification(VerifyPolicy(kind="threshold", threshold=0.7), [3, 3], survival=a).tolist() == [3, 0]


def test_half_precision_survivals_match_the_oracle():
    rng = random.Random(7)
    for _ in range(20):
        a = _confidences(rng, rng.randint(1, 12), 5).to(torch.bfloat16)
        m = [5] * a.shape[0]
        lat = _latency(rng, a.shape[0] * 6 + 1)
        got = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat)
        assert got.tolist() == _old_schedule(VerifyPolicy(kind="cost"), m, survival=a, latency=lat).tolist()


def test_curve_is_bitwise_the_torch_curve():
    rng = random.Random(3)
    for _ in range(50):
        lat = _latency(rng, rng.randint(2, 3000))
        top = rng.randint(1, 4000)
        assert torch.equal(lat.curve(top), _old_curve(lat, top))
        lo = rng.randint(0, top)
        assert np.array_equal(lat.host_curve(lo, top), _old_curve(lat, top)[lo:].numpy())


def test_requires_grad_survivals_are_read_without_copying_to_float64():
    a = torch.tensor([[0.7, 0.7]], dtype=torch.float32, requires_grad=True)
    pol = VerifyPolicy(kind="threshold", threshold=0.7)
    assert schedule_verification(pol, [2], survival=a).tolist() == [2]
