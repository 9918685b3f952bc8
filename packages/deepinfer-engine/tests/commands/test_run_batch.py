"""`deepinfer run-batch` file handling: the output is checked and opened before any model work, results reach
the file as their wave completes (so they survive a later crash), and every bad line -- invalid UTF-8, a
duplicate custom_id, a method other than POST, a refused request -- is that line's error, never an abort."""

from __future__ import annotations

import json

import pytest
from deepinfer_engine.cli import main
from deepinfer_engine.llm import LLM

FAST = ["--device", "cpu", "--dtype", "float32", "--no-progress"]


def _line(cid: str, prompt: str = "Hello", **extra) -> bytes:
    body = {"model": "x", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}).encode()


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("where", ["missing_dir", "a_directory"])
def test_bad_output_path_fails_before_model_work(tmp_path, capsys, no_model, where) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(_line("a") + b"\n")
    dst = tmp_path / "nope" / "out.jsonl" if where == "missing_dir" else tmp_path
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), "--model", "/unused", *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: output_file: ")
    assert ("does not exist" in err) if where == "missing_dir" else ("is a directory" in err)


def test_missing_input_file_is_one_error_line(tmp_path, capsys, no_model) -> None:
    rc = main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl"), *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: input_file: cannot read") and err.count("\n") == 1


def test_bad_lines_are_reported_per_line(tiny_v41_dir, tmp_path, capsys) -> None:
    lines = [
        _line("ok1"),
        b'{"custom_id": "latin1", "prompt": "caf\xe9"}',  # not UTF-8
        _line("ok1"),  # duplicate custom_id
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}).encode(),
        json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {}}).encode(),
        json.dumps({"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}).encode(),
        _line("ok2", prompt="World"),
        # a lone surrogate (legal as a JSON escape) cannot be UTF-8 encoded: the line is written escaped
        b'{"custom_id": "x\\ud800", "method": "POST", "url": "/v1/embeddings", "body": {}}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    dst = tmp_path / "out.jsonl"
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tiny_v41_dir), *FAST])
    assert rc == 0
    rows = _rows(dst)
    assert [r["error"] and r["error"]["code"] for r in rows] == [
        None, "invalid_encoding", "duplicate_custom_id", "invalid_method", "invalid_url", "invalid_request", None,
        "invalid_url"]
    assert [r["error"]["line"] for r in rows if r["error"]] == [2, 3, 4, 5, 6, 8]
    assert rows[7]["custom_id"] == "x\ud800"
    assert "already used by line 1" in rows[2]["error"]["message"]
    assert "found 'GET', expected 'POST'" in rows[3]["error"]["message"]
    assert rows[6]["custom_id"] == "ok2" and rows[6]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert "8 lines, 2 ok, 6 failed" in capsys.readouterr().err


def test_completed_waves_are_on_disk_when_the_run_dies(tiny_v41_dir, tmp_path, monkeypatch) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([_line("a"), b"{broken", _line("b"), _line("c")]) + b"\n")
    dst = tmp_path / "out.jsonl"
    real = LLM.generate_chat
    calls = []

    def dies_on_second_wave(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash in the middle of the batch")
        return real(self, *a, **k)

    monkeypatch.setattr(LLM, "generate_chat", dies_on_second_wave)
    with pytest.raises(RuntimeError, match="simulated crash"):  # a bug keeps its traceback
        main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tiny_v41_dir), "--wave-size", "1", *FAST])
    rows = _rows(dst)
    # wave 1 ("a") and the failed line after it are on disk; "b" and "c" never finished
    assert [r["custom_id"] for r in rows] == ["a", None]
    assert rows[0]["error"] is None and rows[1]["error"]["code"] == "invalid_json"


def test_a_request_refused_at_admission_fails_only_its_line(tiny_v41_dir, tmp_path) -> None:
    # logprobs beyond the vocabulary is refused by the engine's admission check (it depends on the model)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([_line("a"), _line("bad", logprobs=1000000), _line("c"), _line("d")]) + b"\n")
    dst = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tiny_v41_dir), *FAST]) == 0
    rows = _rows(dst)
    assert [r["custom_id"] for r in rows] == ["a", "bad", "c", "d"]
    assert [r["error"] is None for r in rows] == [True, False, True, True]
    assert rows[1]["error"]["code"] == "request_failed" and "logprobs" in rows[1]["error"]["message"]
