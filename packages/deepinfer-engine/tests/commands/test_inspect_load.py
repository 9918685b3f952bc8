"""`deepinfer inspect DIR --load --json` (weights held in their checkpoint formats) and the resident-bytes
arithmetic of `deepinfer inspect --config`: with --dtype bfloat16 the loaded model holds at most 1.1 x the
checkpoint's bytes, for every preset quick to write on CPU and for the real configs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from deepinfer_engine.commands import inspect as inspect_cmd
from deepinfer_engine.model import presets

RATIO = 1.1


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    return inspect_cmd.run(p.parse_args(argv))


@pytest.mark.parametrize(("arch", "preset"), [("v41", "tiny"), ("v4", "tiny"), ("v4", "tiny-dspark")])
def test_load_json_resident_bytes_within_checkpoint_bytes(arch, preset, tiny_ckpt, capsys) -> None:
    d = tiny_ckpt(arch, preset)
    assert _run([str(d), "--load", "--json", "--dtype", "bfloat16"]) == 0
    rep = json.loads(capsys.readouterr().out)
    ck, res = rep["checkpoint_bytes"], rep["resident_weight_bytes"]
    index_total = json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert ck == index_total
    assert res == sum(rep["resident_bytes_by_dtype"].values())
    assert sum(rep["checkpoint_bytes_by_dtype"].values()) == ck
    # quantized tensors are held as stored: same FP8 / FP4 / scale bytes as in the checkpoint
    assert rep["resident_bytes_by_dtype"]["float8_e4m3fn"] == rep["checkpoint_bytes_by_dtype"]["f8_e4m3"]
    assert rep["resident_bytes_by_dtype"]["int8"] == rep["checkpoint_bytes_by_dtype"]["fp4_e2m1x2"]
    assert res <= RATIO * ck, (res, ck)


def test_load_text_report(tiny_v41_dir: Path, capsys) -> None:
    assert _run([str(tiny_v41_dir), "--load", "--no-plan"]) == 0
    out = capsys.readouterr().out
    assert "check: OK" in out and "resident_weight_bytes" in out and "x checkpoint_bytes" in out


@pytest.mark.parametrize("which", ["v4_flash_config", "v41_flash_config"])
def test_real_config_resident_bytes_arithmetic(which) -> None:
    """Real V4-Flash / V4.1-Flash: the model a load would build (on the meta device) vs the index total_size."""
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.inventory import summarize, tensor_inventory

    args = ModelArgs.from_config_dict(getattr(presets, which)())
    specs = tensor_inventory(args)
    total = summarize(specs).total_bytes
    est = inspect_cmd.resident_estimate(args, "bfloat16", specs)
    by = est["resident_bytes_by_dtype"]
    assert est["resident_weight_bytes"] <= RATIO * total, (est, total)
    fp8 = sum(s.nbytes for s in specs if s.dtype == "f8_e4m3")
    assert by["float8_e4m3fn"] == fp8  # every FP8 weight held as stored


def test_config_prints_resident_bytes(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(presets.tiny_v4_config()))
    assert _run(["--config", str(cfg), "--no-plan", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "resident bytes when loaded (bfloat16" in out and "x total_size)" in out
