"""Clamped SwiGLU expert and routed combine (docs/model.md §2, pitfall 7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer_kernels.moe import moe_experts, swiglu_expert


def test_clamp_gate_one_sided_up_two_sided() -> None:
    x = torch.tensor([[1.0]])
    w1 = torch.tensor([[50.0], [-50.0]])  # gate 50 -> min(50, 10) = 10; gate -50 stays -50
    w3 = torch.tensor([[-30.0], [30.0]])  # up -30 -> -10; up 30 -> 10
    w2 = torch.tensor([[1.0, 1.0]])
    y = swiglu_expert(x, w1, w3, w2, 10.0)
    want = F.silu(torch.tensor(10.0)) * -10 + F.silu(torch.tensor(-50.0)) * 10
    assert torch.allclose(y, want.reshape(1, 1), atol=1e-5)


def test_moe_combine_weights() -> None:
    x = torch.tensor([[1.0], [2.0]])
    eye = (torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1))  # y = silu(x) * x
    dbl = (torch.ones(1, 1), torch.ones(1, 1), 2 * torch.ones(1, 1))
    out = moe_experts(x, torch.tensor([[0.25, 0.75], [1.0, 0.0]]), torch.tensor([[0, 1], [1, 0]]), [eye, dbl], 10.0)
    f = lambda v: F.silu(torch.tensor(v)) * v  # noqa: E731
    assert torch.allclose(out[0, 0], 0.25 * f(1.0) + 0.75 * 2 * f(1.0))
    assert torch.allclose(out[1, 0], 2 * f(2.0))
