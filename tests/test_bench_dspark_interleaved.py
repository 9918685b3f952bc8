"""scripts/bench_dspark_interleaved.py: one round of every policy per cycle, in a seeded order; warm cycles and
cycles with a CUDA-graph capture or a stall are left out; cost's tokens/s against each rival is a ratio of sums
over the cycles they share, with a bootstrap over whole cycles."""

from __future__ import annotations

import types

import pytest


@pytest.fixture(scope="module")
def bench(script):
    return script("bench_dspark_interleaved")


class _Engine:
    """Steps of a fake engine: each round emits tokens by the policy in force (`spec.policy`), runs a verify step of
    8 rows per token (`SpecTiming.by_rows`), counts a decision on the device when it is on
    (`spec.decide_on_device`), and one step may capture a graph."""

    def __init__(self, emit: dict[str, int], capture_at: int | None = None, stall_at: int | None = None) -> None:
        self.spec = types.SimpleNamespace(policy=None, stats=types.SimpleNamespace(num_verified_tokens=0),
                                          timing=types.SimpleNamespace(policy_s=0.0, lag_s=0.0, decided=0, decide_s=0.0,
                                                                       warm_s=0.0, deferred_s=0.0,
                                                                       by_rows={8: [5, 0.1], 24: [1, 0.1]}),
                                          decide_on_device=False)
        self.clock, self.stall_at = 0.0, stall_at
        self.runner = types.SimpleNamespace(spec=self.spec, device=types.SimpleNamespace(type="cpu"),
                                            cuda_graphs=types.SimpleNamespace(stats=types.SimpleNamespace(capture_s=0.0)))
        self.total = types.SimpleNamespace(decode_tokens=0, prefill_tokens=0)
        self.emit, self.capture_at, self.steps, self.seen, self.discarded = emit, capture_at, 0, [], None

    def step_outputs(self) -> None:
        self.steps += 1
        name = getattr(self.spec.policy, "name", None)
        self.seen.append(name)
        self.total.decode_tokens += self.emit.get(name, 1)
        self.spec.stats.num_verified_tokens += 2 * self.emit.get(name, 1)
        self.spec.timing.policy_s += 1e-3
        self.spec.timing.lag_s += 5e-4 * (name == "cost")
        self.spec.timing.warm_s += 3e-4
        self.spec.timing.deferred_s += 4e-4
        self.spec.timing.decided += int(self.spec.decide_on_device)
        self.spec.timing.decide_s += 2e-3 * self.spec.decide_on_device
        entry = self.spec.timing.by_rows.setdefault(8 * self.emit.get(name, 1), [0, 0.0])
        entry[0] += 1
        self.clock += 100.0 if self.steps == self.stall_at else 1.0
        if self.steps == self.capture_at:
            self.runner.cuda_graphs.stats.capture_s += 1.0

    def has_unfinished_requests(self) -> bool:
        return True

    def discard(self, ids) -> None:
        self.discarded = list(ids)


class _LLM:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def _admit(self, prompts, sp):
        return prompts

    def _add(self, admitted):
        return [f"r{i}" for i in range(len(admitted))]


def _policies(*names):
    return [(n, types.SimpleNamespace(name=n)) for n in names]


def test_every_cycle_runs_each_policy_once_in_its_own_order(bench, monkeypatch):
    eng = _Engine({"a": 2, "b[device]": 3, "cost": 4}, capture_at=2 + 3 * 2 + 2,  # after 2 skipped steps, 1 warm
                  stall_at=2 + 3 * 6)  # and 1 timed cycle of 3 rounds: in timed cycle 1; a stall in the last one (4)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: eng.clock)
    got = bench.interleaved(_LLM(eng), _policies("a", "b[device]", "cost"), [[1]] * 4, [None] * 4, skip=2,
                            warm_cycles=1, cycles=5, seed=3)
    assert eng.steps == 2 + 3 * 6 and eng.discarded == ["r0", "r1", "r2", "r3"]
    cycles = [eng.seen[2 + 3 * k: 5 + 3 * k] for k in range(6)]
    assert all(sorted(c) == ["a", "b[device]", "cost"] for c in cycles) and len({tuple(c) for c in cycles}) > 1
    assert got["dropped"] == 1 and got["stalled"] == 1
    for name, tokens in (("a", 2), ("b[device]", 3), ("cost", 4)):
        rs = got["rounds"][name]
        assert [int(r[2]) for r in rs] == [0, 2, 3]
        lag = 5e-4 * (name == "cost")
        assert all(r[0] == tokens and r[1] == 1.0 and r[3] == 2 * tokens and r[4] == pytest.approx(1e-3 + lag)
                   for r in rs)
        # a [device] rival decides on the device; the others on the host
        assert all(r[5] == (1 if name.endswith("[device]") else 0) for r in rs), name
        assert all(r[6] == 8 * tokens for r in rs), name  # the row bucket its verify step ran
        # the host's seconds planning and launching a decision on the device
        assert all(r[7] == pytest.approx(2e-3 if name.endswith("[device]") else 0.0) for r in rs), name
        # the policy's other host work: warm-up, deferred statistics, the lagged search (of r[4])
        assert all(r[8:] == pytest.approx([3e-4, 4e-4, lag]) for r in rs), name
    per = bench.compare(got["rounds"])["policies"]
    assert per["cost"]["lag_ms_per_round"] == pytest.approx(0.5) and per["a"]["lag_ms_per_round"] == 0.0
    assert per["a"]["warm_ms_per_round"] == pytest.approx(0.3) and per["a"]["deferred_ms_per_round"] == pytest.approx(0.4)


