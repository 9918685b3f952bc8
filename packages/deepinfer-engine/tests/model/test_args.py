"""ModelArgs parsing and validation: the real configs parse, every inconsistency names field, value, expectation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model import presets
from deepinfer_engine.model.args import LayerPlan, ModelArgs

V41_DESIGN_JSON = Path(__file__).resolve().parents[1] / "data" / "v41_flash_config.json"


def test_v4_flash_real_config_parses() -> None:
    a = ModelArgs.from_config_dict(presets.v4_flash_config())
    assert a.arch == "v4" and a.hidden_size == 4096 and a.num_hidden_layers == 43
    assert a.num_draft_layers == 1 and len(a.layer_plans) == 44
    kinds = [p.kind for p in a.layer_plans]
    assert kinds[:4] == ["swa", "swa", "csa", "hca"] and kinds[42] == "csa" and kinds[43] == "swa"
    assert kinds.count("csa") == 21 and kinds.count("hca") == 20
    assert [p.layer_id for p in a.layer_plans if p.is_hash_layer] == [0, 1, 2]
    assert a.layer_plans[43].is_draft and a.layer_plans[43].prefix == "mtp.0."
    csa, hca, swa = a.layer_plans[2], a.layer_plans[3], a.layer_plans[0]
    assert (csa.has_compressor, csa.has_indexer_k, csa.has_indexer_q, csa.index_source) == (
        True,
        True,
        True,
        2,
    )
    assert (hca.has_compressor, hca.has_indexer_q, hca.index_source, hca.kv_source) == (True, False, None, 3)
    assert (swa.rope_theta, swa.use_yarn, csa.rope_theta, csa.use_yarn) == (10000.0, False, 160000.0, True)
    assert a.weight_block_size == (128, 128) and a.scale_fmt == "ue8m0" and a.expert_dtype == "fp4"
    assert a.rope_scaling is not None and a.rope_scaling.factor == 16
    assert a.has_hc_head and a.q_head_norm and not a.has_dspark


def test_v4_flash_0731_dspark_config_parses() -> None:
    a = ModelArgs.from_config_dict(presets.v4_flash_0731_config())
    assert a.has_dspark and a.num_draft_layers == 3 and len(a.compress_ratios) == 46
    assert a.num_nextn_predict_layers == 1  # left at 1 in the released config
    assert [p.prefix for p in a.layer_plans[43:]] == ["mtp.0.", "mtp.1.", "mtp.2."]
    assert all(p.n_routed_experts == 256 and p.num_experts_per_tok == 6 for p in a.layer_plans[43:])


@pytest.mark.skipif(not V41_DESIGN_JSON.is_file(), reason="design docs not mounted on this machine")
def test_v41_real_config_parses_from_design_file() -> None:
    a = ModelArgs.from_file(V41_DESIGN_JSON)
    assert a == ModelArgs.from_config_dict(presets.v41_flash_config())
    assert a.arch == "v41" and a.hidden_size == 5120 and a.num_hidden_layers == 40 and a.num_draft_layers == 3
    assert a.weight_block_size == (32, 32) and a.expert_dtype == "fp4" and a.image_token_id == 129264
    modes = {p.layer_id: p.mode for p in a.layer_plans}
    assert [l for l, m in modes.items() if m == "full"] == [2, 8, 14, 20]
    assert [l for l, m in modes.items() if m == "reindex"] == [24, 28, 32, 36]
    assert modes[0] == modes[1] == modes[40] == "swa" and modes[3] == modes[21] == modes[39] == "reuse"
    p25 = a.layer_plans[25]
    assert (p25.kv_source, p25.index_source, p25.ratio) == (20, 24, 1)
    p13 = a.layer_plans[13]
    assert (p13.kv_source, p13.index_source, p13.ratio) == (8, 8, 2)
    assert [p.layer_id for p in a.layer_plans if p.publishes_candidates] == [20]
    assert [p.layer_id for p in a.layer_plans if p.consumes_candidates] == [24, 28, 32, 36]
    assert [p.layer_id for p in a.layer_plans if p.has_engram] == [1, 14]
    assert [p.layer_id for p in a.layer_plans if p.has_indexer_k] == [2, 8, 14, 20]
    assert not any(p.is_hash_layer for p in a.layer_plans)
    assert all(p.n_routed_experts == 128 and p.num_experts_per_tok == 3 for p in a.layer_plans[40:])
    assert a.layer_plans[2].use_yarn and not a.layer_plans[41].use_yarn
    assert a.has_gate_bias_vl and not a.has_hc_head and not a.q_head_norm and a.rms_norm_eps == 1e-20


@pytest.mark.parametrize("arch", ["v4", "v41"])
@pytest.mark.parametrize("preset", ["tiny", "full", "layers-3", "layers-22"])
def test_presets_parse_and_round_trip(arch: str, preset: str) -> None:
    a = ModelArgs.from_config_dict(presets.preset_config(arch, preset))
    again = ModelArgs.from_config_dict(json.loads(json.dumps(a.to_config_dict())))
    assert again == a and again.layer_plans == a.layer_plans


def test_tiny_v41_layer_modes_match_design_doc() -> None:
    a = ModelArgs.from_config_dict(presets.tiny_v41_config())
    assert [p.mode for p in a.layer_plans] == [
        "swa", "swa", "full", "reuse", "full", "full", "reuse", "reindex", "swa", "swa", "swa"
    ]  # fmt: skip
    assert a.vocab_size == 129280 and a.engram_compressed_vocab_size == 99092
    assert a.engram_num_embeddings == (462, 630)  # §9.2: 67+71+73+79+83+89, 97+...+113
    assert isinstance(a.layer_plans[0], LayerPlan)


def test_from_checkpoint_dir_and_bad_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(presets.tiny_v4_config()))
    assert ModelArgs.from_checkpoint_dir(tmp_path).arch == "v4"
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelArgs.from_checkpoint_dir(tmp_path / "nothing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelArgs.from_file(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------------
# validation errors: (config mutation, field named, value shown, expectation fragment)


def _v4() -> dict:
    return presets.v4_flash_config()


def _v41() -> dict:
    return presets.v41_flash_config()


def _set(d: dict, path: str, value: object) -> dict:
    d = copy.deepcopy(d)
    keys = path.split(".")
    tgt = d
    for k in keys[:-1]:
        tgt = tgt[k]
    if value is _DELETE:
        del tgt[keys[-1]]
    else:
        tgt[keys[-1]] = value
    return d


_DELETE = object()

CASES = [
    # (base, path, value, fragments expected in the message)
    ("v4", "model_type", "deepseek_v3", ["model_type", "deepseek_v3", "deepseek_v4"]),
    ("v4", "hidden_size", _DELETE, ["hidden_size", "missing"]),
    ("v41", "text_config.hidden_size", _DELETE, ["text_config.hidden_size", "missing"]),
    ("v4", "hidden_size", "4096", ["hidden_size", "'4096'", "integer"]),
    ("v4", "compress_ratios", [0, 0] + [4, 128] * 20 + [4], ["compress_ratios", "43 entries", "44"]),
    ("v4", "compress_ratios", [0, 0] + [4, 128] * 20 + [4] + [4], ["compress_ratios[43]", "4", "0"]),
    (
        "v41",
        "text_config.compress_ratios",
        [0, 0] + [2] * 18 + [1] * 20 + [0],
        ["compress_ratios", "41", "43"],
    ),
    (
        "v41",
        "text_config.compress_ratios",
        [0, 0] + [2] * 18 + [4] * 20 + [0] * 3,
        ["compress_ratios[20]", "4", "0, 1 or 2"],
    ),
    (
        "v41",
        "text_config.kv_source_layer_ids",
        [2, 8, 14],
        ["kv_source_layer_ids", "[2, 8, 14]", "missing [20]"],
    ),
    ("v41", "text_config.kv_source_layer_ids", [1, 2, 8, 14, 20], ["kv_source_layer_ids", "ratio 0 at [1]"]),
    ("v41", "text_config.kv_source_layer_ids", [2, 8, 14, 20, 40], ["kv_source_layer_ids", "[0, 40)"]),
    (
        "v41",
        "text_config.kv_source_layer_ids",
        [8, 2, 14, 20],
        ["kv_source_layer_ids", "strictly increasing"],
    ),
    ("v41", "text_config.kv_source_layer_ids", _DELETE, ["text_config.kv_source_layer_ids", "missing"]),
    ("v41", "text_config.index_source_layer_ids", [2, 8, 20, 24], ["index_source_layer_ids", "missing [14]"]),
    (
        "v41",
        "text_config.index_source_layer_ids",
        [0, 2, 8, 14, 20],
        ["index_source_layer_ids", "ratio 0 at [0]"],
    ),
    (
        "v41",
        "text_config.candidate_source_layer_id",
        21,
        ["candidate_source_layer_id", "21", "index_source_layer_ids"],
    ),
    ("v41", "text_config.engram_layer_ids", [1, 45], ["engram_layer_ids", "[1, 45]", "[0, 40)"]),
    (
        "v41",
        "text_config.engram_num_embeddings",
        [384006168, 384016683],
        ["engram_num_embeddings", "384016683", "384016682"],
    ),
    ("v41", "text_config.engram_num_embeddings", [384006168], ["engram_num_embeddings", "2 entries"]),
    (
        "v41",
        "text_config.engram_vocab_size",
        16000100,
        ["engram_num_embeddings", "engram_vocab_size=16000100"],
    ),
    ("v4", "head_dim", 64, ["qk_rope_head_dim", "64", "below head_dim=64"]),
    ("v4", "o_groups", 7, ["o_groups", "7", "divisor of num_attention_heads=64"]),
    ("v4", "rope_scaling", {"type": "linear", "factor": 2}, ["rope_scaling.type", "linear", "yarn"]),
    ("v4", "rope_scaling.factor", 0.5, ["rope_scaling.factor", "0.5", ">= 1"]),
    ("v4", "rope_scaling.beta_slow", 64, ["beta_fast/beta_slow", "beta_fast > beta_slow"]),
    (
        "v4",
        "rope_scaling.original_max_position_embeddings",
        _DELETE,
        ["rope_scaling", "original_max_position_embeddings"],
    ),
    ("v4", "rope_scaling", "yarn", ["rope_scaling", "'yarn'", "an object"]),
    ("v4", "num_key_value_heads", 8, ["num_key_value_heads", "8", "1"]),
    ("v4", "num_hash_layers", 44, ["num_hash_layers", "44", "<= num_hidden_layers=43"]),
    ("v41", "text_config.num_hash_layers", 3, ["num_hash_layers", "3", "0"]),
    ("v4", "kv_source_layer_ids", [2], ["kv_source_layer_ids", "V4.1-only"]),
    ("v4", "expert_dtype", "fp6", ["expert_dtype", "fp6", "'fp4' or 'fp8'"]),
    ("v4", "quantization_config.weight_block_size", [128], ["weight_block_size", "[128]", "two positive"]),
    ("v4", "scoring_func", "softmax", ["scoring_func", "softmax", "sqrtsoftplus"]),
    ("v41", "text_config.num_nextn_predict_layers", 1, ["num_nextn_predict_layers", "1", "3"]),
    ("v41", "text_config.dspark_target_layer_ids", [37, 38, 40], ["dspark_target_layer_ids", "[0, 40)"]),
    ("v41", "text_config.dspark_noise_token_id", 129280, ["dspark_noise_token_id", "129280", "[0, 129280)"]),
    ("v41", "text_config.dspark_num_experts_per_tok", 200, ["dspark_num_experts_per_tok", "200", "[1, 128]"]),
    ("v41", "text_config", _DELETE, ["text_config", "None", "an object"]),
    ("v41", "image_token_id", 200000, ["image_token_id", "200000", "[0, 129280)"]),
    ("v4", "num_experts_per_tok", 300, ["num_experts_per_tok", "300", "<= n_routed_experts=256"]),
    ("v4", "index_head_dim", 64, ["index_head_dim", "64", "> qk_rope_head_dim=64"]),
]


@pytest.mark.parametrize(("base", "path", "value", "fragments"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_validation_error_names_field_value_expected(
    base: str, path: str, value: object, fragments: list[str]
) -> None:
    d = _set(_v4() if base == "v4" else _v41(), path, value)
    with pytest.raises(ModelConfigError) as info:
        ModelArgs.from_config_dict(d)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_kv_source_ratio_change_without_source_is_rejected() -> None:
    # layer 5 switches from ratio 2 to ratio 1 but is no kv source: a Reuse layer would read a cache of a
    # different ratio.
    d = presets.tiny_v41_config()
    d["text_config"]["kv_source_layer_ids"] = [2, 4]
    d["text_config"]["index_source_layer_ids"] = [2, 4, 7]
    d["text_config"]["candidate_source_layer_id"] = 4
    with pytest.raises(ModelConfigError, match=r"kv_source_layer_ids.*compress ratio changes.*missing \[5\]"):
        ModelArgs.from_config_dict(d)


def test_direct_construction_is_validated() -> None:
    a = ModelArgs.from_config_dict(presets.tiny_v4_config())
    with pytest.raises(ModelConfigError, match="o_groups"):
        a.replace(o_groups=3)
    with pytest.raises(ModelConfigError, match="compress_ratios"):
        a.replace(compress_ratios=(0, 4))
