"""Fixtures shared by the model tests.

`one_thread` is opt-in (`pytestmark = pytest.mark.usefixtures("one_thread")`) so that only the modules that asked
for single-threaded torch get it; `make_tiny_v41_model` builds the random tiny V4.1 model of the DSpark and V4.1
equality tests.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.engram_hash import synthetic_token_map
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v41_config
from equality import init_random_


@pytest.fixture
def one_thread():
    # tiny shapes: intra-op threads only add overhead (and contention) on the 2 shared cores
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def make_tiny_v41_model():
    """Factory `(seed) -> Transformer`: tiny V4.1 (presets.tiny_v41_config), fp32, random weights from `seed`,
    the synthetic Engram token map, eval mode."""

    def make(seed: int) -> Transformer:
        args = ModelArgs.from_config_dict(tiny_v41_config())
        m = Transformer(args, torch.float32)
        init_random_(m, seed=seed)
        m.set_engram_token_map(synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size))
        return m.eval()

    return make
