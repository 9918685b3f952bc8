"""`deepinfer bench latency` with several batch sizes: latency blocks, the decode-step bytes-bound table, the plot."""

from __future__ import annotations

import json

import pytest
from deepinfer_engine.cli import main

pytest.importorskip("matplotlib")


def test_latency_sweep_writes_roofline_and_plot(tiny_v41_dir, tmp_path, capsys) -> None:
    dst, png = tmp_path / "lat.json", tmp_path / "roof.png"
    rc = main(["bench", "latency", "--batch-size", "1,2", "--input-len", "4", "--output-len", "2",
               "--num-iters", "1", "--num-iters-warmup", "0", "--decode-steps", "2", "--plot", str(png),
               "--output-json", str(dst), "--model", str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("Latency Benchmark Result") == 2 and "Decode step vs bytes bound" in out
    r = json.loads(dst.read_text())
    assert [b["batch_size"] for b in r["runs"]] == [1, 2]
    roof = r["decode_roofline"]
    assert roof["copy_bandwidth_Bps"] > 0 and [row["batch_size"] for row in roof["rows"]] == [1, 2]
    for row in roof["rows"]:
        assert len(row["step_s_all"]) == 2 and row["step_s"] > 0  # exactly the timed pure-decode steps
        assert row["bytes"]["total"] == row["bytes"]["weights"] + row["bytes"]["kv"] > 0
        assert row["fraction_of_bound"] == pytest.approx(row["bytes_bound_s"] / row["step_s"])
        assert "forward_s" not in row  # no CUDA graph on the CPU: no forward-only step to set the step against
        assert "device_state" not in row  # no SM clock to record off CUDA
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_repeats_measure_each_batch_size_several_times(tiny_v41_dir, tmp_path, capsys) -> None:
    dst = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--batch-size", "2", "--input-len", "4", "--output-len", "2", "--num-iters", "1",
               "--num-iters-warmup", "0", "--decode-steps", "2", "--decode-repeats", "3", "--output-json", str(dst),
               "--model", str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32"])
    assert rc == 0 and "repeats ms" in capsys.readouterr().out
    (row,) = json.loads(dst.read_text())["decode_roofline"]["rows"]
    assert len(row["step_s_repeats"]) == 3 and len(row["step_s_all"]) == 6
    assert row["step_s"] == sorted(row["step_s_repeats"])[1]  # the median of the repeats' medians


def test_decode_repeats_below_one_is_refused_before_loading(tmp_path, capsys) -> None:
    rc = main(["bench", "latency", "--decode-repeats", "0", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "decode_repeats" in err and "positive" in err and "Traceback" not in err


def test_plot_into_missing_directory_fails_before_any_work(tiny_v41_dir, tmp_path, capsys) -> None:
    # the model path does not exist either: the plot target must be refused first, before any loading
    rc = main(["bench", "latency", "--plot", str(tmp_path / "nope" / "x.png"), "--model", str(tiny_v41_dir / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot" in err and "Traceback" not in err
