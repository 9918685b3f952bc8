"""Model configurations as data: the real released `config.json` files and the tiny / `layers-N` test presets.

Functions return fresh dicts (no module-level mutable state); `preset_config(arch, preset)` is what
`deepinfer make-checkpoint` uses. Real configs: docs/model.md §1.1 (V4-Flash, [V]), §1.2 (V4-Flash-0731
deltas, [S/V]) and §1.3 / `v41_flash_config.json` (V4.1-Flash, reconstructed [S/V]).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.engram_hash import engram_num_embeddings

__all__ = [
    "PRESETS",
    "preset_config",
    "tiny_v4_config",
    "tiny_v4_dspark_config",
    "tiny_v41_config",
    "v4_flash_0731_config",
    "v4_flash_config",
    "v41_flash_config",
]

# The real DeepSeek-V4 tokenizer vocabulary size; tiny presets keep it so the real tokenizer works.
REAL_VOCAB_SIZE = 129280
V41_IMAGE_TOKEN_ID = 129264
# Placeholder id that V4-Flash-0731 / V4.1 use as DSpark noise token (§1.2, §1.3).
DSPARK_NOISE_TOKEN_ID = 128799

# Prime base of the Engram tables in `layers-N` presets (real: 16,000,000).
LAYERS_N_ENGRAM_VOCAB_SIZE = 65536

PRESETS = ("tiny", "tiny-dspark", "full", "layers-N")


def _v4_quantization_config() -> dict[str, Any]:
    """The V4 `quantization_config` (FP8 e4m3, 128x128 blocks, UE8M0 scales; docs/model.md §1.1, [V])."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }


def _v41_top_level_fields() -> dict[str, Any]:
    """The top-level fields every V4.1 config shares: dtype, special ids, `quantization_config` (FP8 32x32
    blocks, FP4 experts; docs/model.md §1.3, reconstructed [S/V])."""
    return {
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": V41_IMAGE_TOKEN_ID,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
    }


def _dspark_fields(*, target_layer_ids: list[int], markov_rank: int) -> dict[str, Any]:
    """The DSpark keys shared by V4-Flash-0731 and V4.1 (block size 5, placeholder noise token; §1.2, §1.3)."""
    return {
        "dspark_block_size": 5,
        "dspark_noise_token_id": DSPARK_NOISE_TOKEN_ID,
        "dspark_target_layer_ids": target_layer_ids,
        "dspark_markov_rank": markov_rank,
    }


def _with_dspark_stages(d: dict[str, Any], *, target_layer_ids: list[int], markov_rank: int) -> dict[str, Any]:
    """A V4 config `d` with one DSpark stage per target layer in place of its MTP block: the MTP ratio entry
    becomes one ratio-0 entry per stage (after the `num_hidden_layers` backbone ratios)."""
    d["compress_ratios"] = d["compress_ratios"][: d["num_hidden_layers"]] + [0] * len(target_layer_ids)
    d.update(_dspark_fields(target_layer_ids=target_layer_ids, markov_rank=markov_rank))
    return d


def v4_flash_config() -> dict[str, Any]:
    """`deepseek-ai/DeepSeek-V4-Flash` config.json as released (docs/model.md §1.1, [V])."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "expert_dtype": "fp4",
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 512,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "model_type": "deepseek_v4",
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 43,
        "num_hash_layers": 3,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "q_lora_rank": 1024,
        "qk_rope_head_dim": 64,
        "quantization_config": _v4_quantization_config(),
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 128,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "vocab_size": 129280,
        "compress_rope_theta": 160000,
        # 43 backbone layers [0,0] + [4,128]*20 + [4], then the MTP layer (0).
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    }


def v4_flash_0731_config() -> dict[str, Any]:
    """`DeepSeek-V4-Flash-0731` ("V4-Flash-DSpark"): V4-Flash plus 3 DSpark stages (docs/model.md §1.2, [S/V])."""
    d = v4_flash_config()
    return _with_dspark_stages(d, target_layer_ids=[40, 41, 42], markov_rank=256)


def v41_flash_config() -> dict[str, Any]:
    """`deepseek-ai/DeepSeek-V4.1-Flash` config.json (reconstructed, docs/model.md §1.3 [S/V])."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        **_v41_top_level_fields(),
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 129280,
            "hidden_size": 5120,
            "moe_intermediate_size": 2304,
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_lora_rank": 1024,
            "o_groups": 8,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "attention_bias": False,
            "max_position_embeddings": 1048576,
            "rope_theta": 10000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "original_max_position_embeddings": 65536,
            },
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "sliding_window": 128,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
            "compress_rope_theta": 160000,
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-06,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 16000000,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "num_nextn_predict_layers": 3,
            **_dspark_fields(target_layer_ids=[37, 38, 39], markov_rank=256),
            "dspark_n_routed_experts": 128,
            "dspark_num_experts_per_tok": 3,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
    }


