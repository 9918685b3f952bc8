"""`verify_checkpoint` (model/checkpoint_verify.py) beyond the per-case corpus test (tests/commands/
test_inspect_verify.py): chunked streaming finds the same values as one pass, and one damage does not hide
another."""

from __future__ import annotations

import re

from deepinfer_engine.model.checkpoint_verify import verify_checkpoint


def test_chunk_size_does_not_change_the_findings(damaged_checkpoint) -> None:
    d = damaged_checkpoint("inf_head_row", "nan_norm_weight")
    whole = verify_checkpoint(d)
    # 1000 values per chunk: the Inf row (values 448..511) and the tensors themselves straddle chunk borders
    chunked = verify_checkpoint(d, chunk_elems=1000)
    assert whole.findings == chunked.findings and len(whole.findings) == 2
    assert whole.bytes_checked == chunked.bytes_checked and whole.tensors_checked == chunked.tensors_checked


def test_every_problem_is_listed_not_just_the_first(damaged_checkpoint, damage_corpus) -> None:
    cases = ["overlapping_offsets", "inf_head_row", "generation_config_eos_string",
             "tokenizer_config_unknown_token"]
    report = verify_checkpoint(damaged_checkpoint(*cases))
    assert not report.ok
    for case in cases:
        want = damage_corpus[case]
        assert any(f.kind == want.kind and re.search(want.finding, f.message) for f in report.findings), case
    # the shard with the broken header is skipped (its offsets cannot be trusted), the others are read in full
    assert report.tensors_checked < 831


def test_bit_tests_of_every_float_format(tmp_path) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    inf, nan = float("inf"), float("nan")
    tensors = {
        # extremes of each format are finite: no false positive
        "f16.ok": torch.tensor([65504.0, -65504.0, 0.0, -0.0], dtype=torch.float16),
        "f64.ok": torch.tensor([1.7e308, -1.7e308, 5e-324], dtype=torch.float64),
        "e4m3.ok": torch.tensor([0x7E, 0xFE, 0x78, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn),
        "e8m0.ok.scale": torch.tensor([0xFE, 0x00, 0x7F], dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "e5m2.ok": torch.tensor([57344.0, -57344.0], dtype=torch.float8_e5m2),
        "f16.bad": torch.tensor([1.0, inf, nan, -inf], dtype=torch.float16),
        "f64.bad": torch.tensor([[0.0, 1.0], [nan, 2.0]], dtype=torch.float64),
        "e5m2.bad": torch.tensor([1.0, -inf], dtype=torch.float8_e5m2),
    }
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}))
    report = verify_checkpoint(tmp_path)
    values = {f.tensor: f.message for f in report.findings if f.tensor is not None}
    assert sorted(values) == ["e5m2.bad", "f16.bad", "f64.bad"]
    assert "1 NaN and 2 Inf among 4 F16 values (first at [1])" in values["f16.bad"]
    assert "1 NaN and 0 Inf among 4 F64 values (first at [1, 0])" in values["f64.bad"]
    assert "1 Inf/NaN code of FP8 e5m2 among 2 values (first at [1])" in values["e5m2.bad"]
    assert [f.kind for f in report.findings if f.tensor is None] == ["config"]  # this directory has no config.json
