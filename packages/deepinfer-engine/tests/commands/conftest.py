from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def tiny_v41_dir(tiny_ckpt):
    return tiny_ckpt("v41")


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the command must stop before it (options, paths checked first)."""

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("deepinfer_engine.llm.llm_from_cli", boom)