def tiny_v4_config() -> dict[str, Any]:
    """Tiny V4 (docs/testing.md §9.1) with the real 129,280-token vocabulary.

    Layers: 0 SWA (hash), 1 CSA (hash), 2 HCA(8), 3 CSA, 4 HCA(8), 5 CSA, then the MTP block (ratio 0).
    """
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "expert_dtype": "fp4",
        "vocab_size": REAL_VOCAB_SIZE,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_hash_layers": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "sliding_window": 8,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 32,
        },
        "compress_ratios": [0, 4, 8, 4, 8, 4, 0],
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "quantization_config": _v4_quantization_config(),
    }


def tiny_v4_dspark_config() -> dict[str, Any]:
    """Tiny V4-Flash-0731 style: the tiny V4 backbone with 3 DSpark stages instead of the MTP block (§9.1)."""
    d = tiny_v4_config()
    return _with_dspark_stages(d, target_layer_ids=[3, 4, 5], markov_rank=8)


def tiny_v41_config() -> dict[str, Any]:
    """Tiny V4.1 (docs/testing.md §9.2) with the real vocabulary, image token and compressed Engram vocabulary.

    Engram uses the real 99,092-class compressed vocabulary (token map from the real tokenizer) with a small
    prime base (engram_vocab_size 64) so the tables stay small; engram_num_embeddings = the prime sums.
    """
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        **_v41_top_level_fields(),
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": REAL_VOCAB_SIZE,
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "qk_rope_head_dim": 8,
            "q_lora_rank": 32,
            "o_lora_rank": 16,
            "o_groups": 2,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "rope_theta": 10000,
            "compress_rope_theta": 160000,
            "max_position_embeddings": 4096,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "original_max_position_embeddings": 32,
            },
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "sliding_window": 8,
            "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
            "kv_source_layer_ids": [2, 4, 5],
            "index_source_layer_ids": [2, 4, 5, 7],
            "candidate_source_layer_id": 5,
            "candidate_topk_blocks": 3,
            "candidate_block_size": 2,
            "index_n_heads": 4,
            "index_head_dim": 16,
            "index_topk": 4,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 3],
            "engram_num_embeddings": [462, 630],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 64,
            "engram_n_heads": 2,
            "engram_head_dim": 16,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "num_nextn_predict_layers": 3,
            **_dspark_fields(target_layer_ids=[5, 6, 7], markov_rank=8),
            "dspark_n_routed_experts": 4,
            "dspark_num_experts_per_tok": 1,
            "tie_word_embeddings": False,
        },
        # A vision_config with no tower layers: keeps ffn.gate.bias_vl (image routing) without a vision tower.
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0},
    }


