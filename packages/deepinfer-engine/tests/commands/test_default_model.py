"""The embedded default checkpoint is written once (atomically) into $DEEPINFER_CACHE_DIR and reused."""

from __future__ import annotations

import json

from deepinfer_engine.default_model import DEFAULT_NAME, default_model_dir


def test_default_model_created_once_and_reused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    assert not default_model_dir(create=False).exists()
    d = default_model_dir()
    assert d == tmp_path / DEFAULT_NAME
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41"
    assert (d / "tokenizer.json").is_file()
    stamp = (d / "config.json").stat().st_mtime_ns
    assert default_model_dir() == d and (d / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_NAME]  # no temp directory left behind