def test_compare_is_a_ratio_of_sums_over_shared_cycles(bench):
    rounds = {"cost": [[6, 1.0, 0], [2, 1.0, 1], [6, 2.0, 2]], "rival": [[4, 1.0, 0], [4, 1.0, 1], [4, 2.0, 2]],
              "late": [[1, 1.0, 2]]}
    out = bench.compare(rounds)
    assert out["policies"]["cost"] == {"rounds": 3, "tokens": 14, "seconds": 4.0, "tokens_per_s": 3.5}
    p = out["paired"]["rival"]
    assert p["ratio"] == pytest.approx(3.5 / 3.0) and p["low"] <= p["ratio"] <= p["high"]
    assert (p["ahead"], p["cycles"]) == (2, 3)
    assert out["paired"]["late"]["ratio"] == pytest.approx(3.0) and out["paired"]["late"]["cycles"] == 1


def test_by_rows_sets_each_buckets_round_time_beside_the_curves_price(bench):
    rounds = {"cost": [[6, 0.010, 0, 3, 0.0, 0, 64], [6, 0.014, 1, 3, 0.0, 0, 96]],
              "rival": [[4, 0.012, 0, 2, 0.0, 0, 64], [4, 0.011, 1, 2, 0.0, 0, 0]],  # 0: a round without a verify step
              "old": [[4, 0.011, 0]]}  # records without rows are left out
    curve = types.SimpleNamespace(predict=lambda q: 1e-4 * q)
    got = bench.by_rows(rounds, curve)
    assert [b["rows"] for b in got] == [64, 96]
    assert got[0]["rounds"] == 2 and got[0]["ms"] == pytest.approx(11.0) and got[0]["cost_ms"] == pytest.approx(10.0)
    assert got[1]["rounds"] == got[1]["cost_rounds"] == 1 and got[1]["curve_ms"] == pytest.approx(9.6)
    assert bench.by_rows({"rival": rounds["rival"]}, None) == [
        {"rows": 64, "rounds": 1, "ms": pytest.approx(12.0), "cost_rounds": 0, "cost_ms": None, "curve_ms": None}]


def test_sweep_sums_up_each_rival_over_the_cells(bench):
    def pair(ratio, low, high):
        return {"ratio": ratio, "low": low, "high": high}

    cells = [{"paired": {"verify_all": pair(1.10, 1.05, 1.15), "threshold[0.2]": pair(0.98, 0.95, 1.01)}},
             {"paired": {"verify_all": pair(1.00, 0.97, 1.03), "threshold[0.2]": pair(1.04, 1.01, 1.07)}},
             {"paired": {"verify_all": pair(0.90, 0.85, 0.95)}},  # a rival left out of a cell
             {"other": {}}]
    got = bench.sweep(cells)
    assert list(got) == ["verify_all", "threshold[0.2]"]
    v = got["verify_all"]
    assert v["cells"] == 3 and v["geomean"] == pytest.approx((1.10 * 1.00 * 0.90) ** (1 / 3))
    assert (v["min"], v["max"]) == (0.90, 1.10) and (v["won"], v["tied"], v["lost"]) == (1, 1, 1)
    t = got["threshold[0.2]"]
    assert t["cells"] == 2 and t["geomean"] == pytest.approx((0.98 * 1.04) ** 0.5)
    assert (t["won"], t["tied"], t["lost"]) == (1, 1, 0)
    assert bench.sweep(cells, key="paired_device") == {}
