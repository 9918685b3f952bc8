"""`ModelArgs`: a checkpoint's `config.json` (DeepSeek-V4-Flash, V4-Flash-0731, V4.1-Flash) parsed and validated.

Pure Python (no torch). Field names are the HF `config.json` names; `arch` says which architecture applies
(`"v4"`: architecture.md Part A/B, `"v41"`: Part C). The per-layer plan (`layer_plans`) is derived once here
and is the one place the model, the cache layout and the checkpoint inventory read layer kinds from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deepinfer_engine.errors import ModelConfigError

__all__ = ["LayerPlan", "ModelArgs", "RopeScaling"]

Arch = Literal["v4", "v41"]
LayerKind = Literal["swa", "csa", "hca", "csa2"]
LayerMode = Literal["swa", "full", "reuse", "reindex"]

_MODEL_TYPES: dict[str, Arch] = {"deepseek_v4": "v4", "deepseek_v41": "v41"}
_MISSING = object()


def _fail(field_name: str, found: object, expected: str) -> ModelConfigError:
    return ModelConfigError(f"config field '{field_name}': found {found!r}; expected {expected}")


# --------------------------------------------------------------------------------------------------
# Value dataclasses


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """YaRN scaling of the compressed layers' RoPE (architecture.md §2); no mscale (cos/sin unit magnitude)."""

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
class LayerPlan:
    """What one layer (backbone or MTP/DSpark draft layer) contains and which caches it reads.

    kind: V4 ``swa`` (ratio 0) / ``csa`` (ratio 4: overlapping compressor + own indexer) / ``hca`` (other
    ratio > 0: compressor, no indexer); V4.1 ``swa`` / ``csa2`` (ratio 1 or 2).
    mode: ``swa``; ``full`` (own compressed cache; V4.1: kv source with its own indexer); ``reuse`` (V4.1: reads
    the compressed cache of ``kv_source`` and the top-k of ``index_source``); ``reindex`` (V4.1: own indexer-Q
    over the keys of ``kv_source``).
    """

    layer_id: int
    ratio: int
    kind: LayerKind
    mode: LayerMode
    kv_source: int | None  # layer whose compressed KV cache this layer attends to (None: SWA only)
    index_source: int | None  # layer whose top-k selection this layer uses (None: no indexer / dense HCA)
    has_compressor: bool  # owns attn.compressor.* (writes a compressed cache)
    has_indexer_k: bool  # produces indexer keys (V4: attn.indexer.compressor.*, V4.1: attn.indexer.wk/k_norm)
    has_indexer_q: bool  # owns attn.indexer.wq_b / weights_proj (runs a top-k)
    publishes_candidates: bool  # V4.1 candidate source: publishes top candidate blocks
    consumes_candidates: bool  # V4.1 index source after the candidate source: top-k restricted to them
    rope_theta: float
    use_yarn: bool
    is_hash_layer: bool  # V4: experts routed by ffn.gate.tid2eid[token id]
    has_engram: bool
    is_draft: bool  # MTP (V4) / DSpark stage; checkpoint prefix mtp.{layer_id - num_hidden_layers}.
    # Additions beyond contracts.md §1 (derived, for convenience of the inventory and the model):
    prefix: str = ""  # checkpoint name prefix, "layers.{l}." or "mtp.{k}."
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0


