"""The one table of `config.json` fields behind `ModelArgs`: where each lives, its type, default and bounds.

Parsing (`read_fields`) and serialization (`write_fields`) are generated from `FIELDS`; per-field type and bound
errors come from here, cross-field rules from `config_checks`. Layout of the file (docs/model.md §1): V4 is flat;
V4.1 keeps the text model's fields in `text_config` and ids / quantization at the top level. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer_engine.errors import ModelConfigError

__all__ = ["FIELDS", "ConfigField", "REQUIRED", "config_error", "read_fields", "write_fields"]

Arch = Literal["v4", "v41"]
Kind = Literal["int", "float", "bool", "str", "ints"]
# "text": the text model's object (V4: the file itself, V4.1: `text_config`); "top": the file's top level;
# "quant": `quantization_config`.
Section = Literal["text", "top", "quant"]
# Optional groups: all of a group's fields are read when its `trigger` field is present (and non-empty).
Group = Literal["candidate", "engram", "dspark"]

REQUIRED: Any = object()
BOTH: tuple[Arch, ...] = ("v4", "v41")


def config_error(name: str, found: object, expected: str) -> ModelConfigError:
    return ModelConfigError(f"config field '{name}': found {found!r}; expected {expected}")


@dataclass(frozen=True, kw_only=True)
class ConfigField:
    """One `ModelArgs` field = one `config.json` key.

    `section` is where it is written; `also` lists sections it may be read from when absent there (releases
    disagree on the place of ids and `expert_dtype`). `default` REQUIRED: a missing key is an error; a callable
    default takes the arch. `minimum` bounds ints (each element for `ints`). `archs`: the architectures whose
    file has the field (read and written only there). `group`: read and written only when the group is present.
    """

    name: str
    kind: Kind
    section: Section
    archs: tuple[Arch, ...] = BOTH
    default: Any = REQUIRED
    minimum: int | None = None
    also: tuple[Section, ...] = ()
    group: Group | None = None

    def default_for(self, arch: Arch) -> Any:
        return self.default(arch) if callable(self.default) else self.default


def _f(name: str, kind: Kind, section: Section = "text", **kw: Any) -> ConfigField:
    return ConfigField(name=name, kind=kind, section=section, **kw)


def _expert_dtype_home(arch: Arch) -> Section:
    return "top" if arch == "v4" else "quant"


FIELDS: tuple[ConfigField, ...] = (
    # --- core geometry
    _f("vocab_size", "int", minimum=1),
    _f("hidden_size", "int", minimum=1),
    _f("num_hidden_layers", "int", minimum=1),
    _f("num_attention_heads", "int", minimum=1),
    _f("num_key_value_heads", "int", default=1, minimum=1),
    _f("head_dim", "int", minimum=1),
    _f("qk_rope_head_dim", "int", minimum=2),
    _f("q_lora_rank", "int", minimum=1),
    _f("o_lora_rank", "int", minimum=1),
    _f("o_groups", "int", minimum=1),
    # --- MoE
    _f("moe_intermediate_size", "int", minimum=1),
    _f("n_routed_experts", "int", minimum=1),
    _f("n_shared_experts", "int", default=1, minimum=0),
    _f("num_experts_per_tok", "int", minimum=1),
    _f("scoring_func", "str", default="sqrtsoftplus"),
    _f("topk_method", "str", default="noaux_tc"),
    _f("norm_topk_prob", "bool", default=True),
    _f("routed_scaling_factor", "float", default=1.5),
    _f("num_hash_layers", "int", archs=("v4",), default=0, minimum=0),
    _f("hidden_act", "str", default="silu"),
    _f("swiglu_limit", "float", default=10.0),
    # --- norms, RoPE (rope_scaling is a nested object: parsed by args.py)
    _f("rms_norm_eps", "float"),
    _f("max_position_embeddings", "int", minimum=1),
    _f("rope_theta", "float"),
    _f("compress_rope_theta", "float"),
    # --- attention layout
    _f("sliding_window", "int", minimum=1),
    _f("compress_ratios", "ints", minimum=0),
    _f("index_n_heads", "int", minimum=1),
    _f("index_head_dim", "int", minimum=1),
    _f("index_topk", "int", minimum=1),
    _f("kv_source_layer_ids", "ints", archs=("v41",), minimum=0),
    _f("index_source_layer_ids", "ints", archs=("v41",), minimum=0),
    _f("candidate_source_layer_id", "int", archs=("v41",), group="candidate", minimum=0),
    _f("candidate_topk_blocks", "int", archs=("v41",), group="candidate", minimum=1),
    _f("candidate_block_size", "int", archs=("v41",), group="candidate", minimum=1),
    # --- mHC
    _f("hc_mult", "int", default=4, minimum=1),
    _f("hc_sinkhorn_iters", "int", default=20, minimum=1),
    _f("hc_eps", "float", default=1e-6),
    # --- Engram (V4.1)
    _f("engram_layer_ids", "ints", archs=("v41",), group="engram", minimum=0),
    _f("engram_num_embeddings", "ints", archs=("v41",), group="engram", minimum=1),
    _f("engram_max_ngram_size", "int", archs=("v41",), group="engram", minimum=2),
    _f("engram_vocab_size", "int", archs=("v41",), group="engram", minimum=2),
    _f("engram_n_heads", "int", archs=("v41",), group="engram", minimum=1),
    _f("engram_head_dim", "int", archs=("v41",), group="engram", minimum=1),
    _f("engram_pad_token_id", "int", archs=("v41",), group="engram", default=2, minimum=0),
    _f("engram_compressed_vocab_size", "int", archs=("v41",), group="engram", minimum=1),
    # --- MTP / DSpark
    _f("num_nextn_predict_layers", "int", default=0, minimum=0),
    _f("dspark_block_size", "int", group="dspark", minimum=1),
    _f("dspark_noise_token_id", "int", group="dspark", minimum=0),
    _f("dspark_target_layer_ids", "ints", group="dspark", minimum=0),
    _f("dspark_markov_rank", "int", group="dspark", minimum=1),
    _f("dspark_n_routed_experts", "int", group="dspark", default=None, minimum=1),
    _f("dspark_num_experts_per_tok", "int", group="dspark", default=None, minimum=1),
    # --- tokens (top level in both releases; some ports put them into text_config)
    _f("bos_token_id", "int", "top", default=0, minimum=0, also=("text",)),
    _f("eos_token_id", "int", "top", default=1, minimum=0, also=("text",)),
    _f("pad_token_id", "int", "top", default=None, minimum=0, also=("text",)),
    _f("image_token_id", "int", "top", archs=("v41",), default=None, minimum=0, also=("text",)),
    _f("tie_word_embeddings", "bool", default=False, also=("top",)),
    # --- quantization
    _f("weight_block_size", "ints", "quant", default=lambda arch: (128, 128) if arch == "v4" else (32, 32),
       minimum=1),
    _f("scale_fmt", "str", "quant", default=None),
)

# the field whose presence turns a group on
GROUP_TRIGGER: dict[str, str] = {
    "candidate": "candidate_source_layer_id",
    "engram": "engram_layer_ids",
    "dspark": "dspark_block_size",
}


def _convert(f: ConfigField, path: str, v: Any) -> Any:
    if f.kind == "int":
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise config_error(path, v, "an integer")
        if f.minimum is not None and v < f.minimum:
            raise config_error(path, v, f"an integer >= {f.minimum}")
        return v
    if f.kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise config_error(path, v, "a number")
        return float(v)
    if f.kind == "bool":
        if not isinstance(v, bool):
            raise config_error(path, v, "true or false")
        return v
    if f.kind == "str":
        if not isinstance(v, str):
            raise config_error(path, v, "a string")
        return v
    if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise config_error(path, v, "a list of integers")
    if f.minimum is not None and any(x < f.minimum for x in v):
        raise config_error(path, list(v), f"integers >= {f.minimum}")
    return tuple(v)


def read_fields(arch: Arch, sections: Mapping[Section, tuple[Mapping[str, Any], str]]) -> dict[str, Any]:
    """Every table field of `arch` from `sections` (section -> (dict, path prefix for messages)), converted and
    bounds-checked. Fields of an absent group are left out (the dataclass defaults apply)."""

    def lookup(f: ConfigField) -> tuple[Any, str]:
        for sec in (f.section, *f.also):
            d, prefix = sections[sec]
            if d.get(f.name) is not None:
                return d[f.name], prefix + f.name
        return None, sections[f.section][1] + f.name

    present = {g: lookup(_by_name[t])[0] not in (None, [], ()) for g, t in GROUP_TRIGGER.items()}
    out: dict[str, Any] = {}
    for f in FIELDS:
        if arch not in f.archs:
            v, path = lookup(f)
            if v not in (None, [], (), 0):
                other = "V4.1" if arch == "v4" else "V4"
                raise config_error(path, v, f"absent (or empty / 0) for model_type {_MODEL_TYPE[arch]} (a "
                                            f"{other}-only field)")
            continue
        if f.group is not None and not present[f.group]:
            continue
        v, path = lookup(f)
        if v is None:
            default = f.default_for(arch)
            if default is REQUIRED:
                raise ModelConfigError(f"config field '{path}' is missing; it is required")
            out[f.name] = default
            continue
        out[f.name] = _convert(f, path, v)
    return out


def write_fields(args: Any, *, section: Section, skip: Callable[[ConfigField], bool] = lambda f: False
                 ) -> dict[str, Any]:
    """The table fields of `args` that live in `section` for its arch, in table order (JSON-ready values).
    Optional fields holding None and fields of absent groups are left out."""
    out: dict[str, Any] = {}
    for f in FIELDS:
        if f.section != section or args.arch not in f.archs or skip(f):
            continue
        v = getattr(args, f.name)
        if f.group is not None and getattr(args, GROUP_TRIGGER[f.group]) in (None, ()):
            continue
        if v is None:
            continue
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


_by_name = {f.name: f for f in FIELDS}
_MODEL_TYPE = {"v4": "deepseek_v4", "v41": "deepseek_v41"}
