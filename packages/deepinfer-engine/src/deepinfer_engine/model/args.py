"""`ModelArgs`: a checkpoint's `config.json` (DeepSeek-V4-Flash, V4-Flash-0731, V4.1-Flash) parsed and validated.

Pure Python (no torch). Field names are the HF `config.json` names; `arch` says which architecture applies
(`"v4"`: docs/model.md Part A/B, `"v41"`: Part C). Concerns live in their own modules: the field table that
generates parsing and serialization (`config_schema`), the cross-field rules (`config_checks`) and the per-layer
plan derived once from the result (`layer_plan`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.config_checks import MODEL_TYPES, check_args
from deepinfer_engine.model.config_schema import config_error, read_fields, write_fields
from deepinfer_engine.model.layer_plan import LayerPlan, build_layer_plans

__all__ = ["LayerPlan", "ModelArgs", "RopeScaling"]

Arch = Literal["v4", "v41"]
_fail = config_error


# --------------------------------------------------------------------------------------------------
# Value dataclasses


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """YaRN scaling of the compressed layers' RoPE (docs/model.md §2); no mscale (cos/sin unit magnitude)."""

    type: Literal["yarn"] = "yarn"
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.type != "yarn":
            raise _fail("rope_scaling.type", self.type, "'yarn' (the only scaling V4/V4.1 use)")
        if not (isinstance(self.factor, (int, float)) and self.factor >= 1):
            raise _fail("rope_scaling.factor", self.factor, "a number >= 1")
        if not (isinstance(self.beta_fast, (int, float)) and isinstance(self.beta_slow, (int, float))):
            raise _fail("rope_scaling.beta_fast/beta_slow", (self.beta_fast, self.beta_slow), "numbers")
        if not (self.beta_fast > self.beta_slow > 0):
            raise _fail(
                "rope_scaling.beta_fast/beta_slow",
                (self.beta_fast, self.beta_slow),
                "beta_fast > beta_slow > 0",
            )
        if not (
            isinstance(self.original_max_position_embeddings, int)
            and self.original_max_position_embeddings > 0
        ):
            raise _fail(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                "a positive integer",
            )

    def to_dict(self, arch: Arch) -> dict[str, Any]:
        # V4-Flash writes "type", the V4.1 text_config writes "rope_type" (both configs as released).
        key = "type" if arch == "v4" else "rope_type"
        return {
            key: self.type,
            "factor": self.factor,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Validated model configuration. Build it with `from_config_dict` / `from_file` / `from_checkpoint_dir`."""

    arch: Arch
    model_type: str
    # --- core geometry
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    # --- MoE
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 0
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    # --- norms, RoPE
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    # --- attention layout
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    kv_source_layer_ids: tuple[int, ...] = ()  # V4.1
    index_source_layer_ids: tuple[int, ...] = ()  # V4.1
    candidate_source_layer_id: int | None = None  # V4.1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # --- mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram (V4.1)
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    # --- MTP / DSpark
    num_nextn_predict_layers: int = 0
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    # --- tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool = False
    # --- quantization (V4: quantization_config + top-level expert_dtype; V4.1: all in quantization_config)
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"  # "ue8m0": E8M0 scales; None: float32 scales (V4-Flash-Base)
    expert_dtype: Literal["fp4", "fp8"] = "fp4"
    # --- vision tower (V4.1); only its presence matters here (adds ffn.gate.bias_vl); tower tensors are not
    # part of the inventory (their names are unverified, docs/checkpoint.md §6.5).
    vision_config: tuple[tuple[str, Any], ...] | None = None

    layer_plans: tuple[LayerPlan, ...] = field(init=False, repr=False, compare=False)

    # ----------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # checked here, not in config_checks: RopeScaling lives in this module, which imports config_checks
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise config_error("rope_scaling", self.rope_scaling, "a RopeScaling or None")
        check_args(self)
        object.__setattr__(self, "layer_plans", build_layer_plans(self))

    # ----------------------------------------------------------------------------------------------
    # derived properties
    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size is not None

    @property
    def num_draft_layers(self) -> int:
        """MTP blocks (V4-Flash) or DSpark stages (V4-Flash-0731, V4.1): entries of compress_ratios after the backbone."""
        return len(self.dspark_target_layer_ids) if self.has_dspark else self.num_nextn_predict_layers

    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_draft_layers

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None and dict(self.vision_config).get("num_hidden_layers", 0) > 0

    @property
    def has_gate_bias_vl(self) -> bool:
        """V4.1 vision checkpoints carry ffn.gate.bias_vl on every backbone layer (image-token routing, docs/model.md §C.5).

        Present when the config has an image_token_id and a vision_config (even one with 0 tower layers, as the
        tiny preset), so image routing is exercised without a vision tower. DSpark stages have none [I].
        """
        return self.arch == "v41" and self.image_token_id is not None and self.vision_config is not None

    @property
    def has_hc_head(self) -> bool:
        """V4 has learned hc_head_* (final and per MTP/DSpark head); V4.1 collapses with the last pre-mix."""
        return self.arch == "v4"

    @property
    def uses_delayed_mhc(self) -> bool:
        return self.arch == "v41"

    @property
    def q_head_norm(self) -> bool:
        """V4 applies an unweighted per-head RMSNorm to q after wq_b; V4.1 does not (docs/model.md §C.1)."""
        return self.arch == "v4"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:
        """Width of the mHC mixing vector: (2 + hc_mult) * hc_mult (24 for hc_mult 4)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_num_ngram_heads(self) -> int:
        """Hash lookups per token per engram layer: (max_ngram - 1) * n_heads (24 for V4.1-Flash)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads if self.engram_layer_ids else 0

    @property
    def dspark_n_experts(self) -> int:
        return (
            self.dspark_n_routed_experts
            if self.dspark_n_routed_experts is not None
            else self.n_routed_experts
        )

    @property
    def dspark_top_k(self) -> int:
        return (
            self.dspark_num_experts_per_tok
            if self.dspark_num_experts_per_tok is not None
            else self.num_experts_per_tok
        )

    @property
    def draft_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers, self.num_layers_total))

    def plan(self, layer_id: int) -> LayerPlan:
        return self.layer_plans[layer_id]

    # ----------------------------------------------------------------------------------------------
    # construction
    @classmethod
    def from_config_dict(cls, d: Mapping[str, Any]) -> ModelArgs:
        """Parse an HF `config.json` dict (V4 flat, V4.1 nested `text_config`)."""
        return _parse(d)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ModelConfigError(f"cannot read config file {str(path)!r}: {exc}") from exc
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ModelConfigError(
                f"config file {str(path)!r}: found a JSON {type(d).__name__}; expected an object"
            )
        return cls.from_config_dict(d)

    @classmethod
    def from_checkpoint_dir(cls, directory: str | Path) -> ModelArgs:
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in checkpoint directory {str(directory)!r}")
        return cls.from_file(path)

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_config_dict(self) -> dict[str, Any]:
        """The HF `config.json` this would be parsed from (V4 flat, V4.1 nested), as the writer stores it."""
        return _to_config_dict(self)


# --------------------------------------------------------------------------------------------------
# parsing and serialization (fields from the schema table; nested objects here)


def _parse_rope_scaling(d: Mapping[str, Any], prefix: str) -> RopeScaling | None:
    rs = d.get("rope_scaling")
    if rs is None:
        return None
    name = f"{prefix}rope_scaling"
    if not isinstance(rs, Mapping):
        raise _fail(name, rs, "an object {type: yarn, factor, beta_fast, beta_slow, ...}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise _fail(f"{name}.type", kind, "'yarn'")
    missing = [k for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings") if k not in rs]
    if missing:
        raise ModelConfigError(
            f"config field '{name}' lacks {missing}; expected factor, beta_fast, beta_slow, "
            "original_max_position_embeddings"
        )
    if rs.get("mscale") not in (None, 0, 1) or rs.get("mscale_all_dim") not in (None, 0, 1):
        # V4/V4.1 apply no YaRN magnitude scaling (docs/model.md §2); a config asking for it is not ours.
        raise _fail(f"{name}.mscale", rs.get("mscale"), "absent (no YaRN mscale in V4/V4.1)")
    try:
        return RopeScaling(type="yarn", factor=rs["factor"], beta_fast=rs["beta_fast"], beta_slow=rs["beta_slow"],
                           original_max_position_embeddings=rs["original_max_position_embeddings"])
    except ModelConfigError as exc:
        raise ModelConfigError(f"{exc} (in '{name}')") from None


def _object(d: Mapping[str, Any], key: str, what: str) -> Mapping[str, Any] | None:
    v = d.get(key)
    if v is not None and not isinstance(v, Mapping):
        raise _fail(key, v, what)
    return v


def _parse(d: Mapping[str, Any]) -> ModelArgs:
    if not isinstance(d, Mapping):
        raise ModelConfigError(f"config: found a {type(d).__name__}; expected a JSON object")
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail("model_type", model_type, f"one of {sorted(MODEL_TYPES)}")
    arch: Arch = MODEL_TYPES[model_type]  # type: ignore[assignment]
    if arch == "v41":
        text = _object(d, "text_config", "an object holding the text model fields (model_type deepseek_v41)")
        if text is None:
            raise _fail("text_config", None, "an object holding the text model fields (model_type deepseek_v41)")
        text_prefix = "text_config."
    else:
        text, text_prefix = d, ""
    quant = _object(d, "quantization_config", "an object") or {}
    vision = _object(d, "vision_config", "an object")
    kw = read_fields(arch, {"text": (text, text_prefix), "top": (d, ""), "quant": (quant, "quantization_config.")})
    # expert_dtype: V4 writes it at the top level, V4.1 inside quantization_config; each reads the other too
    homes = (d, quant) if arch == "v4" else (quant, d)
    kw["expert_dtype"] = next((h["expert_dtype"] for h in homes if h.get("expert_dtype") is not None), "fp4")
    return ModelArgs(arch=arch, model_type=model_type, rope_scaling=_parse_rope_scaling(text, text_prefix),
                     vision_config=None if vision is None else tuple(sorted(vision.items())), **kw)


def _to_config_dict(a: ModelArgs) -> dict[str, Any]:
    text = write_fields(a, section="text")
    text["attention_bias"] = False
    if a.rope_scaling is not None:
        text["rope_scaling"] = a.rope_scaling.to_dict(a.arch)
    quant: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic", **write_fields(a, section="quant")}
    top = write_fields(a, section="top")
    if a.arch == "v4":
        quant["fmt"] = "e4m3"
        return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
                **top, "expert_dtype": a.expert_dtype, **text, "quantization_config": quant}
    quant["expert_dtype"] = a.expert_dtype
    out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16", **top,
           "quantization_config": quant, "text_config": {"model_type": "deepseek_v41_text", **text}}
    if a.vision_config is not None:
        out["vision_config"] = dict(a.vision_config)
    return out
