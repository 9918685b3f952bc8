"""scripts/bench_dspark_policies.py gives every request its own seed: a seed is per request, so one seed shared by
the batch would make every request draw the same uniforms (a temperature-1 run would read one random path)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(script):
    return script("bench_dspark_policies")


def test_request_params_give_each_request_its_own_seed(bench):
    from deepinfer_engine import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1000)
    params = bench.request_params(sp, 64)
    assert len(params) == 64 and len({p.seed for p in params}) == 64
    assert all(p.max_tokens == 8 and p.temperature == 1.0 for p in params)
    assert [p.seed for p in bench.request_params(sp, 64)] == [p.seed for p in params]  # reproducible
    assert {p.seed for p in bench.request_params(sp.replace(seed=1001), 64)}.isdisjoint({p.seed for p in params})
    # a list keeps its per-request settings; no seed stays no seed (the engine derives one per request)
    mixed = bench.request_params([sp.replace(max_tokens=n) for n in (3, 5)], 2)
    assert [p.max_tokens for p in mixed] == [3, 5] and mixed[0].seed != mixed[1].seed
    assert all(p.seed is None for p in bench.request_params(sp.replace(seed=None), 3))


def test_run_order_shuffles_each_repeat_reproducibly(bench):
    """Each repeat times plain and the policies in its own order: every run once, the same order again for the
    same (seed, repeat), and over a run's repeats no position held by one policy throughout."""
    orders = [bench.run_order(5, 1000, rep) for rep in range(12)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert orders == [bench.run_order(5, 1000, rep) for rep in range(12)]
    assert all(len({o[k] for o in orders}) > 1 for k in range(5))
    assert orders != [bench.run_order(5, 1001, rep) for rep in range(12)]