def _layers_n(full: dict[str, Any], arch: Literal["v4", "v41"], n: int) -> dict[str, Any]:
    """Real widths with the first n backbone layers (for GPU benchmarks); sources/ids outside are dropped."""
    d = copy.deepcopy(full)
    tc = d if arch == "v4" else d["text_config"]
    L = tc["num_hidden_layers"]
    if not 1 <= n <= L:
        raise ConfigError(f"preset 'layers-{n}': found {n} layers; expected 1..{L} for arch {arch}")
    tc["compress_ratios"] = tc["compress_ratios"][:n] + tc["compress_ratios"][L:]
    tc["num_hidden_layers"] = n
    if arch == "v4":
        tc["num_hash_layers"] = min(tc["num_hash_layers"], n)
        if "dspark_target_layer_ids" in tc:
            _shift_dspark_stages(tc, L, n)
        return d
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        tc[key] = [s for s in tc[key] if s < n]
    if tc.get("candidate_source_layer_id") is not None and tc["candidate_source_layer_id"] >= n:
        for key in ("candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size"):
            tc.pop(key)
    tc["engram_layer_ids"] = [l for l in tc["engram_layer_ids"] if l < n]
    # The real Engram tables hold ~384M rows (~100 GB per layer): a benchmark checkpoint keeps the real row
    # width and lookup count but a small prime base, so the tables are ~1.6M rows. Hashing cost is unchanged.
    tc["engram_vocab_size"] = LAYERS_N_ENGRAM_VOCAB_SIZE
    tc["engram_num_embeddings"] = engram_num_embeddings(
        tc["engram_layer_ids"], tc["engram_max_ngram_size"], tc["engram_n_heads"], tc["engram_vocab_size"]
    )
    if not tc["engram_layer_ids"]:
        for key in [k for k in tc if k.startswith("engram_")]:
            tc.pop(key)
    _shift_dspark_stages(tc, L, n)
    tc["num_nextn_predict_layers"] = len(tc["dspark_target_layer_ids"])
    return d


def _shift_dspark_stages(tc: dict[str, Any], old_layers: int, n: int) -> None:
    """Cut to n layers: shift the DSpark targets and keep one ratio-0 entry per (possibly fewer) stage."""
    tc["dspark_target_layer_ids"] = _shift_targets(tc["dspark_target_layer_ids"], old_layers, n)
    tc["compress_ratios"] = tc["compress_ratios"][:n] + [0] * len(tc["dspark_target_layer_ids"])


def _shift_targets(targets: list[int], old_layers: int, n: int) -> list[int]:
    # Keep the DSpark targets "the last k layers" relative to the new depth (clipped at 0, deduplicated).
    shifted = sorted({max(0, t - (old_layers - n)) for t in targets})
    return shifted


def preset_config(arch: str, preset: str, *, n_routed_experts: int | None = None) -> dict[str, Any]:
    """The config.json dict of a preset: `tiny`, `tiny-dspark` (v4 only), `full`, `layers-N`.

    `n_routed_experts` overrides the backbone's routed-expert count (draft stages keep at most that many), so that
    a real-width slice can be written in a fraction of the time and disk; top-k is clipped to it.
    """
    cfg = _preset_config(arch, preset)
    if n_routed_experts is not None:
        _override_experts(cfg, arch, n_routed_experts)
    return cfg


def _override_experts(cfg: dict[str, Any], arch: str, n: int) -> None:
    tc = cfg if arch == "v4" else cfg["text_config"]
    if n < 1:
        raise ConfigError(f"n_routed_experts: found {n}, expected >= 1")
    tc["n_routed_experts"] = n
    tc["num_experts_per_tok"] = min(tc["num_experts_per_tok"], n)
    if "dspark_n_routed_experts" in tc:
        tc["dspark_n_routed_experts"] = min(tc["dspark_n_routed_experts"], n)
        tc["dspark_num_experts_per_tok"] = min(tc["dspark_num_experts_per_tok"], tc["dspark_n_routed_experts"])


def _preset_config(arch: str, preset: str) -> dict[str, Any]:
    if arch not in ("v4", "v41"):
        raise ConfigError(f"--arch: found {arch!r}; expected 'v4' or 'v41'")
    if preset == "tiny":
        return tiny_v4_config() if arch == "v4" else tiny_v41_config()
    if preset == "tiny-dspark":
        if arch != "v4":
            raise ConfigError(
                "--preset tiny-dspark: only for --arch v4 (the tiny v41 preset already has DSpark)"
            )
        return tiny_v4_dspark_config()
    if preset == "full":
        return v4_flash_config() if arch == "v4" else v41_flash_config()
    m = re.fullmatch(r"layers-(\d+)", preset)
    if m:
        return _layers_n(v4_flash_config() if arch == "v4" else v41_flash_config(), arch, int(m.group(1)))  # type: ignore[arg-type]
    raise ConfigError(f"--preset: found {preset!r}; expected one of tiny, tiny-dspark (v4), full, layers-N")
