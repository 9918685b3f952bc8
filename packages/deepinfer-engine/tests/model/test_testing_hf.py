"""HF oracle harness (deepinfer_engine.testing_hf) on the tiny V4 config (architecture.md §9.1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from deepinfer_engine.errors import CheckpointError  # noqa: E402
from deepinfer_engine.model.args import ModelArgs  # noqa: E402
from deepinfer_engine.model.presets import tiny_v4_config  # noqa: E402
from deepinfer_engine.testing_hf import (  # noqa: E402
    build_hf_model,
    hf_config_from_args,
    hf_incremental_logits,
    hf_logits,
    official_to_hf_name,
    official_to_hf_state_dict,
)


def _v4_backbone_shapes(args) -> dict[str, tuple[int, ...]]:
    """Official V4 backbone tensor names -> logical shapes, from architecture.md §6.3 (MTP included)."""
    d, hc = args.hidden_size, args.hc_mult
    H, Dh, Rq = args.num_attention_heads, args.head_dim, args.q_lora_rank
    G, Ro, E, I = args.o_groups, args.o_lora_rank, args.n_routed_experts, args.moe_intermediate_size
    nI, dI, V = args.index_n_heads, args.index_head_dim, args.vocab_size
    mix = (2 + hc) * hc
    out: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, d),
        "head.weight": (V, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    n_layers = len(args.compress_ratios)  # backbone + MTP
    for l in range(n_layers):
        ratio = args.compress_ratios[l]
        is_mtp = l >= args.num_hidden_layers
        p = f"mtp.{l - args.num_hidden_layers}." if is_mtp else f"layers.{l}."
        out |= {
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "hc_attn_fn": (mix, hc * d),
            p + "hc_ffn_fn": (mix, hc * d),
            p + "hc_attn_base": (mix,),
            p + "hc_ffn_base": (mix,),
            p + "hc_attn_scale": (3,),
            p + "hc_ffn_scale": (3,),
            p + "attn.attn_sink": (H,),
            p + "attn.q_norm.weight": (Rq,),
            p + "attn.kv_norm.weight": (Dh,),
            p + "attn.wq_a.weight": (Rq, d),
            p + "attn.wq_b.weight": (H * Dh, Rq),
            p + "attn.wkv.weight": (Dh, d),
            p + "attn.wo_a.weight": (G * Ro, H * Dh // G),
            p + "attn.wo_b.weight": (d, G * Ro),
            p + "ffn.gate.weight": (E, d),
            p + "ffn.shared_experts.w1.weight": (I, d),
            p + "ffn.shared_experts.w3.weight": (I, d),
            p + "ffn.shared_experts.w2.weight": (d, I),
        }
        if ratio > 0:
            width = 2 * Dh if ratio == 4 else Dh  # CSA overlap doubles the compressor width
            out |= {
                p + "attn.compressor.wkv.weight": (width, d),
                p + "attn.compressor.wgate.weight": (width, d),
                p + "attn.compressor.ape": (ratio, width),
                p + "attn.compressor.norm.weight": (Dh,),
            }
        if ratio == 4:
            out |= {
                p + "attn.indexer.wq_b.weight": (nI * dI, Rq),
                p + "attn.indexer.weights_proj.weight": (nI, d),
                p + "attn.indexer.compressor.wkv.weight": (2 * dI, d),
                p + "attn.indexer.compressor.wgate.weight": (2 * dI, d),
                p + "attn.indexer.compressor.ape": (ratio, 2 * dI),
                p + "attn.indexer.compressor.norm.weight": (dI,),
            }
        if not is_mtp and l < args.num_hash_layers:
            out[p + "ffn.gate.tid2eid"] = (V, args.num_experts_per_tok)
        else:
            out[p + "ffn.gate.bias"] = (E,)
        for e in range(E):
            out |= {
                p + f"ffn.experts.{e}.w1.weight": (I, d),
                p + f"ffn.experts.{e}.w3.weight": (I, d),
                p + f"ffn.experts.{e}.w2.weight": (d, I),
            }
        if is_mtp:
            out |= {
                p + "e_proj.weight": (d, d),
                p + "h_proj.weight": (d, d),
                p + "enorm.weight": (d,),
                p + "hnorm.weight": (d,),
                p + "norm.weight": (d,),
                p + "hc_head_fn": (hc, hc * d),
                p + "hc_head_base": (hc,),
                p + "hc_head_scale": (1,),
            }
    return out


def _official_shapes(args) -> dict[str, tuple[int, ...]]:
    """C's inventory when it exists (official names, logical shapes), else the §6.3 list above."""
    try:
        from deepinfer_engine.model.inventory import tensor_inventory
    except ImportError:
        return _v4_backbone_shapes(args)
    return {t.name: tuple(t.shape) for t in tensor_inventory(args) if not t.name.endswith(".scale")}


def random_official_state(args, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 official-name state with well-conditioned magnitudes (non-zero ape, sinks, biases)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_official_shapes(args).items()):
        if name.endswith("tid2eid"):
            out[name] = torch.randint(0, args.n_routed_experts, shape, generator=g, dtype=torch.int64)
            continue
        if name.endswith(("norm.weight",)):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("_fn",)):
            t = 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(("_base", "ape", "gate.bias")):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("_scale"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("attn_sink"):
            t = torch.randn(shape, generator=g)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=g)
        else:  # [out, in] linear: unit-variance outputs
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = t.float()
    return out


@pytest.fixture(scope="module")
def tiny_args():
    return ModelArgs.from_config_dict(tiny_v4_config())


@pytest.fixture(scope="module")
def tiny_state(tiny_args):
    return random_official_state(tiny_args, seed=0)


@pytest.fixture(scope="module")
def tiny_hf(tiny_state, tiny_args):
    return build_hf_model(tiny_state, tiny_args)


def test_name_mapping_spot_checks():
    # architecture.md §6.6, verified against transformers 5.24 conversion_mapping.py / modeling_deepseek_v4.py
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
