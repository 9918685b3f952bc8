"""`deepinfer generate | run-batch | bench | chat` in-process on a tiny V4.1 checkpoint."""

from __future__ import annotations

import io
import json

import pytest
from deepinfer_engine.cli import main

FAST = ["--device", "cpu", "--dtype", "float32", "--no-progress"]


def test_generate_prompts_from_args_stdin_and_file(tiny_v41_dir, tmp_path, monkeypatch, capsys) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("Third prompt\n\nFourth\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("World\n"))
    rc = main(["generate", "Hello", "-", "--prompt-file", str(f), "--model", str(tiny_v41_dir),
               "--max-tokens", "3", "--json", *FAST])
    cap = capsys.readouterr()
    assert rc == 0
    rows = [json.loads(line) for line in cap.out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "World", "Third prompt", "Fourth"]
    assert all(len(r["outputs"][0]["token_ids"]) == 3 for r in rows)
    assert "decode" in cap.err and "tok/s" in cap.err


def test_generate_without_prompts_runs_chat_examples(tiny_v41_dir, capsys) -> None:
    rc = main(["generate", "--model", str(tiny_v41_dir), "--max-tokens", "2", *FAST])
    cap = capsys.readouterr()
    assert rc == 0
    assert "Introduce yourself" in cap.out and cap.out.count("finish_reason=") == 3


def test_run_batch_reports_failed_lines_in_order(tiny_v41_dir, tmp_path, capsys) -> None:
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                  "thinking": {"type": "disabled"}}},
        "{broken",
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Hello", "max_tokens": 3, "temperature": 0}},
        {"custom_id": "bad_param", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Hello", "temperature": -3}},
        {"custom_id": "too_long", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": [0] * 40, "max_tokens": 2}},
        {"custom_id": "bad_url", "method": "POST", "url": "/v1/embeddings", "body": {}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tiny_v41_dir), "--max-model-len", "32",
               *FAST])
    assert rc == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", None, "cmpl", "bad_param", "too_long", "bad_url"]
    ok = {o["custom_id"]: o for o in out if o["error"] is None}
    assert set(ok) == {"chat", "cmpl"}
    assert ok["chat"]["response"]["body"]["object"] == "chat.completion"
    assert ok["cmpl"]["response"]["body"]["usage"]["completion_tokens"] == 3
    errors = {o["custom_id"]: o["error"] for o in out if o["error"] is not None}
    assert errors[None]["code"] == "invalid_json" and errors[None]["line"] == 2
    assert "SamplingParams.temperature" in errors["bad_param"]["message"]
    assert errors["too_long"]["code"] == "request_failed" and "max_model_len" in errors["too_long"]["message"]
    assert errors["bad_url"]["code"] == "invalid_url"
    assert "2 ok, 4 failed" in capsys.readouterr().err


def test_bench_throughput_writes_json(tiny_v41_dir, tmp_path, capsys) -> None:
    dst = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--num-prompts", "3", "--input-len", "5", "--output-len", "2",
               "--output-json", str(dst), "--model", str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Throughput Benchmark Result" in text and "output tokens/s" in text
    r = json.loads(dst.read_text())
    assert r["num_prompts"] == 3 and r["output_tokens"] == 6 and r["input_tokens"] == 15
    assert r["output_tokens_per_s"] > 0 and r["device"] == "cpu"


def test_chat_streams_replies(tiny_v41_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n/reset\nAgain\n/exit\n"))
    rc = main(["chat", "--model", str(tiny_v41_dir), "--max-tokens", "3", "--temperature", "0",
               "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    assert capsys.readouterr().out.count("assistant> ") == 2


def test_unknown_engine_flag_is_rejected(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--max-num-seq", "3"])
    assert "max-num-seqs" in capsys.readouterr().err


def test_explicit_missing_tokenizer_is_an_error(tiny_v41_dir, capsys) -> None:
    rc = main(["generate", "Hi", "--model", str(tiny_v41_dir), "--tokenizer", "/nope.json", *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and "error: tokenizer: '/nope.json' is no such file" in err
