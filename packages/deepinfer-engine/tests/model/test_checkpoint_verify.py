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
