"""Engine option kv_cache_dtype (docs/fidelity.md §5): values, default, CLI flag."""

from __future__ import annotations

import argparse

import pytest
from deepinfer_engine import EngineConfig
from deepinfer_engine.config import add_engine_args
from deepinfer_engine.errors import ConfigError


def test_kv_cache_dtype_option() -> None:
    assert EngineConfig.from_options().cache.kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_options(kv_cache_dtype="auto").cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype: found 'fp8'"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = EngineConfig.from_cli(parser.parse_args(["--kv-cache-dtype", "auto"]))
    assert cfg.cache.kv_cache_dtype == "auto"
