"""The decode-step table of `bench latency` (bench.format_roofline) with and without recorded device state."""

from __future__ import annotations

from deepinfer_engine.bench import format_roofline


def _row(b: int, step_ms: float, state: dict[str, float] | None) -> dict:
    row = {"batch_size": b, "step_s": step_ms / 1e3, "tokens_per_s": b / (step_ms / 1e3),
           "bytes": {"total": 2.5e9}, "bytes_bound_s": 0.6e-3, "fraction_of_bound": 0.6 / step_ms}
    if state is not None:
        row["device_state"] = state
    return row


def _roof(rows: list[dict]) -> dict:
    return {"device": "cuda", "gpu": "H200", "copy_bandwidth_Bps": 4.2e12, "bf16_matmul_flops": 7.6e14,
            "input_len": 1024, "rows": rows}


def test_roofline_table_shows_the_sm_clock_of_each_row_when_recorded() -> None:
    state = {"sm_clock_mhz": 1755.0, "temperature_c": 61.0, "power_w": 512.4}
    lines = format_roofline(_roof([_row(1, 1.2, state), _row(64, 9.6, None)])).splitlines()
    assert lines[2].split()[-3:] == ["MHz", "C", "W"]
    assert lines[3].split()[-3:] == ["1755", "61", "512"]
    assert lines[4].split()[-3:] == ["-", "-", "-"]  # a row without telemetry keeps the columns aligned
    assert len(lines[3]) == len(lines[4]) == len(lines[2]) == len(lines[-1])


def test_roofline_table_has_no_clock_columns_without_telemetry() -> None:
    lines = format_roofline(_roof([_row(1, 1.2, None)])).splitlines()
    assert "MHz" not in lines[2] and lines[-1] == "=" * 97


def test_roofline_table_shows_the_range_of_repeated_measurements() -> None:
    rep = _row(64, 9.6, None) | {"step_s_repeats": [9.562e-3, 10.432e-3, 10.232e-3]}
    lines = format_roofline(_roof([_row(1, 1.2, None), rep])).splitlines()
    assert lines[2].split()[-2:] == ["repeats", "ms"]
    assert lines[4].split()[-2:] == ["9.562-10.432", "x3"]
    assert lines[3].split()[-2:] == ["1.200-1.200", "x1"]  # a row measured once shows its one value
    assert len(lines[3]) == len(lines[4]) == len(lines[2]) == len(lines[-1])
