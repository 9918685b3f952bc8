"""Small tensors on 2 shared cores: intra-op threads only add overhead, so tests run single-threaded."""

from __future__ import annotations

import random

import pytest
import torch
from deepinfer_dspark import LatencyModel


@pytest.fixture(autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _noisy_profile(true_seconds, noise, repeats=7, seed=0, outliers=()):
    """LatencyModel.profile of a fake step whose time is true_seconds(q) plus uniform noise of +-noise seconds;
    `outliers`: (call index, extra seconds) for stray slow calls."""
    rng = random.Random(seed)
    now = [0.0]
    calls = [0]
    extra = dict(outliers)

    def step(q):
        now[0] += true_seconds(q) + rng.uniform(-noise, noise) + extra.get(calls[0], 0.0)
        calls[0] += 1

    return LatencyModel.profile(step, [1, 2, 4, 8, 16, 32, 64, 128, 256, 384], warmup=0, repeats=repeats,
                                timer=lambda: now[0])


@pytest.fixture
def noisy_profile():
    """`LatencyModel.profile` of a fake step with uniform noise (`_noisy_profile`)."""
    return _noisy_profile
