"""Verification policies on hand-built confidence vectors; the cost policy against brute force; the latency model."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from deepinfer_dspark import (
    DSparkConfigError,
    DSparkInputError,
    LatencyModel,
    StepPadding,
    VerifyPolicy,
    allocate,
    allocate_above,
    cost_budget,
    cost_cutoff,
    schedule_verification,
)


def _survival(conf: list[list[float]]) -> torch.Tensor:
    return torch.cumprod(torch.tensor(conf, dtype=torch.float32), dim=1)


def test_verify_all_and_threshold_by_hand():
    a = _survival([[0.9, 0.9, 0.5, 1.0, 1.0], [0.4, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    # survivals: [0.9, 0.81, 0.405, 0.405, 0.405], [0.4, ...], [1, ...]
    all_ = schedule_verification(VerifyPolicy(kind="verify_all"), [5, 5, 3], survival=a)
    assert all_.tolist() == [5, 5, 3]
    thr = schedule_verification(VerifyPolicy(kind="threshold", threshold=0.5), [5, 5, 3], survival=a)
    assert thr.tolist() == [2, 0, 3]
    thr = schedule_verification(VerifyPolicy(kind="threshold", threshold=0.4), [5, 5, 5], survival=a)
    assert thr.tolist() == [5, 5, 5]
    assert schedule_verification(VerifyPolicy(kind="threshold", threshold=1.0), [5, 5, 5], survival=a).tolist() == [0, 0, 5]


def test_cost_by_hand():
    # 2 requests, T(Q) = 1 + 0.5 Q. Survivals ranked: 0.9, 0.8, 0.5, 0.2, 0.1.
    a = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.2, 0.0]])
    lat = LatencyModel.affine(1.0, 0.5, 64)
    # E/T for K = 0..5: 2/2=1.0, 2.9/2.5=1.16, 3.7/3=1.233, 4.2/3.5=1.2, ... -> K = 2: one draft each
    assert cost_budget(a, [3, 3], lat) == 2
    got = schedule_verification(VerifyPolicy(kind="cost"), [3, 3], survival=a, latency=lat)
    assert got.tolist() == [1, 1]
    # a cheap extra token (slope 0.01) makes every draft with survival > ~0.02 worth verifying
    cheap = LatencyModel.affine(1.0, 0.01, 64)
    assert schedule_verification(VerifyPolicy(kind="cost"), [3, 3], survival=a, latency=cheap).tolist() == [3, 2]


def test_allocate_is_prefix_per_request_with_ties():
    a = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.2]])
    assert allocate(a, [3, 3], 2).tolist() == [2, 0]  # ties: request-major, depth-minor
    assert allocate(a, [3, 3], 4).tolist() == [3, 1]
    assert allocate(a, [1, 3], 3).tolist() == [1, 2]
    assert allocate(a, [3, 3], 100).tolist() == [3, 3]
    assert allocate(a, [1, 2], 3).tolist() == [1, 2]  # a budget of every candidate: max_drafts itself
    assert allocate(np.asarray([[np.nan, 0.1]]), [2], 2).tolist() == [2]
    with pytest.raises(DSparkInputError, match="budget"):
        allocate(a, [3, 3], -1)
    with pytest.raises(DSparkInputError, match="max_drafts"):
        allocate(a, [3, 4], 100)  # checked before the budget is compared


def _brute_force(a: torch.Tensor, m: list[int], lat: LatencyModel) -> float:
    best = 0.0
    for counts in itertools.product(*(range(k + 1) for k in m)):
        e = len(m) + sum(float(a[b, :c].sum()) for b, c in enumerate(counts))
        best = max(best, e / lat.predict(len(m) + sum(counts)))
    return best


def _rate(a: torch.Tensor, counts: list[int], lat: LatencyModel) -> float:
    e = len(counts) + sum(float(a[b, :c].sum()) for b, c in enumerate(counts))
    return e / lat.predict(len(counts) + sum(counts))


@pytest.mark.parametrize("seed", range(12))
def test_cost_global_is_optimal_and_exact_matches_on_affine_curves(seed: int):
    rng = random.Random(seed)
    batch, width = rng.randint(1, 3), rng.randint(1, 4)
    conf = [[rng.choice([rng.random(), 1.0, 0.0, 0.5]) for _ in range(width)] for _ in range(batch)]
    a = _survival(conf).double()
    m = [rng.randint(0, width) for _ in range(batch)]
    # a jagged piecewise-linear curve (bucketed CUDA graphs) and an affine one
    sizes = list(range(1, batch * (width + 1) + 2))
    jagged = LatencyModel(sizes, [1.0 + 0.3 * q + rng.choice([0.0, 0.4, 0.9]) for q in sizes])
    affine = LatencyModel.affine(rng.uniform(0.2, 2.0), rng.uniform(0.01, 1.0), 64)
    for lat in (jagged, affine):
        counts = schedule_verification(VerifyPolicy(kind="cost", exact=False), m, survival=a, latency=lat).tolist()
        assert all(0 <= c <= k for c, k in zip(counts, m))
        assert _rate(a, counts, lat) == pytest.approx(_brute_force(a, m, lat), rel=1e-9)
    exact = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=affine).tolist()
    assert _rate(a, exact, affine) == pytest.approx(_brute_force(a, m, affine), rel=1e-9)


def test_errors():
    a = torch.ones(2, 3)
    with pytest.raises(DSparkConfigError, match="kind"):
        VerifyPolicy(kind="markov")
    with pytest.raises(DSparkConfigError, match="threshold"):
        VerifyPolicy(kind="threshold", threshold=1.5)
    with pytest.raises(DSparkInputError, match="survival"):
        schedule_verification(VerifyPolicy(kind="threshold"), [1, 1])
    with pytest.raises(DSparkInputError, match="latency"):
        schedule_verification(VerifyPolicy(kind="cost"), [1, 1], survival=a)
    with pytest.raises(DSparkInputError, match="max_drafts"):
        schedule_verification(VerifyPolicy(kind="cost"), [4, 1], survival=a, latency=LatencyModel.affine(1, 1, 8))
    with pytest.raises(DSparkConfigError, match="sizes"):
        LatencyModel([2, 2], [1.0, 1.0])
    with pytest.raises(DSparkConfigError, match="seconds"):
        LatencyModel([1, 2], [1.0, -1.0])
    with pytest.raises(DSparkInputError, match="observe"):
        LatencyModel.affine(1, 1, 8).observe(0, 1.0)
    with pytest.raises(DSparkInputError, match="ragged steps only"):  # a padded step picks a cap, not a K
        cost_budget(a, [3, 3], LatencyModel.affine(1, 1, 8), padding=StepPadding(2, (2, 4)))


def test_cost_base_tokens_prices_the_whole_step():
    # an affine T(base_tokens + S + K) is the same as an affine curve whose intercept absorbs the other tokens
    g = torch.Generator().manual_seed(3)
    surv = torch.cumprod(torch.rand(6, 5, generator=g), dim=1)
    m = torch.full((6,), 5)
    for b in (0, 7, 200):
        shifted = LatencyModel.affine(0.01 + 0.002 * b, 0.002, 4096)
        got = cost_budget(surv, m, LatencyModel.affine(0.01, 0.002, 4096), base_tokens=b)
        assert got == cost_budget(surv, m, shifted)
    # more of the step spent elsewhere makes a draft relatively cheaper: never fewer drafts
    ks = [cost_budget(surv, m, LatencyModel.affine(0.01, 0.002, 4096), base_tokens=b) for b in (0, 50, 500)]
    assert ks == sorted(ks) and ks[-1] > ks[0]
    with pytest.raises(DSparkInputError, match="base_tokens"):
        cost_budget(surv, m, LatencyModel.affine(0.01, 0.002, 4096), base_tokens=-1)


def test_cost_exact_ignores_profile_peaks_and_greedy_takes_the_global_argmax():
    a = torch.tensor([[0.9, 0.9, 0.9]])  # survivals of one request; E(K) = 1, 1.9, 2.8, 3.7
    # a profiled peak at Q = 2 (noise: more tokens never take less time): raw rates 1.0, 0.95, 2.33, 2.85 would stop
    # the early-stop search at K = 0; the curve it reads is 1.0, 1.2, 1.2, 1.3 (rates rising to K = 3)
    peak = LatencyModel([1, 2, 3, 4], [1.0, 2.0, 1.2, 1.3])
    assert cost_budget(a, [3], peak) == 3 == cost_budget(a, [3], peak, exact=False)
    # a real step (T jumps and stays; rates 1.0, 0.76, 1.12, 1.48): on the curve itself the non-anticipating search
    # would stop before it; on its convex minorant (1.0, 1.5, 2.0, 2.5: rates rising to K = 3) it reaches the global
    # argmax, because the flat stretch behind the step pays for it
    step = LatencyModel([1, 2, 3, 4], [1.0, 2.5, 2.5, 2.5])
    assert cost_budget(a, [3], step) == 3 == cost_budget(a, [3], step, exact=False)
    assert step.host_convex_curve(1, 5).tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
    # a step that keeps rising (convex already) still stops the search at once, as it stops the argmax
    rising = LatencyModel([1, 2, 3, 4], [1.0, 2.5, 4.0, 5.5])
    assert cost_budget(a, [3], rising) == 0 == cost_budget(a, [3], rising, exact=False)
    # every request greedy: the global argmax (an output-exact choice for deterministic drafts)
    assert cost_budget(a, [3], step, deterministic=True) == 3
    got = schedule_verification(VerifyPolicy(kind="cost"), [3], survival=a, latency=step, deterministic=True)
    assert got.tolist() == [3]


def test_cost_policy_verifies_all_on_a_flat_noisy_curve_and_prunes_on_a_growing_one(noisy_profile):
    g = torch.Generator().manual_seed(5)
    surv = torch.cumprod(torch.rand(64, 5, generator=g), dim=1)  # many low survivals: pruning is tempting
    m = torch.full((64,), 5)
    pol = VerifyPolicy(kind="cost")
    for seed in range(5):
        flat = noisy_profile(lambda q: 0.1, 0.025, seed=seed)
        assert flat.flat()
        for greedy in (False, True):
            got = schedule_verification(pol, m, survival=surv, latency=flat, deterministic=greedy)
            assert got.tolist() == m.tolist()
    grow = noisy_profile(lambda q: 0.1 + 2e-4 * q, 0.025)
    pruned = schedule_verification(pol, m, survival=surv, latency=grow)
    assert int(pruned.sum()) < int(m.sum()) * 0.8
    # the noise-free affine curve of the same growth prunes about the same way (the fit keeps the slope)
    exact = schedule_verification(pol, m, survival=surv, latency=LatencyModel.affine(0.1, 2e-4, 384))
    assert abs(int(exact.sum()) - int(pruned.sum())) <= 0.15 * int(exact.sum())


def _padded_rate(a: torch.Tensor, counts: list[int], lat: LatencyModel, pad: StepPadding) -> float:
    e = len(counts) + sum(float(a[b, :c].clamp(0, 1).sum()) for b, c in enumerate(counts))
    return e / lat.predict(pad.rows(max(counts) + 1))


def test_padded_step_prices_the_longest_chunk():
    # one confident request and 7 doubtful ones in a graph of 8 x Q rows, Q in 1, 2, 4, 6: the unpadded policy
    # drops the doubtful drafts (the step's Q stays 6, no time saved); the padded one verifies them for free
    a = _survival([[0.95] * 5] + [[0.3, 0.5, 0.5, 0.5, 0.5]] * 7)
    pad, lat, m = StepPadding(8, (1, 2, 4, 6)), LatencyModel.affine(0.01, 1e-4, 64), [5] * 8
    pol = VerifyPolicy(kind="cost")
    unpadded = schedule_verification(pol, m, survival=a, latency=lat).tolist()
    assert unpadded[0] == 5 and sum(unpadded[1:]) < 7 * 5  # the step stays 8 x 6 rows
    for greedy in (False, True):
        padded = schedule_verification(pol, m, survival=a, latency=lat, padding=pad, deterministic=greedy).tolist()
        assert padded == m
        assert _padded_rate(a, padded, lat, pad) > _padded_rate(a, unpadded, lat, pad)
    # a steep curve: a smaller bucket (cap 1: Q = 2) for every request, the longest chunk included
    steep = LatencyModel.affine(0.004, 2e-4, 64)
    got = schedule_verification(pol, m, survival=a, latency=steep, padding=pad, deterministic=True).tolist()
    assert got == [1] * 8
    assert schedule_verification(pol, [3, 0, 2, 1, 3, 3, 3, 3], survival=a, latency=lat, padding=pad).tolist() == [
        3, 0, 2, 1, 3, 3, 3, 3]  # max_drafts 3: its own cap (a chunk of 4 rows)
    with pytest.raises(DSparkConfigError, match="sizes"):
        StepPadding(8, (2, 1))
    with pytest.raises(DSparkInputError, match="padding"):
        schedule_verification(pol, m, survival=a, latency=lat, padding=StepPadding(8, (1, 2, 4)))


def _random_case(seed: int) -> tuple[random.Random, torch.Tensor, list[int]]:
    """(rng, survivals [B, 5] float64, max_drafts) of a random batch of 1-4 requests with ties, 0s and 1s."""
    rng = random.Random(seed)
    batch, width = rng.randint(1, 4), 5
    conf = [[rng.choice([rng.random(), 1.0, 0.0, 0.9]) for _ in range(width)] for _ in range(batch)]
    return rng, _survival(conf).double(), [rng.randint(0, width) for _ in range(batch)]


def _curves(rng: random.Random, rows: int) -> tuple[LatencyModel, LatencyModel]:
    """A jagged curve over 1 .. rows + 1 (graph buckets) and an affine one."""
    sizes = list(range(1, rows + 2))
    jagged = LatencyModel(sizes, [1.0 + 0.05 * q + rng.choice([0.0, 0.4, 0.9]) for q in sizes])
    return jagged, LatencyModel.affine(rng.uniform(0.2, 2.0), rng.uniform(0.005, 0.3), 64)


def _assert_non_anticipating(schedule, a: torch.Tensor) -> None:
    """exact: whether draft j (1-based) of request b is verified must not depend on d_j, i.e. on the survivals of
    drafts j+1 .. N of b (columns j.. here), whatever they are. schedule(survival) -> [B] drafts."""
    batch, width = a.shape
    ref = schedule(a)
    for b in range(batch):
        for j in range(1, width + 1):
            for _ in range(3):
                other = a.clone()
                other[b, j:] = other[b, j - 1] * torch.cumprod(torch.rand(width - j, dtype=torch.float64), 0)
                assert (schedule(other)[b] >= j) == (ref[b] >= j)


@pytest.mark.parametrize("seed", range(10))
def test_padded_global_is_optimal_and_exact_is_non_anticipating(seed: int):
    rng, a, m = _random_case(100 + seed)
    pad = StepPadding(rng.choice([a.shape[0], 4, 8]) if a.shape[0] <= 4 else 8, (1, 2, 4, 6))
    for lat in _curves(rng, pad.batch * 6):
        best = max(_padded_rate(a, list(c), lat, pad) for c in itertools.product(*(range(k + 1) for k in m)))
        got = schedule_verification(VerifyPolicy(kind="cost", exact=False), m, survival=a, latency=lat, padding=pad)
        assert all(0 <= c <= k for c, k in zip(got.tolist(), m))
        assert _padded_rate(a, got.tolist(), lat, pad) == pytest.approx(best, rel=1e-9)
        _assert_non_anticipating(lambda x, lat=lat: schedule_verification(
            VerifyPolicy(kind="cost"), m, survival=x, latency=lat, padding=pad).tolist(), a)

def _ragged_rate(a: torch.Tensor, counts: list[int], lat: LatencyModel, pad: StepPadding, base: int) -> float:
    e = len(counts) + sum(float(a[b, :c].clamp(0, 1).sum()) for b, c in enumerate(counts))
    rows = base + len(counts) + sum(counts)
    return e / lat.predict(int(pad.bucketed(np.asarray([rows]))[0]))


def test_ragged_step_prunes_per_request_and_fills_its_bucket():
    # one confident request and 7 doubtful ones, rows back to back in buckets of half a batch (8, 12, ..., 48): the
    # padded pricing could only verify everything (the confident chunk keeps Q = 6); the ragged one drops the
    # doubtful drafts and runs a smaller bucket, which the drafts ranked next fill
    a = _survival([[0.95] * 5] + [[0.3, 0.5, 0.5, 0.5, 0.5]] * 7)
    sizes = tuple(range(8, 49, 4))
    pad, lat, m = StepPadding(8, sizes, ragged=True), LatencyModel.affine(0.004, 2e-4, 64), [5] * 8
    assert pad.rows(13) == 16 and pad.rows(49) is None and pad.bucketed(np.asarray([8, 9, 48, 50])).tolist() == [
        8, 12, 48, 50]
    for greedy in (False, True):
        got = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat, padding=pad,
                                    deterministic=greedy).tolist()
        assert got[0] == 5 and sum(got) < sum(m) and (8 + sum(got)) in sizes, got
        assert _ragged_rate(a, got, lat, pad, 0) > _ragged_rate(a, m, lat, pad, 0)
    # padded steps can only cap every request at one depth: the confident request's drafts go too
    uniform = StepPadding(8, (1, 2, 4, 6))
    capped = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat, padding=uniform).tolist()
    assert capped == [1] * 8 and _padded_rate(a, capped, lat, uniform) < _ragged_rate(a, got, lat, pad, 0)


@pytest.mark.parametrize("seed", range(10))
def test_ragged_global_is_optimal_and_exact_is_non_anticipating(seed: int):
    rng, a, m = _random_case(300 + seed)
    batch, base = a.shape[0], rng.randint(0, 2)
    B = rng.choice([4, 8]) if batch + base <= 4 else 8
    pad = StepPadding(B, tuple(sorted({-(-B * k // 2) for k in range(2, 13)})), ragged=True)
    for lat in _curves(rng, B * 6):
        best = max(_ragged_rate(a, list(c), lat, pad, base) for c in itertools.product(*(range(k + 1) for k in m)))
        got = schedule_verification(VerifyPolicy(kind="cost", exact=False), m, survival=a, latency=lat, padding=pad,
                                    base_tokens=base)
        assert all(0 <= c <= k for c, k in zip(got.tolist(), m))
        assert _ragged_rate(a, got.tolist(), lat, pad, base) == pytest.approx(best, rel=1e-9)

        def exact(x, lat=lat):
            return schedule_verification(VerifyPolicy(kind="cost"), m, survival=x, latency=lat, padding=pad,
                                         base_tokens=base).tolist()

        rows = base + batch + sum(exact(a))
        assert sum(exact(a)) == sum(m) or pad.rows(rows) == rows  # a bucket filled, or every draft verified
        _assert_non_anticipating(exact, a)

def _dense_ragged_k(a: torch.Tensor, m: list[int], lat: LatencyModel, pad: StepPadding, base: int) -> int:
    """The ragged global K as first written: the first maximum of E(K) / T(bucket(base + S + K)) over every K."""
    valid = torch.arange(a.shape[1])[None, :] < torch.tensor(m)[:, None]
    if lat.flat():  # no measured growth: every draft
        return int(valid.sum())
    vals = torch.sort(torch.where(valid, a.double().clamp(0, 1), -1.0).reshape(-1), descending=True,
                      stable=True).values[: int(valid.sum())].numpy()
    q0 = base + a.shape[0]
    expected = np.concatenate(([0.0], np.cumsum(vals))) + a.shape[0]
    rows = pad.bucketed(np.arange(q0, q0 + vals.size + 1))
    seconds = lat.host_at(rows)
    if seconds[-1] <= seconds.min():  # no smaller step is predicted faster: every draft, as on a flat curve
        return vals.size
    return int(np.argmax(expected / seconds))


@pytest.mark.parametrize("chunk", range(3))
def test_ragged_global_k_priced_at_bucket_ends_is_the_dense_first_maximum(chunk: int):
    """The global ragged choice prices only the buckets' last K; it must pick exactly the K the argmax over every K
    picks (ties, zeros, equal rates across buckets, a curve with flat stretches, a base of other tokens)."""
    rng = random.Random(700 + chunk)
    for _ in range(150):
        batch, width = rng.choice([1, 2, 3, 8, 40, 256]), 5
        kind = rng.choice(["uniform", "ties", "zero", "one"])
        pick = {"uniform": rng.random, "ties": lambda: rng.choice([0.0, 0.5, 1.0]), "zero": lambda: 0.0,
                "one": lambda: 1.0}[kind]
        a = _survival([[pick() for _ in range(width)] for _ in range(batch)])
        m = [rng.choice([width, rng.randint(0, width)]) for _ in range(batch)]
        base = rng.choice([0, 0, 3])
        top = base + batch * (width + 1)
        step = rng.choice([1, 2, 7, max(1, top // 5)])
        sizes = tuple(range(rng.randint(1, max(1, batch)), top + step + 1, step))
        pad = StepPadding(8, sizes, ragged=True)
        q = list(range(1, top + 2))
        lat = rng.choice([LatencyModel.affine(rng.uniform(1e-3, 0.02), rng.uniform(0.0, 1e-3), top + 1),
                          LatencyModel(q, [0.01 + rng.choice([0.0, 1e-4]) * (i // 4) for i in q])])
        got = schedule_verification(VerifyPolicy(kind="cost", exact=False), m, survival=a, latency=lat, padding=pad,
                                    base_tokens=base)
        want = _dense_ragged_k(a, m, lat, pad, base)
        assert int(got.sum()) == want, (a, m, base, sizes)
        assert cost_budget(a, m, lat, exact=False, padding=pad, base_tokens=base) == want
        assert got.tolist() == allocate(a, m, want).tolist()


def test_online_correction_moves_the_level_not_the_growth():
    """A step whose span is the profiled forward plus a constant (input preparation, verification), run at the few
    sizes a policy picks, must not teach the curve a slope the profile does not have: the H200 profile of the
    testbed (ms) grows by 0.1 ms from 32 to 64 rows; steps of 90-100 rows that took 2.5 ms more than the forward
    had taught the points around them a rise of about 60 us per row at 64 rows, and the cost policy pruned."""
    sizes = [1, 32, 64, 128, 256]
    prof = [1.23e-3, 1.26e-3, 1.35e-3, 1.71e-3, 2.06e-3]
    lat = LatencyModel(sizes, prof, ema=0.05)
    for q in [90, 95, 100] * 30:
        lat.observe(q, lat.forward(q) - lat.seconds[0] + prof[0] + 2.5e-3)  # the profile at q, plus 2.5 ms
    slopes = [(b - a) / (y - x) for a, b, x, y in zip(lat.seconds, lat.seconds[1:], sizes, sizes[1:])]
    want = [(b - a) / (y - x) for a, b, x, y in zip(prof, prof[1:], sizes, sizes[1:])]
    assert slopes == pytest.approx(want)
    assert lat.predict(95) == pytest.approx(np.interp(95, sizes, prof) + 2.5e-3, rel=0.01)
    # the cost policy then admits what the profile's slope pays for: survival 0.2 drafts at 32 requests
    a = _survival([[0.9, 0.5, 0.5, 0.5, 0.9]] * 32)
    m = [5] * 32
    got = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat).tolist()
    assert sum(got) >= 3 * 32, got


def test_exact_ragged_search_crosses_a_step_up_to_the_flat_stretch_behind_it():
    """The H200 profile of the testbed's verify step (ms, 2026-12-04) rises 0.70 ms from 256 to 288 rows and 0.83 ms
    more to 768. At 128 requests of 5 drafts with survivals 0.6^j and about 7.5 ms of the round outside the forward,
    the global argmax verifies far past the step; the non-anticipating search must too (on the curve itself it
    stopped at 256 rows, one draft per request: 22% below the argmax's rate). The hull spreads the step over the
    whole stretch behind it, so it overprices that stretch's flat end a little: here 4 drafts of 5 (2.5% below)."""
    from deepinfer_dspark.schedule import _ragged, _values

    sizes = [1, 2, 4, 8, 16, 32, 56, 64, 72, 80, 88, 96, 112, 128, 144, 160, 176, 192, 224, 256, 288, 320, 352, 384,
             448, 512, 576, 640, 704, 768]
    ms = [1.366, 1.366, 1.366, 1.366, 1.389, 1.389, 1.491, 1.492, 1.599, 1.599, 1.602, 1.602, 1.68, 1.693, 1.892,
          1.892, 1.913, 1.949, 2.055, 2.071, 2.769, 2.769, 2.84, 2.919, 3.093, 3.156, 3.375, 3.509, 3.546, 3.6]
    lat = LatencyModel(sizes, [t * 1e-3 for t in ms], noise=1e-5)
    lat.observe_overhead(7.5e-3)
    pad = StepPadding(128, tuple(sorted({-(-128 * k // 2) for k in range(2, 13)})), ragged=True)
    a = _survival([[0.6] * 5] * 128)
    m = [5] * 128
    exact = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat, padding=pad)
    best = schedule_verification(VerifyPolicy(kind="cost", exact=False), m, survival=a, latency=lat, padding=pad)
    rows = 128 + int(exact.sum())
    assert rows > 288 and pad.rows(rows) == rows  # past the step, a bucket filled
    best_rate = _ragged_rate(a, best.tolist(), lat, pad, 0)
    assert _ragged_rate(a, exact.tolist(), lat, pad, 0) >= 0.97 * best_rate
    # the curve itself (no hull) would have stopped at the step
    vals = _values(a, np.asarray(m))
    flat_hull = LatencyModel(sizes, [t * 1e-3 for t in ms], noise=1e-5)
    flat_hull.observe_overhead(7.5e-3)
    flat_hull.host_convex_curve = lambda lo, hi: flat_hull.host_curve(lo, hi)  # the former search's curve
    stuck = _ragged(vals, 128, flat_hull, pad, exact=True, base_tokens=0, deterministic=False)
    assert 128 + stuck <= 288
    assert _ragged_rate(a, allocate(a, m, stuck).tolist(), lat, pad, 0) < 0.8 * best_rate


@pytest.mark.parametrize("padding", [None, StepPadding(8, (8, 16, 24, 32, 40, 48), ragged=True),
                                     StepPadding(8, (1, 2, 4, 6))])
def test_drafts_under_the_floor_are_all_verified_without_a_sort(padding, monkeypatch):
    """A forward that ends within the host's own launch time (the latency model's floor) costs nothing: every policy
    choice takes the same time, so cost verifies every draft, and does so before it sorts anything (the host time
    of a cost round is then about verify_all's). With the floor below the largest step it prunes again."""
    from deepinfer_dspark import schedule as sched

    a = _survival([[0.9, 0.5, 0.2, 0.1, 0.1]] * 4 + [[0.3, 0.1, 0.1, 0.1, 0.1]] * 4)
    m = [5] * 8
    lat = LatencyModel([8, 48], [1e-3, 5e-3])
    before = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat, padding=padding)
    assert int(before.sum()) < 40  # a steep curve prunes
    lat.observe_floor(lat.forward(48) + 1e-4)

    def no_sort(*args, **kwargs):
        raise AssertionError("sorted survivals under the floor")

    monkeypatch.setattr(sched, "_values", no_sort)
    monkeypatch.setattr(sched, "_top_counts", no_sort)
    for exact in (True, False):
        got = schedule_verification(VerifyPolicy(kind="cost", exact=exact), m, survival=a, latency=lat,
                                    padding=padding)
        assert got.tolist() == m
    if padding is None or padding.ragged:
        assert cost_budget(a, m, lat, exact=False, padding=padding) == 40
    monkeypatch.undo()
    lat.floor = lat.forward(8)  # below every step: the curve prices the forward again
    again = schedule_verification(VerifyPolicy(kind="cost"), m, survival=a, latency=lat, padding=padding)
    assert again.tolist() == before.tolist()


def test_cost_budget_prices_through_the_map_only_when_it_reads_values():
    a = _survival([[0.9, 0.5, 0.2, 0.1, 0.1]] * 4 + [[0.3, 0.1, 0.1, 0.1, 0.1]] * 4)
    m = [5] * 8
    lat = LatencyModel([8, 48], [1e-3, 5e-3])
    seen = []

    def halve(x):
        seen.append(x.shape)
        return x * 0.5

    got = cost_budget(a, m, lat, exact=False, price=halve)
    assert seen == [(40,)] and got == cost_budget(a * 0.5, m, lat, exact=False)  # the ranked values
    assert got < cost_budget(a, m, lat, exact=False)  # lower survivals buy fewer drafts
    lat.observe_floor(1.0)  # every draft free: nothing to price
    assert cost_budget(a, m, lat, exact=False, price=halve) == 40 and len(seen) == 1


def test_cost_prices_through_the_map_and_allocates_by_the_survivals_themselves():
    """`price` sets the budget (the values E(K) sums) and the allocation ranks the survivals: a map with a flat
    stretch (here every survival above 0.5 priced 0.5, as an isotonic calibration pools bins) must not hand the
    budget to the request that comes first in the batch. Ranking the priced values themselves would: their ties
    break request-major. A ragged step whose row bucket ends inside the tied values (12 of 14) shows it."""
    a = _survival([[0.6, 0.9, 0.9, 0.9, 0.9], [0.95, 0.95, 0.95, 0.95, 0.95]] * 2)
    m = [5] * 4
    lat = LatencyModel([4, 24], [9e-3, 29e-3])  # 16 rows (K = 12) beat 4 (K = 0) and 24 (K = 20)
    padding = StepPadding(4, (4, 16, 24), ragged=True)
    seen = []

    def flat_top(x):
        seen.append(x.shape)
        return np.minimum(x, 0.5)

    pol = VerifyPolicy(kind="cost", exact=False)
    got = schedule_verification(pol, m, survival=a, latency=lat, padding=padding, price=flat_top)
    k = cost_budget(a, m, lat, exact=False, padding=padding, price=flat_top)
    assert seen == [(20,), (20,)] and k == 12
    assert got.tolist() == allocate(a, m, k).tolist() == [1, 5, 1, 5]  # the higher survivals first
    tied = schedule_verification(pol, m, survival=np.minimum(a.numpy(), 0.5), latency=lat,
                                 padding=padding)
    assert tied.tolist() == [2, 5, 2, 3]
    lat.observe_floor(1.0)  # every draft free: nothing to price
    assert schedule_verification(pol, m, survival=a, latency=lat, padding=padding, price=flat_top).tolist() == m
    assert len(seen) == 2


def test_a_ragged_steps_free_check_from_its_bucket_prices_is_the_general_one():
    """The cost policy decides whether a ragged step's drafts are all free from the bucket prices its search reads
    (`_free(..., prices)` over `_bucket_prices`), not from `_free`'s own predictions: the two must agree on every step the
    prices cover, flat stretches and floors included (a floor makes whole runs of buckets cost the same, where a
    strict comparison would differ)."""
    from deepinfer_dspark.schedule import _bucket_prices, _free

    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(400):
        batch = rng.randint(1, 24)
        sizes = tuple(sorted(rng.sample(range(1, 7 * batch + 8), rng.randint(1, 8))))
        points = sorted(rng.sample(range(1, 8 * batch + 9), 3))
        seconds = [rng.choice([1e-3, 2e-3, 2e-3, 3e-3]) for _ in points]
        lat = LatencyModel(points, seconds)
        if rng.random() < 0.5:
            lat.observe_floor(rng.choice([1.5e-3, 2e-3, 5e-3]))
        m = np.asarray([rng.randint(0, 5) for _ in range(batch)], dtype=np.int64)
        base = rng.randint(0, 3)
        pad = StepPadding(batch, sizes, ragged=True)
        prices = _bucket_prices(lat, pad, base + batch, int(m.sum()))
        if prices is None:
            assert base + batch + int(m.sum()) > sizes[-1]
            continue
        free = _free(m, batch, lat, pad, base)
        assert _free(m, batch, lat, pad, base, prices) == free, (sizes, points, seconds, lat.floor, m.tolist(), base)
        seen[free] += 1
    assert min(seen.values()) >= 20  # both answers were exercised


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ragged", [False, True])
def test_a_cutoff_verifies_the_early_stop_searchs_drafts(seed: int, ragged: bool):
    """`cost_cutoff` is the early-stop search's price of a draft as a survival level: applied to the survivals it
    was searched on (`allocate_above`), it verifies the top K of the exact search over the convex curve (not the
    bucket fill), up to ties; through a price map, the K of the priced values. Rounds of 16 requests x 5 drafts,
    ragged buckets of 8 rows, a convex curve."""
    rng = np.random.default_rng(seed)
    a = np.cumprod(rng.uniform(0.2, 1.0, size=(16, 5)), axis=1).astype(np.float32)
    m = rng.integers(0, 6, size=16)
    lat = LatencyModel([16, 48, 96], [2e-3, 3e-3, 6e-3])
    padding = StepPadding(16, tuple(range(24, 97, 8)), ragged=True) if ragged else None
    for price in (None, np.sqrt):
        vals = np.sort(np.concatenate([a[b, : m[b]] for b in range(16)]))[::-1].astype(np.float64)
        k = cost_budget(a, m, lat, exact=True, padding=None, price=price)  # exact: the convex curve, no fill
        c = cost_cutoff(a, m, lat, padding=padding, price=price)
        got = allocate_above(a, m, c)
        assert got.dtype == torch.int64 and got.tolist() == allocate(a, m, k).tolist(), (k, c)
        assert 0 < k < vals.size and vals[k] < c < vals[k - 1]
    assert cost_cutoff(a, m, lat, padding=padding, price=np.sqrt) < cost_cutoff(a, m, lat, padding=padding)


def test_cutoff_ends_and_errors():
    a = _survival([[0.9, 0.5, 0.2, 0.1, 0.1]] * 4 + [[0.3, 0.1, 0.1, 0.1, 0.1]] * 4)
    m = [5] * 8
    steep = LatencyModel([8, 48], [1e-3, 5e-3])
    c = cost_cutoff(a, m, steep)
    assert 0.0 < c < 1.0
    assert cost_cutoff(a, m, LatencyModel.affine(1.0, 1e-9, 64)) == 0.0  # every draft worth its row
    assert cost_cutoff(a, m, LatencyModel.affine(1e-3, 1.0, 64)) == float("inf")  # no draft is
    assert allocate_above(a, m, float("inf")).tolist() == [0] * 8
    assert allocate_above(a, m, 0.0).tolist() == m
    free = LatencyModel([8, 48], [1e-3, 5e-3])
    free.observe_floor(1.0)  # under the host's floor every draft is free
    assert cost_cutoff(a, m, free) == 0.0
    assert cost_cutoff(a, [0] * 8, steep) == 0.0
    nan = a.clone()
    nan[0, :] = float("nan")  # ranked first by the search; never a level to compare with
    got = cost_cutoff(nan, m, steep)
    assert got == got and allocate_above(nan, m, got)[0] == 0
    with pytest.raises(DSparkInputError, match="cutoff"):
        allocate_above(a, m, float("nan"))
    with pytest.raises(DSparkInputError, match="cutoff"):
        allocate_above(a, m, -0.1)
    with pytest.raises(DSparkInputError, match="padding"):
        cost_cutoff(a, m, steep, padding=StepPadding(8, (1, 2, 6)))
    with pytest.raises(DSparkInputError, match="base_tokens"):
        cost_cutoff(a, m, steep, base_tokens=-1)
