from __future__ import annotations

import pytest
from deepinfer_engine.model.writer import make_checkpoint


@pytest.fixture(scope="package")
def tiny_v41_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cmd_v41") / "ckpt", "v41", "tiny", 0)
