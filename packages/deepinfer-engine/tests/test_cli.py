"""`deepinfer` entry point: every typed error of the project is one `error:` line on stderr with exit status 2
(checked before any model work where the input allows it); a real bug keeps its traceback."""

from __future__ import annotations

import pytest
from deepinfer_engine.cli import main
from deepseek_recipe import ConversionError


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize(("argv", "needles"), [
    (["generate", "Hi", "--temperature", "-1"], ["temperature"]),
    (["generate", "Hi", "--model", "/nonexistent/ckpt"], ["model: '/nonexistent/ckpt'", "config.json"]),
    (["generate", "Hi", "--max-num-seqs", "0"], ["max_num_seqs: found 0"]),
    (["generate", "--prompt-file", "/nonexistent/prompts.txt"], ["prompt_file: cannot read"]),
    (["chat", "--model", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    (["bench", "throughput", "--output-json", "/nonexistent/dir/b.json"], ["output_json", "does not exist"]),
    (["bench", "latency", "--model", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    (["make-checkpoint", "--preset", "huge", "--out", "/tmp/never-written"], ["--preset: found 'huge'"]),
    (["inspect", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
])
def test_typed_errors_are_one_line_with_exit_2(argv, needles, capsys, monkeypatch) -> None:
    def no_default_model(*a, **k):
        raise AssertionError("no command here may build the default checkpoint")

    monkeypatch.setattr("deepinfer_engine.default_model.default_model_dir", no_default_model)
    assert main(argv) == 2
    _one_error_line(capsys, *needles)


def test_recipe_errors_and_os_errors_are_typed_too(capsys, monkeypatch) -> None:
    from deepinfer_engine.commands import generate

    for exc in (ConversionError("messages: expected a list"), PermissionError(13, "Permission denied", "/x")):
        def fails(ns, exc=exc):
            raise exc

        monkeypatch.setattr(generate, "run", fails)
        assert main(["generate", "Hi"]) == 2
        _one_error_line(capsys)


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    from deepinfer_engine.commands import generate

    def bug(ns):
        raise KeyError("internal")

    monkeypatch.setattr(generate, "run", bug)
    with pytest.raises(KeyError):
        main(["generate", "Hi"])


def test_prompt_file_that_is_not_utf8(tmp_path, capsys) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xe9\n")
    assert main(["generate", "--prompt-file", str(f)]) == 2
    _one_error_line(capsys, "p.txt' is not UTF-8 text")
