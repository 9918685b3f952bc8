"""AcceptanceStats: histogram, tau, per-position and conditional acceptance, efficiency, confidence error, merge."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import AcceptanceStats, DSparkInputError, rejection_accept


def test_by_hand():
    s = AcceptanceStats(3)
    # Step 1: (accepted, drafts) = (2, 3), (0, 1), (3, 3); step 2: (1, 2), (0, 0).
    s.update([2, 0, 3], [3, 1, 3])
    s.update(torch.tensor([1, 0]), torch.tensor([2, 0]))
    assert s.request_steps == 5
    assert s.histogram == [2, 1, 1, 1]
    assert s.generated_tokens == (2 + 0 + 3 + 1 + 0) + 5
    assert s.mean_accepted_length == pytest.approx(11 / 5)
    assert s.verified == [4, 3, 2]
    assert s.accepted == [3, 2, 1]
    assert s.reached == [4, 3, 2]  # position 1 reached by (2,3), (3,3), (1,2); position 2 by (2,3), (3,3)
    assert s.acceptance_by_position() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert s.conditional_acceptance_by_position() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert s.verification_efficiency == pytest.approx(6 / 9)
    assert s.confidence_error is None
    d = s.as_dict()
    assert d["histogram"] == [2, 1, 1, 1] and d["request_steps"] == 5


def test_reached_differs_from_verified_after_early_rejection():
    s = AcceptanceStats(2)
    s.update([0, 1], [2, 2])  # first request stops at position 0: position 1 verified but not reached
    assert s.verified == [2, 2] and s.reached == [2, 1] and s.accepted == [1, 0]
    assert s.acceptance_by_position() == [0.5, 0.0]
    assert s.conditional_acceptance_by_position() == [0.5, 0.0]


def test_confidence_error_only_over_verified_positions():
    s = AcceptanceStats(3)
    conf = torch.tensor([[0.9, 0.5, 0.1], [0.2, 0.2, 0.2]])
    prob = torch.tensor([[0.8, 0.7, 0.9], [0.0, 0.0, 0.0]])
    s.update([1, 0], [2, 1], confidence=conf, accept_prob=prob)
    assert s.confidence_error == pytest.approx((0.1 + 0.2 + 0.2) / 3)


def test_merge_equals_single_accumulator():
    a, b, both = AcceptanceStats(4), AcceptanceStats(4), AcceptanceStats(4)
    a.update([1, 4], [2, 4])
    b.update([0, 3, 2], [0, 4, 2])
    both.update([1, 4], [2, 4])
    both.update([0, 3, 2], [0, 4, 2])
    a.merge(b)
    assert a.as_dict() == both.as_dict()


def test_stats_from_rejection_sampling_match_analytic_rate():
    # One draft per request with acceptance probability sum min(p, q) = 0.6.
    n = 20_000
    p = torch.tensor([0.6, 0.4, 0.0])
    q = torch.tensor([0.0, 0.4, 0.6])  # sum min = 0.4
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0))[:, None]
    r = rejection_accept(torch.stack([p, p]).repeat(n, 1), drafts, q.expand(n, 1, 3), [1] * n,
                         generator=torch.Generator().manual_seed(1))
    s = AcceptanceStats(1)
    s.update(r.num_accepted, [1] * n, confidence=torch.full((n, 1), 0.4), accept_prob=r.accept_prob)
    assert s.acceptance_by_position()[0] == pytest.approx(0.4, abs=0.015)  # binomial std 0.0035
    assert s.mean_accepted_length == pytest.approx(1.4, abs=0.015)
    assert s.confidence_error == pytest.approx(0.0, abs=1e-6)


def test_errors():
    s = AcceptanceStats(2)
    with pytest.raises(DSparkInputError, match="accepted"):
        s.update([3], [2])
    with pytest.raises(DSparkInputError, match="drafts"):
        s.update([0], [3])
    with pytest.raises(DSparkInputError, match="lengths"):
        s.update([0, 0], [1])
    with pytest.raises(DSparkInputError, match="both"):
        s.update([0], [1], confidence=torch.zeros(1, 2))
    with pytest.raises(DSparkInputError, match="block_size"):
        AcceptanceStats(0)
    with pytest.raises(DSparkInputError, match="block_size"):
        s.merge(AcceptanceStats(3))


def test_token_counters_per_step_and_merge():
    s = AcceptanceStats(5)
    s.update([2, 0, 5], [3, 1, 5])  # proposed defaults to the block size per request
    s.update([1], [4], num_proposed=[4])
    assert (s.num_draft_tokens, s.num_verified_tokens, s.num_accepted_tokens) == (19, 13, 8)
    assert s.steps == 2 and s.request_steps == 4
    assert s.verified_tokens_per_step == pytest.approx(6.5)
    assert s.verified_tokens_per_request_step == pytest.approx(13 / 4)
    assert s.mean_accepted_length == pytest.approx((8 + 4) / 4)
    other = AcceptanceStats(5)
    other.update([0], [0])
    s.merge(other)
    assert (s.num_draft_tokens, s.num_verified_tokens, s.steps) == (24, 13, 3)
    d = s.as_dict()
    assert d["num_verified_tokens"] == 13 and d["num_draft_tokens"] == 24
    with pytest.raises(DSparkInputError, match="num_proposed"):
        s.update([0], [3], num_proposed=[2])


def test_predicted_survivals_by_hand():
    s = AcceptanceStats(3)
    assert s.predicted_acceptance_by_position() is None and s.survival_calibration is None
    surv = [[0.9, 0.5, 0.2], [0.4, 0.1, 0.05]]
    s.update([2, 0], [3, 1], survival=surv)  # only the verified positions count: (0, 1, 2) and (0,)
    assert s.predicted == pytest.approx([1.3, 0.5, 0.2])
    assert s.predicted_acceptance_by_position() == pytest.approx([0.65, 0.5, 0.2])
    assert s.survival_calibration == pytest.approx(2.0 / 2)  # 2.0 predicted, 2 accepted
    s.update(torch.tensor([1]), torch.tensor([2]), survival=torch.tensor([[0.5, 0.25, 0.0]]))
    assert s.survival_calibration == pytest.approx(2.75 / 3)
    other = AcceptanceStats(3)
    other.update([0], [1], survival=[[0.5, 0.0, 0.0]])
    s.merge(other)
    assert s.predicted == pytest.approx([2.3, 0.75, 0.2]) and s.as_dict()["survival_calibration"] == pytest.approx(3.25 / 3)
    with pytest.raises(DSparkInputError, match=r"survival: expected \[1, 3\]"):
        s.update([0], [1], survival=[[0.5, 0.1]])


def test_survival_reliability_by_hand():
    """Verified drafts binned by their survival: count, mean survival, share accepted; unverified positions and NaN
    survivals count nowhere; 1.0 and overshoots land in the last bin; merge adds the bins."""
    s = AcceptanceStats(3)
    assert s.survival_reliability() == [] and s.as_dict()["survival_reliability"] == []
    # request 0 verifies 3 and accepts 2: (0.95 yes, 0.6 yes, 0.07 no); request 1 verifies 2, accepts 0:
    # (0.08 no, 0.04 no); its third survival (0.5) is not verified
    s.update([2, 0], [3, 2], survival=[[0.95, 0.6, 0.07], [0.08, 0.04, 0.5]])
    got = {(b["lo"], b["hi"]): (b["n"], round(b["predicted"], 6), b["realized"]) for b in s.survival_reliability()}
    assert got == {(0.0, 0.05): (1, 0.04, 0.0), (0.05, 0.1): (2, 0.075, 0.0), (0.5, 0.7): (1, 0.6, 1.0),
                   (0.9, 1.0): (1, 0.95, 1.0)}
    bins = s.survival_reliability()  # its totals are the verified / accepted counts and the summed survivals
    assert sum(b["n"] for b in bins) == s.num_verified_tokens and sum(round(b["n"] * b["realized"]) for b in bins) == 2
    assert sum(b["n"] * b["predicted"] for b in bins) == pytest.approx(sum(s.predicted))
    other = AcceptanceStats(3)
    other.update([1], [2], survival=[[1.0, float("nan"), 0.0]])
    s.merge(other)
    last = s.survival_reliability()[-1]
    assert (last["n"], last["predicted"], last["realized"]) == (2, pytest.approx(0.975), 1.0)
    assert sum(b["n"] for b in s.survival_reliability()) == 6  # the NaN survival is in no bin


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_survival_calibration_of_sampled_rounds(scale):
    """Rounds whose drafts are accepted with the conditional probabilities the survivals come from: calibration
    1 within its sampling error (and the predicted acceptance by position equals the realised one); survivals
    scaled by 0.5 read 0.5."""
    g = torch.Generator().manual_seed(0)
    n, width = 4000, 4
    cond = torch.rand(n, width, generator=g) * 0.8 + 0.15
    surv = torch.cumprod(cond, 1)
    ok = torch.rand(n, width, generator=g) < cond
    accepted = torch.cumprod(ok.long(), 1).sum(1)
    m = torch.randint(0, width + 1, (n,), generator=g)  # verified drafts, independent of the outcomes
    s = AcceptanceStats(width)
    s.update(torch.minimum(accepted, m), m, survival=surv * scale)
    assert s.survival_calibration == pytest.approx(scale, rel=0.04)
    if scale == 1.0:
        assert s.predicted_acceptance_by_position() == pytest.approx(s.acceptance_by_position(), abs=0.045)
    big = [b for b in s.survival_reliability() if b["n"] >= 300]
    assert len(big) >= 5  # calibrated by level too, not only on average (scaled: realized = predicted / scale)
    assert all(b["realized"] == pytest.approx(b["predicted"] / scale, abs=0.06) for b in big), big


def test_counts_equal_a_request_by_request_count():
    import random

    rng = random.Random(0)
    n = 6
    s = AcceptanceStats(n)
    hist, verified, reached, accepted = [0] * (n + 1), [0] * n, [0] * n, [0] * n
    for batch in (0, 1, 5, 64):
        drafts = [rng.randint(0, n) for _ in range(batch)]
        acc = [rng.randint(0, m) for m in drafts]
        s.update(acc, drafts)
        for a, m in zip(acc, drafts):
            hist[a] += 1
            for j in range(m):
                verified[j] += 1
                reached[j] += j <= a
                accepted[j] += j < a
    assert (s.histogram, s.verified, s.reached, s.accepted) == (hist, verified, reached, accepted)
    assert s.request_steps == 70 and s.steps == 4 and s.num_draft_tokens == 70 * n


def test_survival_sums_and_bins_equal_a_draft_by_draft_count():
    """The survival accumulators (`predicted`, `reliability`) against a draft-by-draft count: verified drafts
    only, NaN survivals in no bin (but in no sum either), values past 1 in the last bin, exact bin edges upward."""
    import random

    import numpy as np
    from deepinfer_dspark.stats import RELIABILITY_EDGES

    rng = random.Random(1)
    n = 5
    s = AcceptanceStats(n)
    predicted, rel = [0.0] * n, [[0, 0.0, 0] for _ in RELIABILITY_EDGES[1:]]
    picks = [0.0, 0.05, 0.1, 0.3, 1.0, 1.0000001, float("nan")]
    for batch in (1, 7, 64):
        drafts = [rng.randint(0, n) for _ in range(batch)]
        acc = [rng.randint(0, m) for m in drafts]
        surv = np.asarray([[rng.choice(picks) if rng.random() < 0.3 else rng.random() for _ in range(n)]
                           for _ in range(batch)])
        s.update(acc, drafts, survival=surv)
        for b, (a, m) in enumerate(zip(acc, drafts)):
            for j in range(m):
                v = float(surv[b, j])
                if v != v:
                    continue
                predicted[j] += v
                i = min(max(sum(v >= e for e in RELIABILITY_EDGES) - 1, 0), len(rel) - 1)
                rel[i][0] += 1
                rel[i][1] += v
                rel[i][2] += j < a
    assert s.predicted == pytest.approx(predicted)
    assert [r[0] for r in s.reliability] == [r[0] for r in rel] and [r[2] for r in s.reliability] == [r[2] for r in rel]
    assert [r[1] for r in s.reliability] == pytest.approx([r[1] for r in rel])
