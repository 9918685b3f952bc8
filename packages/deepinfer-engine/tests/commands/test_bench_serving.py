"""`deepinfer bench serving` against a server it starts itself on the tiny V4.1 checkpoint (CPU): every request
completes with exactly output_len tokens, and the timings are consistent (TTFT <= end-to-end, one inter-chunk gap
per further chunk)."""

from __future__ import annotations

import json

import pytest
from deepinfer_engine.bench_serving import format_serving, run_serving
from deepinfer_engine.cli import main
from deepinfer_engine.llm import LLM
from deepinfer_engine.server import serve_in_thread


def test_bench_serving_in_process(tiny_v41_dir, tmp_path, capsys) -> None:
    dst = tmp_path / "serving.json"
    rc = main(["bench", "serving", "--num-prompts", "6", "--concurrency", "3", "--input-len", "8",
               "--output-len", "5", "--output-json", str(dst), "--model", str(tiny_v41_dir), "--device", "cpu",
               "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Time to first token" in out
    r = json.loads(dst.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_tokens_per_s"] == pytest.approx(6 * 5 / r["duration_s"])
    assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
    assert r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["max"] > 0


def test_run_serving_counts_failed_requests(tiny_v41_dir) -> None:
    llm = LLM(str(tiny_v41_dir), device="cpu", dtype="float32", max_model_len=16)
    url, stop = serve_in_thread(llm)
    try:  # prompts of 20 tokens > max_model_len: every request is refused, and counted as failed
        r = run_serving(url, num_prompts=2, input_len=20, output_len=4, concurrency=2)
    finally:
        stop()
        llm.close()
    assert r["completed"] == 0 and r["failed"] == 2 and "max_model_len" in r["errors"][0]


def test_open_loop_arrivals_at_a_request_rate(tiny_v41_dir) -> None:
    llm = LLM(str(tiny_v41_dir), device="cpu", dtype="float32")
    url, stop = serve_in_thread(llm)
    try:  # 6 Poisson arrivals at 20 req/s, at most 2 in flight
        r = run_serving(url, num_prompts=6, input_len=8, output_len=3, concurrency=2, request_rate=20.0)
    finally:
        stop()
        llm.close()
    assert r["completed"] == 6 and r["failed"] == 0 and r["request_rate"] == 20.0
    assert "Request rate (req/s):" in format_serving(r)


@pytest.mark.parametrize(("args", "words"), [(["--concurrency", "0"], "concurrency"),
                                             (["--request-rate", "0"], "request_rate")])
def test_bad_counts_fail_before_the_model_loads(no_model, capsys, args, words) -> None:
    rc = main(["bench", "serving", *args, "--model", "/unused"])
    assert rc == 2 and words in capsys.readouterr().err
