"""decode_step_bytes against hand arithmetic on the tiny configs, and the expert-count override of presets."""

from __future__ import annotations

import math

import pytest
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.inventory import tensor_inventory
from deepinfer_engine.model.presets import preset_config
from deepinfer_engine.roofline import decode_step_bytes


def _args(arch: str, preset: str = "tiny", **kw) -> ModelArgs:
    return ModelArgs.from_config_dict(preset_config(arch, preset, **kw))


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_weights_count_every_backbone_tensor_once_and_experts_by_touch(arch: str) -> None:
    a = _args(arch)
    specs = [s for s in tensor_inventory(a) if s.section != "draft"]
    expert = {}
    for s in specs:
        if s.component == "routed_experts":
            expert[s.layer_id] = expert.get(s.layer_id, 0) + s.total_bytes
    embed = next(s for s in specs if s.name == "embed.weight")
    engram_tables = [s for s in specs if s.name.endswith("engram.embed.weight")]
    dense = sum(s.total_bytes for s in specs) - sum(expert.values()) - embed.total_bytes \
        - sum(s.total_bytes for s in engram_tables)
    one = decode_step_bytes(a, 1, 0)
    assert one.dense_weights == dense
    assert one.embed_rows == a.hidden_size * 2  # one bf16 row
    # one token touches exactly top-k experts of every MoE layer
    k_share = sum(v / p.n_routed_experts * p.num_experts_per_tok
                  for p in a.layer_plans if not p.is_draft for lid, v in expert.items() if lid == p.layer_id)
    assert one.routed_experts == pytest.approx(k_share, rel=1e-9, abs=len(expert))
    # many tokens touch (almost) every expert, never more
    many = decode_step_bytes(a, 10_000, 0)
    assert many.routed_experts == pytest.approx(sum(expert.values()), rel=1e-6)
    assert many.routed_experts <= sum(expert.values())


def test_kv_bytes_follow_window_topk_and_formats() -> None:
    a = _args("v41")
    ctx = 100  # 101 visible positions with the new token
    b = decode_step_bytes(a, 3, ctx, "bfloat16")
    backbone = [p for p in a.layer_plans if not p.is_draft]
    window = 3 * len(backbone) * min(ctx + 1, a.sliding_window) * a.head_dim * 2
    assert b.kv_window == window
    comp = 3 * sum(min(a.index_topk, (ctx + 1) // p.ratio) * a.head_dim * 2 for p in backbone if p.ratio > 0)
    assert b.kv_compressed == comp
    idx = 3 * sum((ctx + 1) // p.ratio * a.index_head_dim * 2 for p in backbone if p.ratio > 0 and p.has_indexer_q)
    assert b.index_keys == idx
    d = decode_step_bytes(a, 3, ctx, "auto")
    assert d.kv_window == window // (a.head_dim * 2) * (a.head_dim + math.ceil(a.head_dim / 32))
    assert d.kv_compressed < b.kv_compressed and d.index_keys < b.index_keys
    assert d.weights == b.weights


def test_bad_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        decode_step_bytes(_args("v4"), 0, 10)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_expert_override_shrinks_every_moe(arch: str) -> None:
    a = _args(arch, "layers-2", n_routed_experts=16)
    assert a.n_routed_experts == 16
    for p in a.layer_plans:
        assert p.n_routed_experts <= 16 and p.num_experts_per_tok <= p.n_routed_experts
    full = _args(arch, "layers-2")
    assert full.hidden_size == a.hidden_size and full.n_routed_experts > 16
    assert sum(s.total_bytes for s in tensor_inventory(a)) < sum(s.total_bytes for s in tensor_inventory(full)) / 3