# --------------------------------------------------------------------------------------------------
# ModelArgs


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
    # part of the inventory (their names are [I] in architecture.md §6.5).
    vision_config: tuple[tuple[str, Any], ...] | None = None

    layer_plans: tuple[LayerPlan, ...] = field(init=False, repr=False, compare=False)

    # ----------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "layer_plans", _build_plans(self))

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
        """V4.1 vision checkpoints carry ffn.gate.bias_vl on every backbone layer (image-token routing, §C.5).

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
        """V4 applies an unweighted per-head RMSNorm to q after wq_b; V4.1 does not (architecture.md §C.1)."""
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
# parsing


class _Reader:
    """Typed access to one config dict; errors name the field with its path (e.g. `text_config.hidden_size`)."""

    def __init__(self, d: Mapping[str, Any], prefix: str) -> None:
        self.d = d
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return key in self.d and self.d[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.d or self.d[key] is None:
            if default is _MISSING:
                raise ModelConfigError(f"config field '{self.name(key)}' is missing; it is required")
            return default
        return self.d[key]

    def int(self, key: str, default: Any = _MISSING, *, minimum: int | None = None) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise _fail(self.name(key), v, "an integer")
        if minimum is not None and v < minimum:
            raise _fail(self.name(key), v, f"an integer >= {minimum}")
        return v

    def float(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _fail(self.name(key), v, "a number")
        return float(v)

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise _fail(self.name(key), v, "true or false")
        return v

    def str(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, str):
            raise _fail(self.name(key), v, "a string")
        return v

    def ints(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise _fail(self.name(key), v, "a list of integers")
        return tuple(v)


def _parse_rope_scaling(r: _Reader) -> RopeScaling | None:
    if not r.has("rope_scaling"):
        return None
    rs = r.raw("rope_scaling")
    if not isinstance(rs, Mapping):
        raise _fail(r.name("rope_scaling"), rs, "an object {type: yarn, factor, beta_fast, beta_slow, ...}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise _fail(r.name("rope_scaling.type"), kind, "'yarn'")
    missing = [
        k for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings") if k not in rs
    ]
    if missing:
        raise ModelConfigError(
            f"config field '{r.name('rope_scaling')}' lacks {missing}; expected factor, beta_fast, beta_slow, "
            "original_max_position_embeddings"
        )
    if rs.get("mscale") not in (None, 0, 0.0, 1, 1.0) or rs.get("mscale_all_dim") not in (
        None,
        0,
        0.0,
        1,
        1.0,
    ):
        # V4/V4.1 apply no YaRN magnitude scaling (architecture.md §2); a config asking for it is not ours.
        raise _fail(r.name("rope_scaling.mscale"), rs.get("mscale"), "absent (no YaRN mscale in V4/V4.1)")
    try:
        return RopeScaling(
            type="yarn",
            factor=rs["factor"],
            beta_fast=rs["beta_fast"],
            beta_slow=rs["beta_slow"],
            original_max_position_embeddings=rs["original_max_position_embeddings"],
        )
    except ModelConfigError as exc:
        raise ModelConfigError(f"{exc} (in '{r.name('rope_scaling')}')") from None


def _parse(d: Mapping[str, Any]) -> ModelArgs:
    if not isinstance(d, Mapping):
        raise ModelConfigError(f"config: found a {type(d).__name__}; expected a JSON object")
    model_type = d.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise _fail("model_type", model_type, f"one of {sorted(_MODEL_TYPES)}")
    arch = _MODEL_TYPES[model_type]
    top = _Reader(d, "")
    if arch == "v41":
        tc = d.get("text_config")
        if not isinstance(tc, Mapping):
            raise _fail(
                "text_config", tc, "an object holding the text model fields (model_type deepseek_v41)"
            )
        r = _Reader(tc, "text_config.")
    else:
        r = top

    qc = d.get("quantization_config")
    if qc is not None and not isinstance(qc, Mapping):
        raise _fail("quantization_config", qc, "an object")
    q = _Reader(qc or {}, "quantization_config.")
    default_block = (128, 128) if arch == "v4" else (32, 32)
    block = q.ints("weight_block_size", default_block)
    if len(block) != 2 or block[0] < 1 or block[1] < 1:
        raise _fail(
            "quantization_config.weight_block_size", list(block), "two positive integers [b_out, b_in]"
        )
    scale_fmt = q.str("scale_fmt", None)
    if arch == "v41":
        expert_dtype = q.str("expert_dtype", top.str("expert_dtype", "fp4"))
    else:
        expert_dtype = top.str("expert_dtype", q.str("expert_dtype", "fp4"))

    vision = d.get("vision_config")
    if vision is not None and not isinstance(vision, Mapping):
        raise _fail("vision_config", vision, "an object")

    kw: dict[str, Any] = dict(
        arch=arch,
        model_type=model_type,
        vocab_size=r.int("vocab_size", minimum=1),
        hidden_size=r.int("hidden_size", minimum=1),
        num_hidden_layers=r.int("num_hidden_layers", minimum=1),
        num_attention_heads=r.int("num_attention_heads", minimum=1),
        num_key_value_heads=r.int("num_key_value_heads", 1),
        head_dim=r.int("head_dim", minimum=1),
        qk_rope_head_dim=r.int("qk_rope_head_dim", minimum=2),
        q_lora_rank=r.int("q_lora_rank", minimum=1),
        o_lora_rank=r.int("o_lora_rank", minimum=1),
        o_groups=r.int("o_groups", minimum=1),
        moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
        n_routed_experts=r.int("n_routed_experts", minimum=1),
        n_shared_experts=r.int("n_shared_experts", 1, minimum=0),
        num_experts_per_tok=r.int("num_experts_per_tok", minimum=1),
        scoring_func=r.str("scoring_func", "sqrtsoftplus"),
        topk_method=r.str("topk_method", "noaux_tc"),
        norm_topk_prob=r.bool("norm_topk_prob", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.5),
        num_hash_layers=r.int("num_hash_layers", 0, minimum=0),
        hidden_act=r.str("hidden_act", "silu"),
        swiglu_limit=r.float("swiglu_limit", 10.0),
        rms_norm_eps=r.float("rms_norm_eps"),
        max_position_embeddings=r.int("max_position_embeddings", minimum=1),
        rope_theta=r.float("rope_theta"),
        compress_rope_theta=r.float("compress_rope_theta"),
        rope_scaling=_parse_rope_scaling(r),
        sliding_window=r.int("sliding_window", minimum=1),
        compress_ratios=r.ints("compress_ratios"),
        index_n_heads=r.int("index_n_heads", minimum=1),
        index_head_dim=r.int("index_head_dim", minimum=1),
        index_topk=r.int("index_topk", minimum=1),
        hc_mult=r.int("hc_mult", 4, minimum=1),
        hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", 20, minimum=1),
        hc_eps=r.float("hc_eps", 1e-6),
        num_nextn_predict_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        bos_token_id=top.int("bos_token_id", r.int("bos_token_id", 0)),
        eos_token_id=top.int("eos_token_id", r.int("eos_token_id", 1)),
        pad_token_id=top.int("pad_token_id", r.int("pad_token_id", None)),
        image_token_id=top.int("image_token_id", r.int("image_token_id", None)),
        tie_word_embeddings=r.bool("tie_word_embeddings", top.bool("tie_word_embeddings", False)),
        weight_block_size=(block[0], block[1]),
        scale_fmt=scale_fmt,
        expert_dtype=expert_dtype,
        vision_config=None if vision is None else tuple(sorted(vision.items())),
    )
    if arch == "v41":
        kw.update(
            kv_source_layer_ids=r.ints("kv_source_layer_ids"),
            index_source_layer_ids=r.ints("index_source_layer_ids"),
            candidate_source_layer_id=r.int("candidate_source_layer_id", None),
            candidate_topk_blocks=r.int("candidate_topk_blocks", 0, minimum=0),
            candidate_block_size=r.int("candidate_block_size", 0, minimum=0),
        )
        if r.has("engram_layer_ids") and r.raw("engram_layer_ids"):
            kw.update(
                engram_layer_ids=r.ints("engram_layer_ids"),
                engram_num_embeddings=r.ints("engram_num_embeddings"),
                engram_max_ngram_size=r.int("engram_max_ngram_size", minimum=2),
                engram_vocab_size=r.int("engram_vocab_size", minimum=2),
                engram_n_heads=r.int("engram_n_heads", minimum=1),
                engram_head_dim=r.int("engram_head_dim", minimum=1),
                engram_pad_token_id=r.int("engram_pad_token_id", 2, minimum=0),
                engram_compressed_vocab_size=r.int("engram_compressed_vocab_size", minimum=1),
            )
    else:
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            if r.has(key) and r.raw(key):
                raise _fail(key, r.raw(key), "absent for model_type deepseek_v4 (a V4.1-only field)")
    if r.has("dspark_block_size"):
        kw.update(
            dspark_block_size=r.int("dspark_block_size", minimum=1),
            dspark_noise_token_id=r.int("dspark_noise_token_id", minimum=0),
            dspark_target_layer_ids=r.ints("dspark_target_layer_ids"),
            dspark_markov_rank=r.int("dspark_markov_rank", minimum=1),
            dspark_n_routed_experts=r.int("dspark_n_routed_experts", None),
            dspark_num_experts_per_tok=r.int("dspark_num_experts_per_tok", None),
        )
    return ModelArgs(**kw)


# --------------------------------------------------------------------------------------------------
# validation


def _check_ids(name: str, ids: tuple[int, ...], upper: int, what: str) -> None:
    if any(i < 0 or i >= upper for i in ids):
        raise _fail(name, list(ids), f"{what} in [0, {upper})")
    if list(ids) != sorted(set(ids)):
        raise _fail(name, list(ids), "strictly increasing layer ids (sorted, no duplicates)")


def _validate(a: ModelArgs) -> None:  # noqa: C901 - one flat list of checks reads best
    if a.arch not in ("v4", "v41"):
        raise _fail("arch", a.arch, "'v4' or 'v41'")
    if _MODEL_TYPES.get(a.model_type) != a.arch:
        raise _fail("model_type", a.model_type, f"the model_type of arch {a.arch!r}")
    for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "max_position_embeddings",
    ):  # fmt: skip
        v = getattr(a, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _fail(name, v, "a positive integer")
    if a.num_key_value_heads != 1:
        raise _fail("num_key_value_heads", a.num_key_value_heads, "1 (one shared K=V head)")
    if not (0 < a.qk_rope_head_dim < a.head_dim) or a.qk_rope_head_dim % 2:
        raise _fail("qk_rope_head_dim", a.qk_rope_head_dim, f"an even number below head_dim={a.head_dim}")
    if not a.index_head_dim > a.qk_rope_head_dim:
        raise _fail("index_head_dim", a.index_head_dim, f"> qk_rope_head_dim={a.qk_rope_head_dim}")
    if a.num_attention_heads % a.o_groups:
        raise _fail("o_groups", a.o_groups, f"a divisor of num_attention_heads={a.num_attention_heads}")
    if a.num_experts_per_tok > a.n_routed_experts:
        raise _fail("num_experts_per_tok", a.num_experts_per_tok, f"<= n_routed_experts={a.n_routed_experts}")
    if a.scoring_func != "sqrtsoftplus":
        raise _fail("scoring_func", a.scoring_func, "'sqrtsoftplus'")
    if a.hidden_act != "silu":
        raise _fail("hidden_act", a.hidden_act, "'silu'")
    if not (a.rms_norm_eps > 0 and math.isfinite(a.rms_norm_eps)):
        raise _fail("rms_norm_eps", a.rms_norm_eps, "a positive number")
    if not (a.rope_theta > 0 and a.compress_rope_theta > 0):
        raise _fail(
            "rope_theta/compress_rope_theta", (a.rope_theta, a.compress_rope_theta), "positive numbers"
        )
    if a.rope_scaling is not None and not isinstance(a.rope_scaling, RopeScaling):
        raise _fail("rope_scaling", a.rope_scaling, "a RopeScaling or None")
    if a.expert_dtype not in ("fp4", "fp8"):
        raise _fail("expert_dtype", a.expert_dtype, "'fp4' or 'fp8'")
    if a.scale_fmt not in ("ue8m0", None):
        raise _fail("quantization_config.scale_fmt", a.scale_fmt, "'ue8m0' or absent (float32 scales)")
    if len(a.weight_block_size) != 2 or min(a.weight_block_size) < 1:
        raise _fail("quantization_config.weight_block_size", a.weight_block_size, "two positive integers")
    if a.hc_dim <= 0:
        raise _fail("hc_mult", a.hc_mult, "a positive integer")

    L = a.num_hidden_layers
    # --- draft layers and compress_ratios
    if a.has_dspark:
        if a.dspark_block_size is None or a.dspark_block_size < 1:
            raise _fail("dspark_block_size", a.dspark_block_size, "a positive integer")
        if not a.dspark_target_layer_ids:
            raise _fail(
                "dspark_target_layer_ids", list(a.dspark_target_layer_ids), "a non-empty list of layer ids"
            )
        _check_ids("dspark_target_layer_ids", a.dspark_target_layer_ids, L, "backbone layer ids")
        if a.dspark_noise_token_id is None or not 0 <= a.dspark_noise_token_id < a.vocab_size:
            raise _fail(
                "dspark_noise_token_id", a.dspark_noise_token_id, f"a token id in [0, {a.vocab_size})"
            )
        if a.dspark_markov_rank is None or a.dspark_markov_rank < 1:
            raise _fail("dspark_markov_rank", a.dspark_markov_rank, "a positive integer")
        if a.dspark_n_routed_experts is not None and a.dspark_n_routed_experts < 1:
            raise _fail("dspark_n_routed_experts", a.dspark_n_routed_experts, "a positive integer")
        if not 1 <= a.dspark_top_k <= a.dspark_n_experts:
            raise _fail(
                "dspark_num_experts_per_tok", a.dspark_num_experts_per_tok, f"in [1, {a.dspark_n_experts}]"
            )
        if a.arch == "v41" and a.num_nextn_predict_layers != len(a.dspark_target_layer_ids):
            # V4.1 counts its DSpark stages in num_nextn_predict_layers (3); V4-Flash-0731 left it at 1.
            raise _fail(
                "num_nextn_predict_layers",
                a.num_nextn_predict_layers,
                f"{len(a.dspark_target_layer_ids)} (one per DSpark stage = len(dspark_target_layer_ids))",
            )
    elif a.arch == "v41" and a.num_nextn_predict_layers:
        raise _fail("dspark_block_size", None, "present: V4.1 draft layers are DSpark stages")
    expected_len = L + a.num_draft_layers
    ratios = a.compress_ratios
    if not isinstance(ratios, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in ratios):
        raise _fail("compress_ratios", ratios, "a tuple of integers")
    if len(ratios) != expected_len:
        kind = "DSpark stages" if a.has_dspark else "MTP layers"
        raise _fail(
            "compress_ratios",
            f"{len(ratios)} entries",
            f"{expected_len} = num_hidden_layers {L} + {a.num_draft_layers} {kind}",
        )
    for k, r in enumerate(ratios[L:]):
        if r != 0:
            raise _fail(f"compress_ratios[{L + k}]", r, "0 (MTP/DSpark layers are sliding-window only)")
    allowed = "0, 1 or 2" if a.arch == "v41" else "a non-negative integer"
    for l, r in enumerate(ratios[:L]):
        if r < 0 or (a.arch == "v41" and r not in (0, 1, 2)):
            raise _fail(f"compress_ratios[{l}]", r, allowed)
    if a.sliding_window < 1:
        raise _fail("sliding_window", a.sliding_window, "a positive integer")

    # --- hash layers
    if a.arch == "v41" and a.num_hash_layers:
        raise _fail("num_hash_layers", a.num_hash_layers, "0 (V4.1 has no hash routing)")
    if a.num_hash_layers > L:
        raise _fail("num_hash_layers", a.num_hash_layers, f"<= num_hidden_layers={L}")

    # --- V4.1 source lists
    if a.arch == "v41":
        compressed = [l for l in range(L) if ratios[l] > 0]
        _check_ids("kv_source_layer_ids", a.kv_source_layer_ids, L, "backbone layer ids")
        _check_ids("index_source_layer_ids", a.index_source_layer_ids, L, "backbone layer ids")
        bad = [s for s in a.kv_source_layer_ids if ratios[s] == 0]
        if bad:
            raise _fail(
                "kv_source_layer_ids",
                list(a.kv_source_layer_ids),
                f"layers with ratio > 0 (ratio 0 at {bad})",
            )
        bad = [s for s in a.index_source_layer_ids if ratios[s] == 0]
        if bad:
            raise _fail(
                "index_source_layer_ids",
                list(a.index_source_layer_ids),
                f"layers with ratio > 0 (ratio 0 at {bad})",
            )
        # A layer reuses the compressed cache of the last kv source at or before it, so a kv source must start
        # every run of compressed layers and every change of ratio (a Reuse layer shares its source's ratio).
        must = [l for l in compressed if l == 0 or ratios[l - 1] != ratios[l]]
        missing = [l for l in must if l not in a.kv_source_layer_ids]
        if missing:
            raise _fail(
                "kv_source_layer_ids",
                list(a.kv_source_layer_ids),
                f"to include every layer where the compress ratio changes {must} (missing {missing})",
            )
        # Between two kv sources (and after the last) all layers must share the source's ratio.
        for l in compressed:
            src = max(s for s in a.kv_source_layer_ids if s <= l)
            if ratios[src] != ratios[l]:
                raise _fail(
                    "kv_source_layer_ids",
                    list(a.kv_source_layer_ids),
                    f"a source for layer {l} with ratio {ratios[l]}",
                )
        # A kv source is also an index source (Full mode: it scores its own keys); otherwise the index
        # source a layer inherits would score keys of a different compressed cache.
        missing = [s for s in a.kv_source_layer_ids if s not in a.index_source_layer_ids]
        if missing:
            raise _fail(
                "index_source_layer_ids",
                list(a.index_source_layer_ids),
                f"to include every kv source layer {list(a.kv_source_layer_ids)} (missing {missing})",
            )
        if a.candidate_source_layer_id is not None:
            if a.candidate_source_layer_id not in a.index_source_layer_ids:
                raise _fail(
                    "candidate_source_layer_id",
                    a.candidate_source_layer_id,
                    f"one of index_source_layer_ids {list(a.index_source_layer_ids)}",
                )
            if a.candidate_block_size < 1 or a.candidate_topk_blocks < 1:
                raise _fail(
                    "candidate_block_size/candidate_topk_blocks",
                    (a.candidate_block_size, a.candidate_topk_blocks),
                    "positive integers when candidate_source_layer_id is set",
                )
        if a.image_token_id is not None and not 0 <= a.image_token_id < a.vocab_size:
            raise _fail("image_token_id", a.image_token_id, f"a token id in [0, {a.vocab_size})")
        _validate_engram(a)
    else:
        if a.kv_source_layer_ids or a.index_source_layer_ids or a.engram_layer_ids:
            raise _fail(
                "kv_source_layer_ids/index_source_layer_ids/engram_layer_ids", "set", "empty for arch v4"
            )
        if a.candidate_source_layer_id is not None:
            raise _fail("candidate_source_layer_id", a.candidate_source_layer_id, "absent for arch v4")


def _validate_engram(a: ModelArgs) -> None:
    if not a.engram_layer_ids:
        return
    L = a.num_hidden_layers
    _check_ids("engram_layer_ids", a.engram_layer_ids, L, "backbone layer ids")
    if len(a.engram_num_embeddings) != len(a.engram_layer_ids):
        raise _fail(
            "engram_num_embeddings",
            list(a.engram_num_embeddings),
            f"{len(a.engram_layer_ids)} entries (one per engram layer {list(a.engram_layer_ids)})",
        )
    for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                 "engram_compressed_vocab_size"):  # fmt: skip
        v = getattr(a, name)
        if not isinstance(v, int) or v < (2 if name in ("engram_max_ngram_size", "engram_vocab_size") else 1):
            raise _fail(name, v, "a positive integer (>= 2 for max_ngram_size / vocab_size)")
    if not 0 <= a.engram_pad_token_id < a.vocab_size:
        raise _fail("engram_pad_token_id", a.engram_pad_token_id, f"a token id in [0, {a.vocab_size})")
    from deepinfer_engine.model.engram_hash import engram_num_embeddings  # numpy only, owned by G

    expected = engram_num_embeddings(
        a.engram_layer_ids, a.engram_max_ngram_size, a.engram_n_heads, a.engram_vocab_size
    )
    if list(a.engram_num_embeddings) != expected:
        raise _fail(
            "engram_num_embeddings",
            list(a.engram_num_embeddings),
            f"{expected} (sums of the hash primes >= engram_vocab_size={a.engram_vocab_size}, "
            "architecture.md §C.6 step 3)",
        )


# --------------------------------------------------------------------------------------------------
# layer plans


def _build_plans(a: ModelArgs) -> tuple[LayerPlan, ...]:
    L = a.num_hidden_layers
    plans: list[LayerPlan] = []
    yarn = a.rope_scaling is not None
    for l, ratio in enumerate(a.compress_ratios):
        is_draft = l >= L
        common: dict[str, Any] = dict(
            layer_id=l,
            ratio=ratio,
            is_hash_layer=(not is_draft) and l < a.num_hash_layers,
            has_engram=l in a.engram_layer_ids,
            is_draft=is_draft,
            prefix=f"mtp.{l - L}." if is_draft else f"layers.{l}.",
            n_routed_experts=a.dspark_n_experts if (is_draft and a.has_dspark) else a.n_routed_experts,
            num_experts_per_tok=a.dspark_top_k if (is_draft and a.has_dspark) else a.num_experts_per_tok,
        )
        if ratio == 0:
            plans.append(
                LayerPlan(
                    kind="swa", mode="swa", kv_source=None, index_source=None, has_compressor=False,
                    has_indexer_k=False, has_indexer_q=False, publishes_candidates=False,
                    consumes_candidates=False, rope_theta=a.rope_theta, use_yarn=False, **common,
                )
            )  # fmt: skip
            continue
        if a.arch == "v4":
            csa = ratio == 4
            plans.append(
                LayerPlan(
                    kind="csa" if csa else "hca", mode="full", kv_source=l, index_source=l if csa else None,
                    has_compressor=True, has_indexer_k=csa, has_indexer_q=csa, publishes_candidates=False,
                    consumes_candidates=False, rope_theta=a.compress_rope_theta, use_yarn=yarn, **common,
                )
            )  # fmt: skip
            continue
        kv_src = max(s for s in a.kv_source_layer_ids if s <= l)
        idx_src = max(s for s in a.index_source_layer_ids if s <= l)
        is_kv = l == kv_src
        is_idx = l == idx_src
        mode: LayerMode = "full" if is_kv else ("reindex" if is_idx else "reuse")
        cand = a.candidate_source_layer_id
        plans.append(
            LayerPlan(
                kind="csa2", mode=mode, kv_source=kv_src, index_source=idx_src, has_compressor=is_kv,
                has_indexer_k=is_kv, has_indexer_q=is_idx, publishes_candidates=cand is not None and l == cand,
                consumes_candidates=cand is not None and is_idx and l > cand,
                rope_theta=a.compress_rope_theta, use_yarn=yarn, **common,
            )
        )  # fmt: skip
    return tuple(plans)


# --------------------------------------------------------------------------------------------------
# serialisation


def _to_config_dict(a: ModelArgs) -> dict[str, Any]:
    text: dict[str, Any] = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "moe_intermediate_size": a.moe_intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "q_lora_rank": a.q_lora_rank,
        "o_lora_rank": a.o_lora_rank,
        "o_groups": a.o_groups,
        "hidden_act": a.hidden_act,
        "swiglu_limit": a.swiglu_limit,
        "rms_norm_eps": a.rms_norm_eps,
        "attention_bias": False,
        "max_position_embeddings": a.max_position_embeddings,
        "rope_theta": a.rope_theta,
        "compress_rope_theta": a.compress_rope_theta,
        "n_routed_experts": a.n_routed_experts,
        "n_shared_experts": a.n_shared_experts,
        "num_experts_per_tok": a.num_experts_per_tok,
        "scoring_func": a.scoring_func,
        "topk_method": a.topk_method,
        "norm_topk_prob": a.norm_topk_prob,
        "routed_scaling_factor": a.routed_scaling_factor,
        "sliding_window": a.sliding_window,
        "compress_ratios": list(a.compress_ratios),
        "index_n_heads": a.index_n_heads,
        "index_head_dim": a.index_head_dim,
        "index_topk": a.index_topk,
        "hc_mult": a.hc_mult,
        "hc_sinkhorn_iters": a.hc_sinkhorn_iters,
        "hc_eps": a.hc_eps,
        "num_nextn_predict_layers": a.num_nextn_predict_layers,
        "tie_word_embeddings": a.tie_word_embeddings,
    }
    if a.rope_scaling is not None:
        text["rope_scaling"] = a.rope_scaling.to_dict(a.arch)
    if a.arch == "v4":
        text["num_hash_layers"] = a.num_hash_layers
    else:
        text["kv_source_layer_ids"] = list(a.kv_source_layer_ids)
        text["index_source_layer_ids"] = list(a.index_source_layer_ids)
        if a.candidate_source_layer_id is not None:
            text["candidate_source_layer_id"] = a.candidate_source_layer_id
            text["candidate_topk_blocks"] = a.candidate_topk_blocks
            text["candidate_block_size"] = a.candidate_block_size
        if a.engram_layer_ids:
            text.update(
                engram_layer_ids=list(a.engram_layer_ids),
                engram_num_embeddings=list(a.engram_num_embeddings),
                engram_max_ngram_size=a.engram_max_ngram_size,
                engram_vocab_size=a.engram_vocab_size,
                engram_n_heads=a.engram_n_heads,
                engram_head_dim=a.engram_head_dim,
                engram_pad_token_id=a.engram_pad_token_id,
                engram_compressed_vocab_size=a.engram_compressed_vocab_size,
            )
    if a.has_dspark:
        text.update(
            dspark_block_size=a.dspark_block_size,
            dspark_noise_token_id=a.dspark_noise_token_id,
            dspark_target_layer_ids=list(a.dspark_target_layer_ids),
            dspark_markov_rank=a.dspark_markov_rank,
        )
        if a.dspark_n_routed_experts is not None:
            text["dspark_n_routed_experts"] = a.dspark_n_routed_experts
        if a.dspark_num_experts_per_tok is not None:
            text["dspark_num_experts_per_tok"] = a.dspark_num_experts_per_tok
    quant: dict[str, Any] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(a.weight_block_size),
    }
    if a.scale_fmt is not None:
        quant["scale_fmt"] = a.scale_fmt
    if a.arch == "v4":
        quant["fmt"] = "e4m3"
        out = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "torch_dtype": "bfloat16",
            "bos_token_id": a.bos_token_id,
            "eos_token_id": a.eos_token_id,
            "expert_dtype": a.expert_dtype,
            **text,
            "quantization_config": quant,
        }
        if a.pad_token_id is not None:
            out["pad_token_id"] = a.pad_token_id
        return out
    quant["expert_dtype"] = a.expert_dtype
    text = {"model_type": "deepseek_v41_text", **text}
    out = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": a.bos_token_id,
        "eos_token_id": a.eos_token_id,
        "quantization_config": quant,
        "text_config": text,
    }
    if a.pad_token_id is not None:
        out["pad_token_id"] = a.pad_token_id
    if a.image_token_id is not None:
        out["image_token_id"] = a.image_token_id
    if a.vision_config is not None:
        out["vision_config"] = dict(a.vision_config)
    return out
