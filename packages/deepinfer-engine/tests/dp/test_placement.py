"""Placement by load (not round-robin) and the per-rank imbalance statistics of the data-parallel front-end."""

from __future__ import annotations

import pytest
from deepinfer_engine.dp import DPStats, LoadBalancer, RankLoad, RankStep


def _empty(n: int, pages: int = 100) -> list[RankLoad]:
    return [RankLoad(free_pages=pages, total_pages=pages, free_slots=8) for _ in range(n)]


def test_a_long_prompt_and_short_ones_end_up_on_different_ranks() -> None:
    lb = LoadBalancer(_empty(2), page_size=4)
    ranks = [lb.choose(n) for n in (100, 10, 10, 10, 10, 10)]
    # round-robin would give rank 0 the long prompt plus two short ones
    assert ranks == [0, 1, 1, 1, 1, 1]
    assert lb.placed == [1, 5]


def test_reported_load_replaces_the_estimate_and_counts_queued_plus_running_tokens() -> None:
    lb = LoadBalancer(_empty(3), page_size=4)
    lb.report(0, RankLoad(queued_tokens=5, running_tokens=50, free_pages=80, total_pages=100))
    lb.report(1, RankLoad(queued_tokens=40, running_tokens=0, free_pages=90, total_pages=100))
    lb.report(2, RankLoad(queued_tokens=0, running_tokens=45, free_pages=70, total_pages=100))
    assert lb.choose(8) == 1  # 40 < 45 < 55 tokens
    assert lb.choose(8) == 2  # rank 1 now has 48 pending + reported
    lb.report(1, RankLoad(queued_tokens=0, running_tokens=0, free_pages=100, total_pages=100))
    assert lb.choose(8) == 1


def test_equal_load_prefers_free_cache_and_a_rank_that_cannot_hold_the_prompt_comes_last() -> None:
    lb = LoadBalancer([RankLoad(free_pages=3, total_pages=10), RankLoad(free_pages=9, total_pages=10)], page_size=4)
    assert lb.choose(4) == 1  # same tokens (0), more free pages
    lb = LoadBalancer([RankLoad(free_pages=2, total_pages=10), RankLoad(running_tokens=500, free_pages=9,
                                                                        total_pages=10)], page_size=4)
    assert lb.choose(20) == 1  # 5 pages do not fit in rank 0's 2 free pages, despite its lower load


def _step(kind: str, tokens: int, empty: bool = False, rebalanced: bool = False) -> RankStep:
    return RankStep(kind=kind, prefill_tokens=tokens if kind == "prefill" else 0,
                    decode_tokens=tokens if kind == "decode" else 0, empty=empty, seconds=0.0, load=RankLoad(),
                    rebalanced=rebalanced)


def test_stats_give_the_per_rank_imbalance() -> None:
    st = DPStats(world_size=2)
    assert st.add_step([_step("prefill", 30), _step("prefill", 10)]) == pytest.approx(1.5)
    assert st.add_step([_step("decode", 2), _step("decode", 0, empty=True)], ) == pytest.approx(2.0)
    assert st.add_step([_step("idle", 0), _step("idle", 0)]) is None
    d = st.as_dict([3, 1])
    assert d["tokens_per_rank"] == [32, 10] and d["empty_steps_per_rank"] == [0, 1]
    assert d["token_imbalance"] == pytest.approx(32 / 21) and d["mean_step_imbalance"] == pytest.approx(1.75)
    assert d["steps_by_kind"] == {"prefill": 1, "decode": 1, "idle": 1} and d["requests_per_rank"] == [3, 1]
