"""SurvivalCalibration: the map learns each class's observed acceptance by survival level, stays monotone, keeps
the head's values where it has seen nothing, and follows a changing load."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_dspark import DSparkConfigError, DSparkInputError, SurvivalCalibration


def _rounds(cal: SurvivalCalibration, rng: np.random.Generator, truth, greedy: bool, rounds: int = 40) -> None:
    """Rounds of 64 requests x 5 drafts whose draft j is accepted with probability truth(survival[j]) given the
    ones before it (survivals non-increasing per request, every draft verified)."""
    for _ in range(rounds):
        conf = rng.uniform(0.3, 1.0, size=(64, 5))
        surv = np.cumprod(conf, axis=1)
        accepted = np.zeros(64, dtype=np.int64)
        for b in range(64):
            k = 0
            while k < 5 and rng.random() < truth(surv[b, k]) / (truth(surv[b, k - 1]) if k else 1.0):
                k += 1
            accepted[b] = k
        cal.update(surv, np.full(64, 5), accepted, np.full(64, greedy))


def test_the_map_learns_each_class_on_its_own():
    """Greedy rows accept far less than the head says below 0.5 (the testbed at temperature 0); sampled rows as it
    says. Each class's map finds its own truth; the other class is untouched."""
    rng = np.random.default_rng(0)
    cal = SurvivalCalibration(decay=1.0)
    def greedy_truth(s):
        return s if s >= 0.5 else 0.05 * s
    _rounds(cal, rng, greedy_truth, greedy=True)
    _rounds(cal, rng, lambda s: s, greedy=False)
    probe = np.asarray([[0.9, 0.6, 0.4, 0.2, 0.1]] * 2)
    got = cal.apply(probe, np.asarray([True, False]))
    assert got[0, 2] < 0.1 and got[0, 3] < 0.05 and abs(got[0, 0] - 0.9) < 0.08  # greedy: below 0.5 near zero
    np.testing.assert_allclose(got[1], probe[1], atol=0.08)  # sampled: the identity, within sampling noise
    assert np.all(np.diff(got, axis=1) <= 1e-12)  # still non-increasing along each request
    # one class's map elementwise, on values of any shape (the ranked survivals the cost policy prices)
    np.testing.assert_array_equal(cal.map(probe[0], True), got[0])
    np.testing.assert_array_equal(cal.map(probe.reshape(-1), False).reshape(2, 5)[1], got[1])


def test_without_data_the_map_is_the_identity_and_nan_stays_nan():
    cal = SurvivalCalibration()
    probe = np.asarray([[1.0, 0.7, 0.33, 0.05, np.nan]])
    got = cal.apply(probe, np.asarray([True]))
    # between the bin centres the identity is kept exactly; outside them it is clamped to the nearest centre
    np.testing.assert_allclose(got[0, 1:3], probe[0, 1:3], rtol=1e-12)
    assert got[0, 0] == pytest.approx(0.975) and got[0, 3] == pytest.approx(0.05) and np.isnan(got[0, 4])


def test_unverified_drafts_teach_nothing_and_decay_follows_a_changing_load():
    cal = SurvivalCalibration(decay=0.5)
    surv = np.asarray([[0.8, 0.4, 0.2]])
    cal.update(surv, np.asarray([1]), np.asarray([1]), np.asarray([False]))
    assert cal.drafts.sum() == 1 and cal.accepted.sum() == 1  # only the verified draft counts
    for _ in range(30):  # then the level of 0.8 stops being accepted: the old rounds fade
        cal.update(surv, np.asarray([1]), np.asarray([0]), np.asarray([False]))
    before = cal.apply(surv, np.asarray([False]))[0, 0]
    assert before < 0.8 * cal.prior / (cal.prior + 1.0) + 1e-9
    with pytest.raises(DSparkInputError, match="update"):
        cal.update(surv, np.asarray([1, 2]), np.asarray([0]), np.asarray([False]))
    with pytest.raises(DSparkInputError, match="apply"):
        cal.apply(surv, np.asarray([False, True]))
    with pytest.raises(DSparkConfigError, match="decay"):
        SurvivalCalibration(decay=0.0)
