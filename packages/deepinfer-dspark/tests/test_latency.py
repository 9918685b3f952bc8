"""The cost policy's latency curve: interpolation, the start-up profile's fit and noise, the online correction,
the overhead, the convex minorant (deepinfer_dspark/latency.py)."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_dspark import DSparkConfigError, DSparkInputError, LatencyModel, isotonic


def test_latency_model_interpolates_profiles_and_corrects():
    lat = LatencyModel([1, 4, 8], [1.0, 2.5, 3.0], ema=0.5)
    assert lat.predict(1) == 1.0 and lat.predict(2) == pytest.approx(1.5) and lat.predict(6) == pytest.approx(2.75)
    assert lat.predict(12) == pytest.approx(3.5)  # last segment's slope beyond the last point
    assert lat.curve(3).tolist()[1:] == pytest.approx([1.0, 1.5, 2.0])
    lat.observe(4, 4.5)  # error 2.0 at one size: the level moves by all of it, the growth stays the profile's
    assert lat.seconds == pytest.approx([3.0, 4.5, 5.0]) and lat.observations == 1
    lat.observe(4, 2.5 + 1.0)  # error 1.0: weights 0.5 (older) and 1, level (0.5 * 2 + 1) / 1.5
    assert lat.seconds == pytest.approx([1.0 + 4 / 3, 2.5 + 4 / 3, 3.0 + 4 / 3])
    # steps at two sizes, 1 and 8 (x = 1/8 and 1), each 1.0 slower per 7 rows more than the profile says: the
    # growth is fitted, shrunk by the ridge prior (weight 1 against the sizes' spread)
    lat = LatencyModel([1, 4, 8], [1.0, 2.5, 3.0], ema=0.01)
    for _ in range(200):
        lat.observe(1, 1.0 + 0.5)
        lat.observe(8, 3.0 + 1.5)
    rise = (lat.seconds[2] - lat.seconds[0]) - (3.0 - 1.0)
    assert 0.9 < rise < 1.0  # the errors' rise is 1.0; the prior keeps a little of the profile's
    assert lat.predict(1) == pytest.approx(1.5, abs=0.05) and lat.predict(8) == pytest.approx(4.5, abs=0.05)
    lat = LatencyModel([1, 4, 8], [1.0, 2.5, 3.0], ema=0.0)
    lat.observe(4, 9.0)  # ema 0: observations are counted, the curve stays the profile
    assert lat.seconds == [1.0, 2.5, 3.0] and lat.observations == 1
    lat = LatencyModel([1, 4, 8], [1.0, 2.5, 3.0], ema=0.05)
    lat.observe(64, 90.0)  # past the profile (a step with prefill rows): counted, not fitted
    assert lat.seconds == [1.0, 2.5, 3.0] and lat.observations == 1
    clock = iter(range(1000))
    prof = LatencyModel.profile(lambda q: None, [1, 2, 4], repeats=3, timer=lambda: float(next(clock)))
    assert prof.sizes == [1, 2, 4] and prof.seconds == [1.0, 1.0, 1.0] and prof.noise == 0.0
    calls = []
    LatencyModel.profile(calls.append, [2, 5], warmup=2, repeats=2, timer=lambda: 0.0)
    assert calls == [2, 2, 5, 5, 2, 5, 2, 5]  # warm-up per size, then the sizes interleaved per repeat


def test_isotonic_pools_violators_instead_of_carrying_peaks():
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert isotonic([5.0, 1.0, 1.0, 1.0]) == pytest.approx([2.0] * 4)  # not a running max (5, 5, 5, 5)
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([2.0, 1.0], [3.0, 1.0]) == pytest.approx([1.75, 1.75])
    with pytest.raises(DSparkConfigError, match="weights"):
        isotonic([1.0, 2.0], [1.0, 0.0])


def test_profile_is_robust_non_decreasing_and_flat_within_noise(noisy_profile):
    # the H200 failure: a flat ~100 ms step with +-25 ms noise; one size also gets two stray 90 ms stalls
    flat = noisy_profile(lambda q: 0.1, 0.025, outliers=[(13, 0.09), (33, 0.09)])
    assert all(b >= a for a, b in zip(flat.seconds, flat.seconds[1:]))  # a bigger step is never cheaper
    assert max(flat.seconds) < 0.125  # the median drops the stalls
    assert flat.noise > 0 and flat.flat() and flat.measured is not None and len(flat.measured) == 10
    # real growth (0.2 ms per query token, 77 ms over the range) above the same noise
    grow = noisy_profile(lambda q: 0.1 + 2e-4 * q, 0.025)
    assert all(b >= a for a, b in zip(grow.seconds, grow.seconds[1:])) and not grow.flat()
    assert grow.predict(384) - grow.predict(1) == pytest.approx(2e-4 * 383, rel=0.35)
    # without noise any rise counts; a constant curve is flat
    assert not LatencyModel.affine(0.1, 1e-6, 384).flat() and LatencyModel.affine(0.1, 0.0, 384).flat()
    with pytest.raises(DSparkConfigError, match="noise"):
        LatencyModel([1, 2], [1.0, 1.0], noise=-1.0)


def test_overhead_moves_the_level_not_the_growth():
    lat = LatencyModel([1, 100], [0.01, 0.02], ema=0.5)
    lat.observe_overhead(0.04)  # the first observation sets it, later ones move it by ema
    lat.observe_overhead(0.0)
    assert lat.overhead == pytest.approx(0.02) and lat.predict(1) == pytest.approx(0.03)
    assert lat.curve(100)[100].item() == pytest.approx(0.04)
    lat.observe(100, 0.02)  # the forward alone, as profiled: no correction
    assert lat.seconds == pytest.approx([0.01, 0.02])
    with pytest.raises(DSparkInputError, match="overhead"):
        lat.observe_overhead(-1.0)


def test_convex_curve_follows_the_online_correction():
    """The hull's vertices are found once, on the profile; the online correction adds an affine term, which keeps
    them, so the curve after corrections equals the hull of the corrected points computed afresh."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    prof = [1.0, 1.0, 1.1, 1.1, 1.6, 1.7, 1.75, 2.6]
    lat = LatencyModel(sizes, prof, ema=0.2)
    lat.observe_overhead(0.5)
    before = lat.host_convex_curve(1, 160)
    for q, t in [(16, 1.9), (128, 2.4), (64, 2.2), (2, 1.3)]:
        lat.observe(q, t)
    after = lat.host_convex_curve(1, 160)
    assert not np.allclose(before, after)
    again = LatencyModel(sizes, lat.seconds)
    again.observe_overhead(0.5)
    np.testing.assert_allclose(after, again.host_convex_curve(1, 160), rtol=1e-12)
    # a lower convex minorant of the curve: convex, and never above it
    assert np.all(np.diff(after, 2) >= -1e-12) and np.all(after <= lat.host_curve(1, 160) + 1e-12)


