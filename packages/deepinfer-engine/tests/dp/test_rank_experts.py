"""A rank loads only the checkpoint experts of its slots (in their stored formats, an expert may fill several
slots), and the FP8 dispatch payload is used only with deployed numerics."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.dp.rank_experts import fp8_dispatch_block
from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.writer import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_v4") / "ckpt", "v4", "tiny", 0)


def test_a_rank_loads_only_its_experts_bit_for_bit(ckpt) -> None:
    full = load_model(ckpt, torch.float32)
    held = {0: [5, 1, 5], 1: [7, 0, 2]}
    part = load_model(ckpt, torch.float32, expert_slots=lambda layer: held[layer % 2])
    for layer_full, layer_part in zip(full.layers, part.layers):
        want = held[layer_full.layer_id % 2]
        experts = layer_part.ffn.experts
        assert experts.held_experts == tuple(want) and len(experts) == 3
        for a, b in zip(layer_full.ffn.experts.tensors(), experts.tensors()):
            assert b.shape == (3, *a.shape[1:]) and b.dtype == a.dtype  # stored formats kept (FP4 + scales)
            assert torch.equal(b.view(torch.uint8), a[want].view(torch.uint8))
    # every non-expert tensor is loaded in full
    assert torch.equal(full.embed.weight, part.embed.weight)


def test_hold_experts_refuses_ids_outside_the_layer(ckpt) -> None:
    with pytest.raises(ModelConfigError, match="expert ids in \\[0, 8\\)"):
        load_model(ckpt, torch.float32, expert_slots=lambda layer: [0, 8])


def test_fp8_payload_only_with_deployed_numerics() -> None:
    assert fp8_dispatch_block(4096, deployed=False) is None
    assert fp8_dispatch_block(4096, deployed=True) == 128
    assert fp8_dispatch_block(96, deployed=True) == 32
    assert fp8_dispatch_block(100, deployed=True) is None
