"""ExpertLoadRecorder: counts from top-k ids, -1 ignored, sliding window, mean, typed errors."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.eplb import ExpertLoadRecorder
from deepinfer_parallel.errors import ParallelConfigError


def test_counts_one_step_by_hand():
    rec = ExpertLoadRecorder(num_layers=2, num_experts=4, window=3)
    rec.record(0, torch.tensor([[0, 1], [1, 3], [-1, 1]]))
    rec.record(1, torch.tensor([[2, 2]], dtype=torch.int32))
    assert rec.current().tolist() == [[1, 3, 0, 1], [0, 0, 2, 0]]
    assert rec.load().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]], "the open step is not in the window yet"
    rec.step()
    assert rec.num_steps == 1
    assert rec.load().tolist() == [[1, 3, 0, 1], [0, 0, 2, 0]]
    assert rec.current().tolist() == [[0] * 4, [0] * 4]


def test_sliding_window_drops_oldest():
    rec = ExpertLoadRecorder(num_layers=1, num_experts=3, window=2)
    for step, expert in enumerate([0, 1, 2, 2]):
        rec.record(0, torch.full((step + 1, 1), expert))
        rec.step()
    # Window = the last two steps: 3 tokens to expert 2, then 4 tokens to expert 2.
    assert rec.load().tolist() == [[0, 0, 7]]
    assert rec.per_step()[:, 0].tolist() == [[0, 0, 3], [0, 0, 4]]
    assert torch.allclose(rec.load(reduce="mean"), torch.tensor([[0.0, 0.0, 3.5]]))


def test_per_step_before_window_full_is_oldest_first():
    rec = ExpertLoadRecorder(num_layers=1, num_experts=2, window=4)
    rec.record(0, torch.tensor([[0]]))
    rec.step()
    rec.record(0, torch.tensor([[1], [1]]))
    rec.step()
    assert rec.per_step()[:, 0].tolist() == [[1, 0], [0, 2]]
    rec.reset()
    assert rec.num_steps == 0 and rec.load().sum() == 0


def test_matches_bincount_on_random_ids():
    g = torch.Generator().manual_seed(0)
    rec = ExpertLoadRecorder(num_layers=3, num_experts=16, window=5)
    expected = torch.zeros(3, 16, dtype=torch.int64)
    for _ in range(5):
        for layer in range(3):
            ids = torch.randint(-1, 16, (37, 6), generator=g)
            rec.record(layer, ids)
            valid = ids[ids >= 0]
            expected[layer] += torch.bincount(valid, minlength=16)
        rec.step()
    assert torch.equal(rec.load(), expected)


def test_errors():
    with pytest.raises(ParallelConfigError, match="window"):
        ExpertLoadRecorder(num_layers=1, num_experts=2, window=0)
    rec = ExpertLoadRecorder(num_layers=1, num_experts=2, window=1)
    with pytest.raises(ParallelConfigError, match="layer"):
        rec.record(1, torch.tensor([[0]]))
    with pytest.raises(ParallelConfigError, match="topk_ids"):
        rec.record(0, torch.tensor([0, 1]))
    with pytest.raises(ParallelConfigError, match="num_experts=2"):
        rec.record(0, torch.tensor([[2]]))
    with pytest.raises(ParallelConfigError, match="reduce"):
        rec.load(reduce="max")