def test_fresh_copies_the_profile_without_online_state():
    lat = LatencyModel([1, 4, 8], [1.0, 2.5, 3.0], ema=0.5, noise=0.1)
    lat.measured = [1.1, 2.4, 3.0]
    lat.observe(4, 4.5)
    lat.observe_overhead(0.3)
    new = lat.fresh()
    assert new.seconds == [1.0, 2.5, 3.0] and new.sizes == [1, 4, 8] and new.noise == 0.1 and new.ema == 0.5
    assert new.measured == [1.1, 2.4, 3.0] and new.measured is not lat.measured
    assert new.overhead == 0.0 and new.observations == 0 and new.overhead_observations == 0
    new.observe(4, 9.0)  # its corrections are its own
    assert lat.seconds == pytest.approx([3.0, 4.5, 5.0])


def test_floor_hides_a_forward_shorter_than_the_host_launch():
    """T(Q) = overhead + max(floor, forward(Q)): a forward that ends within the host's own launch time costs
    nothing, one past it costs its excess; every host-side reading of the curve agrees with `predict`."""
    lat = LatencyModel([1, 100, 200], [1e-3, 2e-3, 4e-3], ema=0.5)
    lat.observe_overhead(5e-4)
    assert not lat.flat()
    lat.observe_floor(3e-3)  # the first observation sets it, later ones move it by ema
    lat.observe_floor(2e-3)
    assert lat.floor == pytest.approx(2.5e-3) and lat.floor_observations == 2
    assert lat.predict(1) == pytest.approx(3e-3) and lat.predict(100) == pytest.approx(3e-3)
    assert lat.predict(200) == pytest.approx(4.5e-3) and lat.forward(200) == pytest.approx(4e-3)
    q = np.arange(1, 251)
    want = np.asarray([lat.predict(x) for x in q])
    np.testing.assert_allclose(lat.host_curve(1, 250), want, rtol=1e-12)
    np.testing.assert_allclose(lat.host_at(q.astype(np.float64)), want, rtol=1e-12)
    convex = lat.host_convex_curve(1, 250)  # a convex minorant of predict, raised to the floor
    assert np.all(np.diff(convex, 2) >= -1e-12) and np.all(convex <= want + 1e-12)
    assert convex[0] == pytest.approx(3e-3) and convex[-1] == pytest.approx(lat.predict(250))
    # the floor above every point: no evidence that a larger step costs more
    lat.observe_floor(1.0)
    assert lat.flat()
    assert lat.fresh().floor == 0.0 and lat.fresh().floor_observations == 0
    with pytest.raises(DSparkInputError, match="floor"):
        lat.observe_floor(float("nan"))


def test_predict_each_is_predict_at_each_size_bit_for_bit():
    """The cost policy prices a round's row buckets with `predict_each` (plain floats): the same values as
    `predict` and as the NumPy curve, inside, between, on and past the profiled sizes, with a floor and an
    overhead, after online corrections."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        sizes = np.unique(rng.integers(1, 2000, size=int(rng.integers(2, 12)))).tolist()
        if len(sizes) < 2:
            continue
        lat = LatencyModel(sizes, np.sort(rng.uniform(1e-3, 9e-3, size=len(sizes))).tolist())
        lat.observe_overhead(float(rng.uniform(0, 5e-3)))
        lat.observe_floor(float(rng.uniform(0, 6e-3)))
        for _ in range(3):
            lat.observe(int(rng.integers(1, 2500)), float(rng.uniform(1e-3, 9e-3)))
        qs = sorted(set(rng.integers(0, 3000, size=30).tolist()) | set(sizes))
        got = lat.predict_each(qs)
        assert got == [lat.predict(q) for q in qs]
        assert got == lat.host_at(np.asarray(qs)).tolist()
