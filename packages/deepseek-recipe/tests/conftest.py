"""Shared fixtures for the deepseek-recipe suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def v4_tokenizer():
    from deepseek_recipe import Tokenizer

    return Tokenizer.deepseek_v4()
