"""Cross-field validation of `ModelArgs` (layer ids, compress ratios, source lists, DSpark, Engram).

Each error names the field, the value found and what is expected. Pure Python (numpy for the Engram primes).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from deepinfer_engine.model.config_schema import config_error

if TYPE_CHECKING:
    from deepinfer_engine.model.args import ModelArgs

__all__ = ["MODEL_TYPES", "check_args"]

MODEL_TYPES = {"deepseek_v4": "v4", "deepseek_v41": "v41"}


def _check_ids(name: str, ids: tuple[int, ...], upper: int, what: str) -> None:
    if any(i < 0 or i >= upper for i in ids):
        raise config_error(name, list(ids), f"{what} in [0, {upper})")
    if list(ids) != sorted(set(ids)):
        raise config_error(name, list(ids), "strictly increasing layer ids (sorted, no duplicates)")


def check_args(a: ModelArgs) -> None:  # noqa: C901 - one flat list of checks reads best
    """Cross-field rules of a parsed config (per-field types and bounds come from the schema table)."""
    if a.arch not in ("v4", "v41"):
        raise config_error("arch", a.arch, "'v4' or 'v41'")
    if MODEL_TYPES.get(a.model_type) != a.arch:
        raise config_error("model_type", a.model_type, f"the model_type of arch {a.arch!r}")
    for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "max_position_embeddings",
    ):  # fmt: skip
        v = getattr(a, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise config_error(name, v, "a positive integer")
    if a.num_key_value_heads != 1:
        raise config_error("num_key_value_heads", a.num_key_value_heads, "1 (one shared K=V head)")
    if not (0 < a.qk_rope_head_dim < a.head_dim) or a.qk_rope_head_dim % 2:
        raise config_error("qk_rope_head_dim", a.qk_rope_head_dim, f"an even number below head_dim={a.head_dim}")
    if not a.index_head_dim > a.qk_rope_head_dim:
        raise config_error("index_head_dim", a.index_head_dim, f"> qk_rope_head_dim={a.qk_rope_head_dim}")
    if a.num_attention_heads % a.o_groups:
        raise config_error("o_groups", a.o_groups, f"a divisor of num_attention_heads={a.num_attention_heads}")
    if a.num_experts_per_tok > a.n_routed_experts:
        raise config_error("num_experts_per_tok", a.num_experts_per_tok, f"<= n_routed_experts={a.n_routed_experts}")
    if a.scoring_func != "sqrtsoftplus":
        raise config_error("scoring_func", a.scoring_func, "'sqrtsoftplus'")
    if a.hidden_act != "silu":
        raise config_error("hidden_act", a.hidden_act, "'silu'")
    if not (a.rms_norm_eps > 0 and math.isfinite(a.rms_norm_eps)):
        raise config_error("rms_norm_eps", a.rms_norm_eps, "a positive number")
    if not (a.rope_theta > 0 and a.compress_rope_theta > 0):
        raise config_error(
            "rope_theta/compress_rope_theta", (a.rope_theta, a.compress_rope_theta), "positive numbers"
        )
    if a.expert_dtype not in ("fp4", "fp8"):
        raise config_error("expert_dtype", a.expert_dtype, "'fp4' or 'fp8'")
    if a.scale_fmt not in ("ue8m0", None):
        raise config_error("quantization_config.scale_fmt", a.scale_fmt, "'ue8m0' or absent (float32 scales)")
    if len(a.weight_block_size) != 2 or min(a.weight_block_size) < 1:
        raise config_error("quantization_config.weight_block_size", list(a.weight_block_size),
                           "two positive integers [b_out, b_in]")
    if a.hc_dim <= 0:
        raise config_error("hc_mult", a.hc_mult, "a positive integer")

    L = a.num_hidden_layers
    # --- draft layers and compress_ratios
    if a.has_dspark:
        if a.dspark_block_size is None or a.dspark_block_size < 1:
            raise config_error("dspark_block_size", a.dspark_block_size, "a positive integer")
        if not a.dspark_target_layer_ids:
            raise config_error(
                "dspark_target_layer_ids", list(a.dspark_target_layer_ids), "a non-empty list of layer ids"
            )
        _check_ids("dspark_target_layer_ids", a.dspark_target_layer_ids, L, "backbone layer ids")
        if a.dspark_noise_token_id is None or not 0 <= a.dspark_noise_token_id < a.vocab_size:
            raise config_error(
                "dspark_noise_token_id", a.dspark_noise_token_id, f"a token id in [0, {a.vocab_size})"
            )
        if a.dspark_markov_rank is None or a.dspark_markov_rank < 1:
            raise config_error("dspark_markov_rank", a.dspark_markov_rank, "a positive integer")
        if a.dspark_n_routed_experts is not None and a.dspark_n_routed_experts < 1:
            raise config_error("dspark_n_routed_experts", a.dspark_n_routed_experts, "a positive integer")
        if not 1 <= a.dspark_top_k <= a.dspark_n_experts:
            raise config_error(
                "dspark_num_experts_per_tok", a.dspark_num_experts_per_tok, f"in [1, {a.dspark_n_experts}]"
            )
        if a.arch == "v41" and a.num_nextn_predict_layers != len(a.dspark_target_layer_ids):
            # V4.1 counts its DSpark stages in num_nextn_predict_layers (3); V4-Flash-0731 left it at 1.
            raise config_error(
                "num_nextn_predict_layers",
                a.num_nextn_predict_layers,
                f"{len(a.dspark_target_layer_ids)} (one per DSpark stage = len(dspark_target_layer_ids))",
            )
    elif a.arch == "v41" and a.num_nextn_predict_layers:
        raise config_error("dspark_block_size", None, "present: V4.1 draft layers are DSpark stages")
    expected_len = L + a.num_draft_layers
    ratios = a.compress_ratios
    if not isinstance(ratios, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in ratios):
        raise config_error("compress_ratios", ratios, "a tuple of integers")
    if len(ratios) != expected_len:
        kind = "DSpark stages" if a.has_dspark else "MTP layers"
        raise config_error(
            "compress_ratios",
            f"{len(ratios)} entries",
            f"{expected_len} = num_hidden_layers {L} + {a.num_draft_layers} {kind}",
        )
    for k, r in enumerate(ratios[L:]):
        if r != 0:
            raise config_error(f"compress_ratios[{L + k}]", r, "0 (MTP/DSpark layers are sliding-window only)")
    allowed = "0, 1 or 2" if a.arch == "v41" else "a non-negative integer"
    for l, r in enumerate(ratios[:L]):
        if r < 0 or (a.arch == "v41" and r not in (0, 1, 2)):
            raise config_error(f"compress_ratios[{l}]", r, allowed)
    if a.sliding_window < 1:
        raise config_error("sliding_window", a.sliding_window, "a positive integer")

    # --- hash layers
    if a.arch == "v41" and a.num_hash_layers:
        raise config_error("num_hash_layers", a.num_hash_layers, "0 (V4.1 has no hash routing)")
    if a.num_hash_layers > L:
        raise config_error("num_hash_layers", a.num_hash_layers, f"<= num_hidden_layers={L}")

    # --- V4.1 source lists
    if a.arch == "v41":
        compressed = [l for l in range(L) if ratios[l] > 0]
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(a, name)
            _check_ids(name, ids, L, "backbone layer ids")
            bad = [s for s in ids if ratios[s] == 0]
            if bad:
                raise config_error(name, list(ids), f"layers with ratio > 0 (ratio 0 at {bad})")
        # A layer reuses the compressed cache of the last kv source at or before it, so a kv source must start
        # every run of compressed layers and every change of ratio (a Reuse layer shares its source's ratio).
        must = [l for l in compressed if l == 0 or ratios[l - 1] != ratios[l]]
        missing = [l for l in must if l not in a.kv_source_layer_ids]
        if missing:
            raise config_error(
                "kv_source_layer_ids",
                list(a.kv_source_layer_ids),
                f"to include every layer where the compress ratio changes {must} (missing {missing})",
            )
        # Between two kv sources (and after the last) all layers must share the source's ratio.
        for l in compressed:
            src = max(s for s in a.kv_source_layer_ids if s <= l)
            if ratios[src] != ratios[l]:
                raise config_error(
                    "kv_source_layer_ids",
                    list(a.kv_source_layer_ids),
                    f"a source for layer {l} with ratio {ratios[l]}",
                )
        # A kv source is also an index source (Full mode: it scores its own keys); otherwise the index
        # source a layer inherits would score keys of a different compressed cache.
        missing = [s for s in a.kv_source_layer_ids if s not in a.index_source_layer_ids]
        if missing:
            raise config_error(
                "index_source_layer_ids",
                list(a.index_source_layer_ids),
                f"to include every kv source layer {list(a.kv_source_layer_ids)} (missing {missing})",
            )
        if a.candidate_source_layer_id is not None:
            if a.candidate_source_layer_id not in a.index_source_layer_ids:
                raise config_error(
                    "candidate_source_layer_id",
                    a.candidate_source_layer_id,
                    f"one of index_source_layer_ids {list(a.index_source_layer_ids)}",
                )
            if a.candidate_block_size < 1 or a.candidate_topk_blocks < 1:
                raise config_error(
                    "candidate_block_size/candidate_topk_blocks",
                    (a.candidate_block_size, a.candidate_topk_blocks),
                    "positive integers when candidate_source_layer_id is set",
                )
        if a.image_token_id is not None and not 0 <= a.image_token_id < a.vocab_size:
            raise config_error("image_token_id", a.image_token_id, f"a token id in [0, {a.vocab_size})")
        _validate_engram(a)
    else:
        if a.kv_source_layer_ids or a.index_source_layer_ids or a.engram_layer_ids:
            raise config_error(
                "kv_source_layer_ids/index_source_layer_ids/engram_layer_ids", "set", "empty for arch v4"
            )
        if a.candidate_source_layer_id is not None:
            raise config_error("candidate_source_layer_id", a.candidate_source_layer_id, "absent for arch v4")


def _validate_engram(a: ModelArgs) -> None:
    if not a.engram_layer_ids:
        return
    L = a.num_hidden_layers
    _check_ids("engram_layer_ids", a.engram_layer_ids, L, "backbone layer ids")
    if len(a.engram_num_embeddings) != len(a.engram_layer_ids):
        raise config_error(
            "engram_num_embeddings",
            list(a.engram_num_embeddings),
            f"{len(a.engram_layer_ids)} entries (one per engram layer {list(a.engram_layer_ids)})",
        )
    for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                 "engram_compressed_vocab_size"):  # fmt: skip
        v = getattr(a, name)
        if not isinstance(v, int) or v < (2 if name in ("engram_max_ngram_size", "engram_vocab_size") else 1):
            raise config_error(name, v, "a positive integer (>= 2 for max_ngram_size / vocab_size)")
    if not 0 <= a.engram_pad_token_id < a.vocab_size:
        raise config_error("engram_pad_token_id", a.engram_pad_token_id, f"a token id in [0, {a.vocab_size})")
    from deepinfer_engine.model.engram_hash import engram_num_embeddings  # numpy only

    expected = engram_num_embeddings(
        a.engram_layer_ids, a.engram_max_ngram_size, a.engram_n_heads, a.engram_vocab_size
    )
    if list(a.engram_num_embeddings) != expected:
        raise config_error(
            "engram_num_embeddings",
            list(a.engram_num_embeddings),
            f"{expected} (sums of the hash primes >= engram_vocab_size={a.engram_vocab_size}, "
            "docs/model.md §C.6)",
        )
