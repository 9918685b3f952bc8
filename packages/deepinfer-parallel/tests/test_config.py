"""ParallelConfig: defaults, derived numbers, typed validation errors."""

from __future__ import annotations

import dataclasses

import pytest
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.errors import ParallelConfigError


def test_defaults_and_derived():
    c = ParallelConfig()
    assert (c.dp_size, c.ep_size, c.num_redundant_experts, c.backend) == (1, 1, 0, "a2a")
    assert (c.enable_eplb, c.eplb_window_size, c.eplb_step_interval) == (False, 1000, 3000)
    c = ParallelConfig(dp_size=8, ep_size=4, num_redundant_experts=4)
    assert c.num_ep_groups == 2 and c.world_size == 8
    assert c.experts_per_rank(384) == 97
    assert (c.ep_group_of(5), c.ep_rank_of(5)) == (1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dp_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"dp_size": 0}, "dp_size"),
        ({"ep_size": 0}, "ep_size"),
        ({"dp_size": 6, "ep_size": 4}, "ep_size"),
        ({"num_redundant_experts": -1}, "num_redundant_experts"),
        ({"backend": "nccl"}, "backend"),
        ({"dp_size": 2.0}, "dp_size"),
        ({"ep_size": True}, "ep_size"),
        ({"enable_eplb": 1}, "enable_eplb"),
        ({"eplb_window_size": 0}, "eplb_window_size"),
        ({"eplb_step_interval": 0}, "eplb_step_interval"),
        ({"eplb_window_size": 20, "eplb_step_interval": 10}, "eplb_window_size"),
    ],
)
def test_invalid(kwargs, field):
    with pytest.raises(ParallelConfigError, match=field):
        ParallelConfig(**kwargs)


def test_check_experts_names_the_fix():
    c = ParallelConfig(dp_size=64, ep_size=64, num_redundant_experts=10)
    with pytest.raises(ParallelConfigError, match="num_redundant_experts=0"):
        c.check_experts(384)  # 394 % 64 != 0; 384 % 64 == 0 -> 0 (+ a multiple of 64)
    ParallelConfig(dp_size=64, ep_size=64, num_redundant_experts=64).check_experts(384)
    with pytest.raises(ParallelConfigError, match="rank"):
        c.ep_rank_of(64)
