"""The speculative decoder's start-up files: the Confidence Head calibration shipped beside the weights (the
engine-level use of them is in test_spec_decode.py)."""

from __future__ import annotations

import json

import pytest
import torch
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.worker.spec_build import CONFIDENCE_FILE, STS_FILE, confidence_files
from safetensors.torch import save_file

CPU = torch.device("cpu")


def test_confidence_files_read_both_files_and_name_a_malformed_one(tmp_path) -> None:
    assert confidence_files(None, CPU) == ({}, None)
    assert confidence_files(tmp_path / "missing", CPU) == ({}, None)  # no files: no calibration
    (tmp_path / STS_FILE).write_text(json.dumps({"sampling": [0.5, 0.75], "greedy": 3, "other": "ignored"}))
    assert confidence_files(tmp_path, CPU) == ({"sampling": (0.5, 0.75), "greedy": 3.0}, None)
    head = torch.linspace(-1, 1, 6)
    save_file({"greedy": head, "greedy_sts": torch.tensor([1.0, 2.0])}, str(tmp_path / CONFIDENCE_FILE))
    sts, got = confidence_files(tmp_path, CPU)
    assert sts == {"sampling": (0.5, 0.75), "greedy": (1.0, 2.0)}  # the separate head's set replaces the json's
    assert got.dtype == torch.float32 and torch.equal(got, head.reshape(1, 6))
    save_file({"greedy": torch.zeros(1, 6, dtype=torch.int32)}, str(tmp_path / CONFIDENCE_FILE))
    with pytest.raises(ConfigError, match="expected a \\[1, d \\+ r\\] float head"):
        confidence_files(tmp_path, CPU)


@pytest.mark.parametrize(("text", "match"), [("{not json", "invalid JSON"), ('["greedy"]', "expected an object"),
                                             ('{"greedy": "hot"}', "expected a temperature"),
                                             ('{"sampling": []}', "expected a temperature")])
def test_a_malformed_sts_file_is_a_config_error_with_its_fix(tmp_path, text, match) -> None:
    (tmp_path / STS_FILE).write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        confidence_files(tmp_path, CPU)
    assert "fix:" in str(err.value)
