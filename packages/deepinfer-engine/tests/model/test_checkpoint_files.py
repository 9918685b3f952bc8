"""Small checkpoint files (model/checkpoint_files.py): EOS ids from generation_config.json and the validated
tokenizer loader. Damage inside a checkpoint directory is covered by the corpus (test_damaged_checkpoints.py);
this module covers the valid shapes of the files and an explicitly given tokenizer path."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from deepinfer_engine.errors import CheckpointError, ConfigError
from deepinfer_engine.model.checkpoint_files import load_tokenizer, read_eos_ids

ARGS = SimpleNamespace(vocab_size=100, eos_token_id=1)


def _gen(tmp_path: Path, **fields) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_eos_ids_from_int_list_or_fallback(tmp_path: Path) -> None:
    assert read_eos_ids(tmp_path, ARGS) == [1]  # no file: config.json's eos_token_id
    assert read_eos_ids(_gen(tmp_path, eos_token_id=7), ARGS) == [7]
    assert read_eos_ids(_gen(tmp_path, eos_token_id=[3, 9], bos_token_id=0, pad_token_id=None,
                             temperature=0.6, top_p=0.95, do_sample=True, max_new_tokens=8), ARGS) == [3, 9]
    assert read_eos_ids(_gen(tmp_path, eos_token_id=[]), ARGS) == [1]  # empty: fall back
    assert read_eos_ids(_gen(tmp_path, transformers_version="4.46"), SimpleNamespace(vocab_size=100)) == [1]


@pytest.mark.parametrize(("fields", "message"), [
    ({"eos_token_id": True}, "'eos_token_id' is True; expected a token id"),
    ({"eos_token_id": 1.0}, "'eos_token_id' is 1.0; expected a token id"),
    ({"eos_token_id": [1, -1]}, r"'eos_token_id\[1\]' is -1"),
    ({"eos_token_id": {"id": 1}}, "'eos_token_id' is {'id': 1}"),
    ({"bos_token_id": 100}, r"'bos_token_id' is 100; expected a token id \(integer in \[0, 100\)\)"),
    ({"top_p": 1.5}, r"'top_p' is 1.5; expected a finite number \[0, 1\]"),
    ({"do_sample": "yes"}, "'do_sample' is 'yes'; expected true or false"),
    ({"max_new_tokens": -2}, "'max_new_tokens' is -2; expected a non-negative integer"),
])
def test_invalid_generation_config_names_the_field(tmp_path: Path, fields, message) -> None:
    with pytest.raises(CheckpointError, match=f"generation_config.json in .*{message}"):
        read_eos_ids(_gen(tmp_path, **fields), ARGS)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deepinfer_engine.model.tokenizer_files import write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, "v41")
    return d


def test_explicit_tokenizer_path(tokenizer_dir: Path, tmp_path: Path) -> None:
    assert load_tokenizer(tokenizer_dir).get_vocab_size(with_added_tokens=True) == 129280
    assert load_tokenizer(tokenizer_dir / "tokenizer.json").token_to_id("<｜System｜>") == 128799
    with pytest.raises(ConfigError, match=r"tokenizer: '/nope.json' is no such file; expected a tokenizer.json"):
        load_tokenizer("/nope.json")
    with pytest.raises(ConfigError, match="is a directory without tokenizer.json"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "tok.json"
    bad.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="tok.json: not a valid tokenizer.json"):
        load_tokenizer(bad)


def test_checkpoint_dir_without_tokenizer_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deepinfer_engine"):
        assert load_tokenizer(tmp_path, required=False) is None
    assert "no tokenizer at" in caplog.text


def test_tokenizer_config_special_token_as_object_or_string(tokenizer_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "t"
    shutil.copytree(tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<｜begin▁of▁sentence｜>"  # a plain string is as valid as the AddedToken object
    cfg["model_max_length"] = 1e30  # HF's "unknown" sentinel
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(d) is not None
    cfg["add_bos_token"] = "false"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'add_bos_token' is 'false'; expected true or false"):
        load_tokenizer(d)
