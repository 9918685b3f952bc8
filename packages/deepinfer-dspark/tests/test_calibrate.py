"""STS fitting recovers the temperature that generated the outcomes and respects `reached`."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import DSparkInputError, fit_sts


def test_recovers_generating_temperatures():
    g = torch.Generator().manual_seed(0)
    m = 40000
    z = torch.randn(m, 3, generator=g) * 3
    true_t = torch.tensor([0.5, 1.0, 2.0])
    y = (torch.rand(m, 3, generator=g) < torch.sigmoid(z / true_t)).double()
    got = fit_sts(z, y)
    for t, want in zip(got, true_t.tolist()):
        assert t == pytest.approx(want, rel=0.12)
    # soft targets: the analytic probabilities themselves give the exact temperature on the grid
    assert fit_sts(z, torch.sigmoid(z / true_t)) == pytest.approx((0.5, 1.0, 2.0), rel=0.03)


def test_reached_mask_and_empty_positions():
    z = torch.tensor([[2.0, 2.0], [2.0, -2.0]])
    y = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    reached = torch.tensor([[True, False], [True, False]])
    t = fit_sts(z, y, reached)
    assert t[1] == 1.0  # no sample reached position 1
    assert t[0] == min(torch.logspace(-5, 5, 121, base=2.0).tolist())  # always accepted: sharpest temperature
    with pytest.raises(DSparkInputError, match="targets"):
        fit_sts(z, y * 2)
    with pytest.raises(DSparkInputError, match="shapes"):
        fit_sts(z, y[:, :1])
