"""`deepinfer inspect DIR --verify`: every case of the damaged-checkpoint corpus (tests/conftest.py) is a finding
of its kind, with exit status 1; a clean checkpoint verifies OK with exit status 0."""

from __future__ import annotations

import json
import re

from deepinfer_engine.cli import main


def _verify(d, capsys, *extra: str) -> tuple[int, str, str]:
    rc = main(["inspect", str(d), "--verify", "--no-progress", *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_clean_checkpoint_verifies(damage_base, capsys) -> None:
    n = len(json.loads((damage_base / "model.safetensors.index.json").read_text())["weight_map"])  # every tensor
    rc, out, _ = _verify(damage_base, capsys)
    assert rc == 0
    assert re.search(rf"verify: OK \({n} tensors, [\d,]+ bytes read\)", out)
    rc, out, _ = _verify(damage_base, capsys, "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["findings"] == [] and report["tensors_checked"] == n


def test_every_damage_is_a_finding(damaged_checkpoint, damage_case, damage, capsys) -> None:
    d = damaged_checkpoint(damage_case)
    rc, out, err = _verify(d, capsys, "--json")
    assert rc == 1, err
    report = json.loads(out)
    assert not report["ok"]
    hits = [f for f in report["findings"] if re.search(damage.finding, f["message"])]
    assert hits, report["findings"]
    assert hits[0]["kind"] == damage.kind
    if damage.kind in ("non_finite", "invalid_scale"):
        # value damage is the only finding, and it names the tensor
        assert len(report["findings"]) == 1 and hits[0]["tensor"] in damage.finding


def test_text_report_lists_findings(damaged_checkpoint, capsys) -> None:
    d = damaged_checkpoint("inf_head_row")
    rc, out, _ = _verify(d, capsys)
    assert rc == 1
    lines = out.splitlines()
    assert lines[1].startswith("verify: FAILED, 1 findings")
    assert lines[2].startswith("  [non_finite] tensor 'head.weight' in model-") and "64 Inf" in lines[2]


def test_plain_inspect_of_a_broken_header_is_one_error_line(damaged_checkpoint, capsys) -> None:
    d = damaged_checkpoint("overlapping_offsets")
    assert main(["inspect", str(d), "--no-plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: shard model-") and "overlap" in err and err.count("\n") == 1


def test_verify_flag_misuse(damage_base, tmp_path, capsys) -> None:
    assert main(["inspect", str(damage_base), "--json"]) == 2
    assert "--json goes with --verify" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nope"), "--verify"]) == 2
    assert "does not exist" in capsys.readouterr().err
