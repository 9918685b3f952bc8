"""compress_pool: per-channel softmax pooling (docs/model.md §C.3 ratio 2, docs/model.md §A.6/A.7)."""

from __future__ import annotations

import math

import torch
from deepinfer_kernels.compressor import compress_pool


def test_ratio2_softmax_pooling_hand_case() -> None:
    # one group of 2 tokens, 2 channels; channel 0 gates 1:3, channel 1 gates equal
    a = torch.tensor([[[1.0, 10.0], [3.0, 20.0]]])
    z = torch.tensor([[[0.0, 5.0], [math.log(3.0), 5.0]]])
    out = compress_pool(a, z)
    assert torch.allclose(out, torch.tensor([[0.25 * 1 + 0.75 * 3, 15.0]]), atol=1e-6)


def test_absent_candidates_are_ignored() -> None:
    a = torch.tensor([[[100.0], [2.0]]])
    z = torch.tensor([[[float("-inf")], [0.0]]])
    assert torch.allclose(compress_pool(a, z), torch.tensor([[2.0]]))
