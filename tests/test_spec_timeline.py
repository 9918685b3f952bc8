"""scripts/spec_timeline.py's attribution of device idle time to host phases: a synthetic trace with nested phases,
skipped steps and overlapping device intervals, and the category names of a real torch profiler trace (CPU)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def timeline(script):
    return script("spec_timeline")


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_time_goes_to_the_innermost_open_phase(timeline):
    ev = [
        _x("user_annotation", "step", 0, 100),  # skipped
        _x("kernel", "k", 10, 80),
        _x("user_annotation", "step", 100, 100),
        _x("user_annotation", "begin", 110, 40),
        _x("user_annotation", "policy", 115, 5),
        _x("kernel", "k", 120, 10),
        _x("gpu_memcpy", "c", 125, 10),  # overlaps the kernel: busy 120..135
        _x("kernel", "k", 160, 20),
        _x("cpu_op", "aten::add", 170, 5),  # not a phase
    ]
    got = timeline.idle_by_phase({"traceEvents": ev}, skip=1, names={"step", "begin", "policy"})
    assert got["steps"] == 1 and got["wall_us_per_step"] == 100
    assert got["busy_us_per_step"] == 35  # 120..135 and 160..180
    # idle: 100..110 and 150..160 and 180..200 outside the phases, 110..115 and 135..150 in begin, 115..120 in policy
    assert got["idle_by_phase_us_per_step"] == {"(none)": 40, "begin": 20, "policy": 5}
    assert got["idle_us_per_step"] == 65


def test_a_torch_profiler_trace_has_the_categories_it_reads(timeline, tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("step"), record_function("begin"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    got = timeline.idle_by_phase(json.loads(path.read_text()), skip=1, names={"step", "begin"})
    # no device on the CPU: the whole window is idle, most of it inside `begin`
    assert got["steps"] == 1 and got["busy_us_per_step"] == 0
    assert got["idle_by_phase_us_per_step"]["begin"] > 0
