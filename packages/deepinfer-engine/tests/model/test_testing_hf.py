"""HF oracle harness (hf_oracle) on the tiny V4 config (docs/testing.md §9.1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")  # 5.17 ships deepseek_v4 but its incremental decode differs from its prefill (seen: rel err 1.1); the oracle needs >= 5.23
pytest.importorskip("transformers.models.deepseek_v4")

from deepinfer_engine.errors import CheckpointError  # noqa: E402
from deepinfer_engine.model.args import ModelArgs  # noqa: E402
from deepinfer_engine.model.presets import tiny_v4_config  # noqa: E402
from hf_oracle import (  # noqa: E402
    build_hf_model,
    canonical_tie_break,
    hf_config_from_args,
    hf_incremental_logits,
    hf_indexer_boundary_ties,
    hf_logits,
    hf_reference_logits,
    official_to_hf_name,
    official_to_hf_state_dict,
    random_official_v4_state,
    v4_official_shapes_from_spec,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tiny_args():
    return ModelArgs.from_config_dict(tiny_v4_config())


@pytest.fixture(scope="module")
def tiny_state(tiny_args):
    return random_official_v4_state(tiny_args, seed=0)


@pytest.fixture(scope="module")
def tiny_hf(tiny_state, tiny_args):
    return build_hf_model(tiny_state, tiny_args)


def test_name_mapping_spot_checks():
    # docs/checkpoint.md §6.6, verified against transformers 5.24 conversion_mapping.py / modeling_deepseek_v4.py
    assert official_to_hf_name("embed.weight") == "model.embed_tokens.weight"
    assert official_to_hf_name("head.weight") == "lm_head.weight"
    assert official_to_hf_name("hc_head_scale") == "model.hc_head.hc_scale"
    assert official_to_hf_name("layers.3.attn.wq_a.weight") == "model.layers.3.self_attn.q_a_proj.weight"
    assert official_to_hf_name("layers.1.attn.indexer.compressor.norm.weight") == (
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight"
    )
    assert official_to_hf_name("layers.1.attn.indexer.weights_proj.weight") == (
        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
    )
    assert official_to_hf_name("layers.4.ffn.gate.bias") == "model.layers.4.mlp.gate.e_score_correction_bias"
    assert official_to_hf_name("layers.0.hc_ffn_fn") == "model.layers.0.ffn_hc.fn"
    assert official_to_hf_name("mtp.0.e_proj.weight") is None
    with pytest.raises(CheckpointError, match="wq_a.scale"):
        official_to_hf_name("layers.0.attn.wq_a.scale")
    with pytest.raises(CheckpointError, match="no HF DeepseekV4 equivalent"):
        official_to_hf_name("layers.0.attn.wq_c.weight")


def test_experts_are_stacked_gate_rows_first(tiny_state, tiny_args):
    hf = official_to_hf_state_dict(tiny_state, tiny_args)
    gu = hf["model.layers.2.mlp.experts.gate_up_proj"]
    down = hf["model.layers.2.mlp.experts.down_proj"]
    E, I, d = tiny_args.n_routed_experts, tiny_args.moe_intermediate_size, tiny_args.hidden_size
    assert gu.shape == (E, 2 * I, d) and down.shape == (E, d, I)
    assert torch.equal(gu[5, :I], tiny_state["layers.2.ffn.experts.5.w1.weight"])
    assert torch.equal(gu[5, I:], tiny_state["layers.2.ffn.experts.5.w3.weight"])
    assert torch.equal(down[7], tiny_state["layers.2.ffn.experts.7.w2.weight"])
    broken = dict(tiny_state)
    del broken["layers.2.ffn.experts.3.w2.weight"]
    with pytest.raises(CheckpointError, match="missing \\[3\\]"):
        official_to_hf_state_dict(broken, tiny_args)


def test_hf_config_layout(tiny_args):
    cfg = hf_config_from_args(tiny_args)
    assert cfg.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]
    assert cfg.qk_rope_head_dim == 8
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
    assert cfg.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert cfg.rope_parameters["main"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    }


def test_strict_load_covers_every_backbone_tensor(tiny_hf, tiny_state, tiny_args):
    hf_state = official_to_hf_state_dict(tiny_state, tiny_args)
    model_keys = set(tiny_hf.state_dict())
    assert model_keys == set(hf_state)
    # every official tensor except the documented mtp.* ones found a home
    dropped = [n for n in tiny_state if n.startswith("mtp.")]
    assert dropped and all(official_to_hf_name(n) is None for n in dropped)
    n_backbone = sum(1 for n in tiny_state if not n.startswith("mtp."))
    n_expert = sum(1 for n in tiny_state if ".ffn.experts." in n and not n.startswith("mtp."))
    assert len(hf_state) == n_backbone - n_expert + 2 * tiny_args.num_hidden_layers
    # loaded values are the given ones (fp32), incl. buffers
    sd = tiny_hf.state_dict()
    assert torch.equal(
        sd["model.layers.1.self_attn.compressor.indexer.position_bias"],
        tiny_state["layers.1.attn.indexer.compressor.ape"],
    )
    assert torch.equal(sd["model.layers.0.mlp.gate.tid2eid"], tiny_state["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(
        sd["model.layers.3.mlp.gate.e_score_correction_bias"], tiny_state["layers.3.ffn.gate.bias"]
    )
    assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values())


def test_unexpected_keys_are_rejected(tiny_state, tiny_args):
    bad = dict(tiny_state)
    del bad["layers.0.attn.wkv.weight"]
    with pytest.raises(CheckpointError, match="missing keys .*self_attn.kv_proj"):
        build_hf_model(bad, tiny_args)


def test_logits_finite_and_prefill_equals_incremental(tiny_hf, tiny_args):
    # 40 tokens: past the window (8), 10 CSA entries (> top-k 4), 5 HCA entries.
    ids = torch.randint(0, tiny_args.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    full = hf_logits(tiny_hf, ids)
    assert full.shape == (40, tiny_args.vocab_size) and full.dtype == torch.float32
    assert torch.isfinite(full).all()
    assert full.std() > 1e-2  # the random state is not degenerate
    for chunks in ([13, 1, 1, 1, 6, 1, 7, 10], [8, 4, 28]):
        inc = hf_incremental_logits(tiny_hf, ids, chunks)
        err = ((inc - full).abs().max() / full.abs().max()).item()
        assert err < 1e-5, (chunks, err)


def test_spec_tensor_list_matches_inventory(tiny_args):
    inventory = pytest.importorskip("deepinfer_engine.model.inventory")
    inv = {
        t.name: tuple(t.shape) for t in inventory.tensor_inventory(tiny_args) if not t.name.endswith(".scale")
    }
    spec = v4_official_shapes_from_spec(tiny_args)
    assert sorted(set(inv) ^ set(spec)) == []
    assert {n: s for n, s in inv.items() if spec[n] != s} == {}


def test_canonical_tie_break_orders_ties_by_lower_index():
    s = torch.tensor([[0.0, 0.5, 0.0, float("-inf"), 0.5, 1e-30, -0.25]])
    order = canonical_tie_break(s).sort(dim=-1, descending=True, stable=False).indices[0].tolist()
    assert order == [1, 4, 5, 0, 2, 6, 3]
    # adjacent distinct fp32 values keep their order even at the far end of a long row
    for x in (1e-3, 0.7, 3.0e4, -2.5):
        a = torch.tensor(x, dtype=torch.float32)
        b = torch.nextafter(a, torch.tensor(float("inf")))
        row = torch.zeros(4096)
        row[0], row[4095] = a, b  # the larger value gets the largest perturbation
        got = canonical_tie_break(row[None])[0]
        assert got[4095] > got[0], x


def test_boundary_tie_detector_and_canonical_hook(tiny_state, tiny_args):
    # The tie hook must not change anything when no tie occurs, and the detector must see raw scores.
    raw = build_hf_model(tiny_state, tiny_args, canonical_topk_ties=False)
    canon = build_hf_model(tiny_state, tiny_args)
    found_tie = found_clean = False
    for seed in range(6):
        ids = torch.randint(0, tiny_args.vocab_size, (40,), generator=torch.Generator().manual_seed(seed))
        ties = hf_indexer_boundary_ties(canon, ids)
        assert ties == hf_indexer_boundary_ties(raw, ids)
        if not ties:
            found_clean = True
            assert torch.equal(hf_logits(raw, ids), hf_logits(canon, ids))
        else:
            found_tie = True
            assert all(tiny_args.compress_ratios[layer] == 4 and 0 <= t < 40 for layer, t in ties)
        if found_tie and found_clean:
            break
    assert found_tie and found_clean


def test_one_shot_reference_equals_prebuilt_model(tiny_hf, tiny_state, tiny_args):
    ids = torch.tensor([0, 17, 4242, 9, 129279, 3, 3])
    ref = hf_reference_logits(tiny_state, tiny_args, ids)
    assert ref.shape == (7, tiny_args.vocab_size) and ref.dtype == torch.float32
    assert torch.equal(ref, hf_logits(tiny_hf, ids))
