"""`deepinfer plan`: the EP sizing figures of the real V4.1-Flash config (docs/parallel.md, "Sizing")."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from deepinfer_engine.cli import build_parser
from deepinfer_engine.commands import plan as plan_cmd
from deepinfer_engine.model import presets


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    return plan_cmd.run(p.parse_args(argv))


@pytest.fixture(scope="module")
def real_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(presets.v41_flash_config()))
    return path


def _report(capsys, argv) -> dict:
    assert _run([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_v41_flash_weights_per_gpu_match_the_design_table(real_config, capsys):
    r = _report(capsys, ["--gpus", "64", "--gpu-memory-gb", "141", "--config", str(real_config)])
    m = r["model"]
    assert round(m["routed_main"] / 1e9, 1) == 288.8 and round(m["routed_draft"] / 1e9, 1) == 7.2
    assert round(m["replicated"] / 1e9, 1) == 10.6
    assert round(m["engram_tables"] / 1e9) == 203
    assert m["kv_bytes_per_token"] == 890.0  # 3 x 144 + 288 main + 3 x 34 + 68 index keys
    # EP -> (routed experts per GPU, + replicated), GB: the published sizing table
    want = {1: (296.0, 306.6), 2: (148.0, 158.6), 4: (74.0, 84.6), 8: (37.0, 47.6), 64: (4.6, 15.2)}
    got = {t["ep_size"]: (round(t["routed_bytes"] / 1e9, 1), round(t["weight_bytes"] / 1e9, 1)) for t in r["table"]}
    assert {ep: got[ep] for ep in want} == want
    assert r["prefill"]["ep_size"] == 4 and r["prefill_replicas"] == 16  # H200: EP4
    dec = {d["ep_size"]: d for d in r["decode"]}
    assert (dec[64]["experts_per_rank"], dec[64]["redundant_experts"]) == (7, 64)
    assert (dec[128]["experts_per_rank"], dec[128]["redundant_experts"]) == (4, 128)
    assert all(d["fits"] and d["kv_tokens"] > 100_000_000 for d in r["decode"])


def test_smallest_prefill_ep_by_gpu_memory():
    from deepinfer_engine.model.args import ModelArgs

    args = ModelArgs.from_config_dict(presets.v41_flash_config())
    counted = plan_cmd.model_bytes(args)
    # H100 80 GB -> EP8, H200 -> EP4, B200 180 GB -> EP4 (EP2 leaves too little), B300 288 GB -> EP2
    for gb, ep in [(80, 8), (141, 4), (180, 4), (288, 2)]:
        assert plan_cmd.plan(args, gpus=8, gpu_memory_gb=gb, counted=counted).prefill.ep_size == ep, gb


def test_text_report(real_config, capsys):
    assert _run(["--gpus", "64", "--gpu-memory-gb", "141", "--config", str(real_config)]) == 0
    out = capsys.readouterr().out
    assert "prefill: EP4 (smallest EP that fits" in out
    assert "Engram tables: 202.8 GB in host memory" in out
    assert "KV: 890 B per token" in out
    assert any(line.split()[:3] == ["64", "7", "64"] for line in out.splitlines())


def test_too_few_gpus_and_bad_input(real_config, tmp_path, capsys):
    assert _run(["--gpus", "2", "--gpu-memory-gb", "141", "--config", str(real_config)]) == 0
    assert "prefill: no EP size <= 2 fits" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    assert _run(["--gpus", "8", "--gpu-memory-gb", "80", "--config", str(bad)]) == 1
    assert "deepinfer plan: error:" in capsys.readouterr().err
    assert _run(["--gpus", "0", "--gpu-memory-gb", "80", "--config", str(real_config)]) == 1
    with pytest.raises(SystemExit):
        _run(["--gpus", "8", "--gpu-memory-gb", "80", "--config", str(bad), "--model", str(tmp_path)])


def test_model_dir_and_cli_registration(tiny_v41_dir, capsys):
    from deepinfer_engine.model.args import ModelArgs

    args = ModelArgs.from_checkpoint_dir(tiny_v41_dir)
    r = _report(capsys, ["--gpus", "4", "--gpu-memory-gb", "1", "--prefill-free-gb", "0.5", "--model",
                         str(tiny_v41_dir)])
    assert r["model"]["num_experts"] == args.n_routed_experts
    assert r["prefill"]["ep_size"] == 1  # a tiny model fits one GPU
    ns = build_parser().parse_args(["plan", "--gpus", "8", "--gpu-memory-gb", "80"])
    assert ns._run is plan_cmd.run
