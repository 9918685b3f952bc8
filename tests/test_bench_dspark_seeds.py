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
