"""MoE routing references (docs/model.md §A.8): sqrtsoftplus, bias for selection only, renorm x scale, hash."""

from __future__ import annotations

import math

import torch
from deepinfer_kernels.routing import gate_scores, select_experts


def test_sqrtsoftplus_hand_value() -> None:
    x, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    s = gate_scores(x, w, "sqrtsoftplus")
    assert torch.allclose(s, torch.tensor([[math.sqrt(math.log1p(math.e**2)), math.sqrt(math.log(2.0))]]))


def test_bias_changes_selection_not_weights() -> None:
    scores = torch.tensor([[0.9, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 1.0])
    w, ids = select_experts(scores, 2, bias=bias, route_scale=1.5)
    assert sorted(ids[0].tolist()) == [0, 2]
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert math.isclose(got[0], 0.9 / 1.3 * 1.5, rel_tol=1e-6)
    assert math.isclose(got[2], 0.4 / 1.3 * 1.5, rel_tol=1e-6)


def test_per_token_bias_and_hash_ids() -> None:
    scores = torch.tensor([[0.9, 0.5, 0.4], [0.9, 0.5, 0.4]])
    bias = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    _, ids = select_experts(scores, 1, bias=bias)
    assert ids[:, 0].tolist() == [0, 1]
    w, ids = select_experts(scores, 2, hash_ids=torch.tensor([[2, 1], [0, 2]]), route_scale=1.0)
    assert ids.tolist() == [[2, 1], [0, 2]]
    assert torch.allclose(w[0], torch.tensor([0.4 / 0.9, 0.5 / 0.9]))
