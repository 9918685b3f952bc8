"""`deepinfer inspect` and `deepinfer make-checkpoint` (called through their command modules)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepinfer_engine.cli import main
from deepinfer_engine.commands import inspect as inspect_cmd
from deepinfer_engine.commands import make_checkpoint as make_cmd
from deepinfer_engine.model import presets
from deepinfer_engine.model.checkpoint import INDEX_FILE


def _run(module, argv: list[str]) -> int:
    # through the CLI entry point: typed errors become one `error:` line with exit status 2 there
    name = {inspect_cmd: "inspect", make_cmd: "make-checkpoint"}[module]
    return main([name, *argv])


def _lines(out: str) -> dict[str, str]:
    """Map the first word(s) of each 'name   number' line to its number."""
    res: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.strip().rsplit(None, 1)
        if len(parts) == 2:
            res.setdefault(parts[0].strip(), parts[1])
    return res


def test_inspect_config_v4_flash_prints_published_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(presets.v4_flash_config()))
    assert _run(inspect_cmd, ["--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    vals = _lines(out)
    assert vals["backbone"] == "284,334,567,511"
    assert vals["total"] == "290,944,616,402"
    assert vals["total_size"] == "159,609,485,896"
    assert "tensors (weights + scales): 69,187" in out
    assert "     43  mtp.0.         0 swa  swa" in out  # the plan lists the MTP layer


def test_inspect_config_v41_flash_prints_design_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(presets.v41_flash_config()))
    assert _run(inspect_cmd, ["--config", str(cfg), "--no-plan"]) == 0
    vals = _lines(capsys.readouterr().out)
    assert vals["backbone"] == "551,566,180,464"
    assert vals["Engram"] == "196,928,504,320"
    draft = 14_225_362_146 + 3 * 128  # + the DSpark stages' optional gate.bias_vl (docs/fidelity.md §1)
    assert vals["draft (MTP/DSpark)"] == f"{draft:,}"
    assert vals["total"] == f"{551_566_180_464 + 196_928_504_320 + draft:,}"


def test_inspect_bad_config_reports_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = presets.v4_flash_config()
    d["o_groups"] = 5
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(d))
    assert _run(inspect_cmd, ["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "o_groups" in err and err.startswith("error: ") and err.count("\n") == 1


def test_make_checkpoint_then_inspect_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ck"
    assert _run(make_cmd, ["--arch", "v4", "--preset", "tiny", "--seed", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "596 tensors in 4 shards" in text
    assert _run(make_cmd, ["--arch", "v4", "--out", str(out)]) == 2  # refuses to overwrite
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert _run(inspect_cmd, [str(out)]) == 0
    text = capsys.readouterr().out
    assert "check: OK (596 tensors in 4 shards" in text and "hash layers 2" in text
    # break it: drop a tensor from the index -> inspect reports the problem and fails
    index = json.loads((out / INDEX_FILE).read_text())
    del index["weight_map"]["layers.2.attn.compressor.ape"]
    (out / INDEX_FILE).write_text(json.dumps(index))
    # the shard still holds it: the reader refuses the inconsistent index, naming tensor and shard
    assert _run(inspect_cmd, [str(out), "--no-plan"]) == 2
    err = capsys.readouterr().err
    assert "layers.2.attn.compressor.ape" in err and "is stored in shard model-0000" in err


def test_make_checkpoint_bad_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(make_cmd, ["--arch", "v41", "--preset", "huge", "--out", str(tmp_path / "x")]) == 2
    assert "--preset: found 'huge'" in capsys.readouterr().err


def test_inspect_default_checkpoint_is_created_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert _run(inspect_cmd, ["--no-plan", "--forward"]) == 0
    out = capsys.readouterr().out
    final = tmp_path / "cache" / "default-v41-tiny-seed0"
    assert f"checkpoint: {final}" in out and "check: OK" in out
    assert "finite True" in out and "logits [" in out
    # no temp left; the forward's model load also memoised the Engram token map of the checkpoint's tokenizer
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["default-v41-tiny-seed0", "engram-token-maps"]
    assert len(list((tmp_path / "cache" / "engram-token-maps").glob("*.npy"))) == 1
