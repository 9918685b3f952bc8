"""A rank loads only the checkpoint experts of its slots (in their stored formats, an expert may fill several
slots), and the FP8 dispatch payload is used only with deployed numerics."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.dp.rank_experts import fp8_dispatch_block
from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.loader import load_model


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("v4")


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


def test_installed_dispatch_with_fp8_payload_feeds_the_experts_fp8_rounded_rows(ckpt) -> None:
    """RankExperts on a one-rank EP group, deployed numerics: every backbone MoE layer runs through the shared
    EPDispatch, whose experts see each row decoded from its FP8 payload (e4m3 + UE8M0 per 32 values) - the same
    as the local experts on FP8-rounded activations (fp32, 1e-5); an empty MoE step runs every layer with T = 0."""
    from deepinfer_engine.dp.rank_experts import RankExperts
    from deepinfer_parallel import ParallelConfig, ParallelState
    from deepinfer_parallel.ep.fp8_payload import decode_fp8_rows, encode_fp8_rows

    model = load_model(ckpt, torch.float32)
    a = model.args
    rx = RankExperts(ParallelState.single(), ParallelConfig(), expert_parallel=True, num_layers=a.num_hidden_layers,
                     num_experts=a.n_routed_experts, hidden_size=a.hidden_size, top_k=a.num_experts_per_tok)
    block = fp8_dispatch_block(a.hidden_size, deployed=True)
    rx.install(model, max_tokens_per_rank=8, dtype=torch.float32, fp8_block=block)
    assert all(layer.ffn.dispatch is rx.dispatch for layer in model.layers)
    moe = model.layers[-1].ffn
    x = torch.randn(5, a.hidden_size, generator=torch.Generator().manual_seed(0))
    w, ids = moe.gate(x, torch.arange(5))
    rounded = decode_fp8_rows(encode_fp8_rows(x, block), a.hidden_size, block, torch.float32)
    want = moe.experts(rounded, w, ids)
    for kind in ("prefill", "decode"):  # throughput and low-latency modes
        rx.set_mode(kind)
        got = rx.dispatch.run(x, w, ids, moe.experts, layer=moe.layer_id)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(rounded, x)  # the payload really is FP8
    rx.empty_step(torch.device("cpu"), torch.float32)
