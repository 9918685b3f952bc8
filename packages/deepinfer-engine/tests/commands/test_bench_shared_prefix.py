"""`deepinfer bench throughput --workload shared-prefix`: cache on vs off in one run, hit rate and TTFT in the
table and the JSON, identical greedy outputs."""

from __future__ import annotations

import json

import pytest
from deepinfer_engine.cli import main


def test_shared_prefix_workload_reports_both_runs(tiny_v41_dir, tmp_path, capsys) -> None:
    dst = tmp_path / "sp.json"
    rc = main(["bench", "throughput", "--workload", "shared-prefix", "--shared-fraction", "0.75", "--num-prompts",
               "4", "--input-len", "40", "--output-len", "2", "--output-json", str(dst), "--model",
               str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Shared-prefix Benchmark Result" in text and "Prefix hit rate" in text and "TTFT mean/p50, cache off" in text
    r = json.loads(dst.read_text())
    assert r["shared_tokens"] == 30 and r["outputs_equal"] is True
    on, off = r["cache_on"], r["cache_off"]
    # 30 shared tokens = one 16-token page; 3 of the 4 prompts hit it
    assert on["prefix_hits"] == 3 and on["prefix_cached_tokens"] == 48 and on["prefix_hit_rate"] == pytest.approx(0.3)
    assert "prefix_hits" not in off and off["output_tokens"] == on["output_tokens"] == 8
    assert on["ttft_mean_s"] > 0 and off["total_tokens_per_s"] > 0


def test_shared_fraction_out_of_range_is_one_error_line(tiny_v41_dir, capsys) -> None:
    rc = main(["bench", "throughput", "--workload", "shared-prefix", "--shared-fraction", "1.5", "--model",
               str(tiny_v41_dir)])
    assert rc == 2 and "shared_fraction" in capsys.readouterr().err
