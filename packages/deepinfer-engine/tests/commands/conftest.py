from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def tiny_v41_dir(tiny_ckpt):
    return tiny_ckpt("v41")
