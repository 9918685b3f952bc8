"""Engine options: small frozen config dataclasses composed into `EngineConfig`, one flat option namespace.

`LLM(model, **options)`, the CLI (`deepinfer generate --max-num-seqs 8 ...`) and the benchmarks share one
definition: argparse flags are generated from the dataclass fields and their `help` metadata, and an unknown
option name raises `ConfigError` with the closest valid names.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from deepinfer_engine.errors import ConfigError

if TYPE_CHECKING:
    import deepinfer_parallel

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_option_names",
    "parse_bytes",
    "speculative_options",
]


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    model: str | None = _opt(None, "checkpoint directory; default: the embedded tiny random V4.1-Flash checkpoint")
    tokenizer: str | None = _opt(None, "tokenizer.json or its directory (default: the checkpoint's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "compute dtype of weights and caches (auto: bfloat16 on CUDA, float32 on CPU)")
    device: str = _opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1 ...")
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens (default: the model's limit)")
    seed: int = _opt(0, "engine seed: requests without SamplingParams.seed get seeds derived from it")
    num_cpu_threads: int | None = _opt(
        None, "torch intra-op threads when running on CPU (default: 1 for tiny models, whose ops are too small to "
        "gain from threads and lose a lot to thread contention; torch's default otherwise)")
    enforce_eager: bool = _opt(
        False, "run every step eagerly; otherwise decode steps on CUDA replay CUDA graphs captured per padded "
        "batch size and length (docs/cuda_graphs.md)")
    pdl: bool = _opt(
        True, "launch the decode step's FP8 linears, RMSNorms and rope kernels as programmatic dependent launches "
        "(each may start while the previous kernel finishes; CUDA sm_90+ only, ignored elsewhere; same results "
        "either way; docs/pdl.md)")
    side_streams: bool = _opt(
        True, "run independent work of decode-sized CUDA steps on side streams: the shared expert beside the routed "
        "experts, the query projection beside the KV path, the V4.1 mHC mixes beside their sub-layer, the Engram "
        "projection one layer ahead (same results either way; docs/overlap.md)")
    expert_layout: Literal["auto", "checkpoint", "chunked"] = _opt(
        "auto", "in-memory layout of the FP4 routed experts: checkpoint = the stored bytes; chunked = repacked once "
        "at load so the GPU kernels' loads cover whole sectors (CUDA only; docs/moe_fp4_kernel.md); auto = "
        "the measured-faster one for the device")
    prefill_truncation: Literal["off", "compact"] = _opt(
        "off", "decoder truncation in prefill (V4.1): compact runs the layers from the first ratio-1 layer on only "
        "the last prefill_truncation_keep rows of each prompt (fewer FLOPs; an approximation unless keep covers "
        "the bound in docs/prefill_truncation.md); off runs every row through every layer")
    prefill_truncation_keep: int = _opt(
        140, "rows per prompt the decoder layers run on under prefill_truncation=compact (>= sliding window + 6)")

    def __post_init__(self) -> None:
        if self.prefill_truncation not in ("off", "compact"):
            raise ConfigError(f"prefill_truncation: found {self.prefill_truncation!r}, expected off or compact")
        _int_at_least("prefill_truncation_keep", self.prefill_truncation_keep, 1)
        if self.expert_layout not in ("auto", "checkpoint", "chunked"):
            raise ConfigError(f"expert_layout: found {self.expert_layout!r}, expected auto, checkpoint or chunked")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: found {self.dtype!r}, expected auto, float32, bfloat16 or float16")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: found {self.max_model_len}, expected >= 2")
        if self.num_cpu_threads is not None and self.num_cpu_threads < 1:
            raise ConfigError(f"num_cpu_threads: found {self.num_cpu_threads}, expected >= 1")
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"pdl: found {self.pdl!r}, expected True or False")
        if not isinstance(self.side_streams, bool):
            raise ConfigError(f"side_streams: found {self.side_streams!r}, expected True or False")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed: found {self.seed!r}, expected an integer")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    page_size: int | None = _opt(
        None, "tokens per cache page; a multiple of every compress ratio (default: 128, or 16 for tiny models)")
    kv_cache_memory_bytes: int | None = _opt(
        None, "bytes for all caches (e.g. 2GiB); default: gpu_memory_utilization of free CUDA memory, 64MiB on CPU",
        parse=lambda s: parse_bytes(s))
    gpu_memory_utilization: float = _opt(0.9, "fraction of free CUDA memory given to the caches")
    num_kv_pages: int | None = _opt(None, "override the number of cache pages (testing / debugging)")
    # default bfloat16: the deployed formats lose precision against the full-precision cache, and the attention over
    # their records (read in place) is slower than over bf16 rows on the H200 (docs/fidelity.md §5)
    kv_cache_dtype: Literal["auto", "bfloat16"] = _opt(
        "bfloat16", "KV numerics: auto = the checkpoint's deployment record formats (V4.1: FP8 window KV, FP4 "
        "compressed KV and indexer), bfloat16 = full-precision KV in the compute dtype")

    enable_prefix_caching: bool = _opt(
        True, "share full cache pages between requests with a common prefix (content-hashed, LRU; "
        "docs/prefix_cache.md)")
    prefix_replay: Literal["exact", "approximate"] = _opt(
        "exact", "prefix hit resume: exact = at a page boundary with a saved ring state block (outputs equal a "
        "recompute), approximate = replay min(hit, window) tokens with a floored window")
    prefix_cache_host_bytes: int = _opt(
        0, "pinned host memory for evicted cached pages (e.g. 8GiB; 0 = off)", parse=lambda s: parse_bytes(s))
    num_prefix_state_slots: int | None = _opt(
        None, "exact replay: slots holding ring state blocks, charged against the cache budget (default: "
        "max_num_seqs, at most a quarter of kv_cache_memory_bytes)")

    def __post_init__(self) -> None:
        if self.prefix_replay not in ("exact", "approximate"):
            raise ConfigError(f"prefix_replay: found {self.prefix_replay!r}, expected exact or approximate")
        if not isinstance(self.prefix_cache_host_bytes, int) or self.prefix_cache_host_bytes < 0:
            raise ConfigError(f"prefix_cache_host_bytes: found {self.prefix_cache_host_bytes!r}, expected >= 0")
        if self.num_prefix_state_slots is not None and self.num_prefix_state_slots < 0:
            raise ConfigError(f"num_prefix_state_slots: found {self.num_prefix_state_slots}, expected >= 0")
        if self.kv_cache_dtype not in ("auto", "bfloat16"):
            raise ConfigError(f"kv_cache_dtype: found {self.kv_cache_dtype!r}, expected auto or bfloat16")
        if self.page_size is not None and self.page_size < 1:
            raise ConfigError(f"page_size: found {self.page_size}, expected >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"kv_cache_memory_bytes: found {self.kv_cache_memory_bytes}, expected > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: found {self.gpu_memory_utilization}, expected in (0, 1]")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages: found {self.num_kv_pages}, expected >= 1")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(256, "most sequences in one step")
    max_num_batched_tokens: int = _opt(8192, "token budget of one step (prefill chunks + decode tokens)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps")
    long_prefill_token_threshold: int = _opt(0, "cap on one request's prefill chunk per step (0 = budget only)")
    async_scheduling: bool | None = _opt(
        None, "schedule and launch step N+1 while step N runs; outputs one step later (docs/async_scheduling.md). "
        "default: on where it is supported and gains (a CUDA device, no speculative decoding, one data-parallel "
        "rank), off otherwise")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: found {self.max_num_seqs}, expected >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens: found {self.max_num_batched_tokens}, expected >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold: found {self.long_prefill_token_threshold}, expected >= 0")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: found {value!r}, expected an integer >= {low}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Data-parallel attention / expert-parallel MoE layout (vLLM's option names; docs/parallel.md)."""

    data_parallel_size: int = _opt(1, "data-parallel ranks, one process (and one GPU) each")
    enable_expert_parallel: bool = _opt(False, "spread the routed experts over the data-parallel ranks")
    enable_eplb: bool = _opt(False, "rebalance (replicate) hot experts while running; needs expert parallelism")
    num_redundant_experts: int = _opt(0, "extra physical expert slots per MoE layer for EPLB replicas")
    eplb_window_size: int = _opt(1000, "steps of expert load EPLB keeps (<= eplb_step_interval)")
    eplb_step_interval: int = _opt(3000, "steps between EPLB rebalances")

    def __post_init__(self) -> None:
        _int_at_least("data_parallel_size", self.data_parallel_size, 1)
        _int_at_least("num_redundant_experts", self.num_redundant_experts, 0)
        _int_at_least("eplb_window_size", self.eplb_window_size, 1)
        _int_at_least("eplb_step_interval", self.eplb_step_interval, 1)
        if self.eplb_window_size > self.eplb_step_interval:
            raise ConfigError(
                f"eplb_window_size: found {self.eplb_window_size}, expected <= eplb_step_interval="
                f"{self.eplb_step_interval}"
            )
        if (self.enable_eplb or self.num_redundant_experts) and not self.enable_expert_parallel:
            raise ConfigError(
                "enable_eplb / num_redundant_experts: found without enable_expert_parallel, expected "
                "enable_expert_parallel=True (replicas only exist when experts are spread over ranks)"
            )

    def to_parallel(self) -> deepinfer_parallel.ParallelConfig:
        """The deepinfer-parallel layout: one EP group over all ranks with expert parallelism, else ep_size 1."""
        from deepinfer_parallel import ParallelConfig as Layout
        from deepinfer_parallel import ParallelConfigError

        dp = self.data_parallel_size
        try:
            return Layout(
                dp_size=dp, ep_size=dp if self.enable_expert_parallel else 1,
                num_redundant_experts=self.num_redundant_experts, enable_eplb=self.enable_eplb,
                eplb_window_size=self.eplb_window_size, eplb_step_interval=self.eplb_step_interval,
            )  # fmt: skip
        except ParallelConfigError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys `method` / `num_speculative_tokens`; docs/dspark.md)."""

    speculative_method: Literal["dspark", "mtp"] | None = _opt(
        None, "draft with the checkpoint's DSpark stages or V4 MTP block (default: none)")
    num_speculative_tokens: int | None = _opt(
        None, "drafts per step (default: the checkpoint's DSpark block size / MTP depth)")
    speculative_policy: Literal["verify_all", "threshold", "cost"] = _opt(
        "verify_all", "how many drafts to verify: all, those whose survival >= threshold, or the latency-optimal count")
    speculative_threshold: float = _opt(0.5, "survival threshold of speculative_policy=threshold, in [0, 1]")
    speculative_latency: str = _opt(
        "profile", "step-time curve of speculative_policy=cost: profile (time the target forward at start-up, "
        "corrected online) or affine:BASE,SLOPE (seconds + seconds per query token, fixed)")
    speculative_calibration: Literal["online", "off"] = _opt(
        "online", "speculative_policy=cost prices each survival at the acceptance seen at its level, per greedy / "
        "sampled rows (online), or at the Confidence Head's value (off)")

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, "dspark", "mtp"):
            raise ConfigError(f"speculative_method: found {self.speculative_method!r}, expected None, dspark or mtp")
        if self.num_speculative_tokens is not None:
            _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
            if self.speculative_method is None:
                raise ConfigError(
                    f"num_speculative_tokens: found {self.num_speculative_tokens} without a speculative_method, "
                    "expected speculative_method=dspark or mtp as well"
                )
        if self.speculative_policy not in ("verify_all", "threshold", "cost"):
            raise ConfigError(
                f"speculative_policy: found {self.speculative_policy!r}, expected verify_all, threshold or cost"
            )
        t = self.speculative_threshold
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0.0 <= t <= 1.0:
            raise ConfigError(f"speculative_threshold: found {t!r}, expected a number in [0, 1]")
        affine_latency(self.speculative_latency)  # validates the spelling
        if self.speculative_calibration not in ("online", "off"):
            raise ConfigError(f"speculative_calibration: found {self.speculative_calibration!r}, expected online or off")


def affine_latency(spec: str) -> tuple[float, float] | None:
    """`speculative_latency`: None for "profile", (base, slope) seconds for "affine:BASE,SLOPE"."""
    if spec == "profile":
        return None
    bad = ConfigError(f"speculative_latency: found {spec!r}, expected profile or affine:BASE,SLOPE (seconds, e.g. "
                      "affine:0.02,0.0005)")
    if not isinstance(spec, str) or not spec.startswith("affine:"):
        raise bad
    try:
        base, slope = (float(x) for x in spec.removeprefix("affine:").split(","))
    except ValueError:
        raise bad from None
    if not (base > 0 and slope >= 0):
        raise bad
    return base, slope


# vLLM's `speculative_config` dict keys -> engine options (policy / threshold are DeepInfer's own keys)
_SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "policy": "speculative_policy",
    "threshold": "speculative_threshold",
    "latency": "speculative_latency",
    "calibration": "speculative_calibration",
}


def speculative_options(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 4})` -> engine options."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"speculative_config: found {type(config).__name__}, expected a dict or None")
    unknown = sorted(k for k in config if k not in _SPECULATIVE_KEYS)
    if unknown:
        raise ConfigError(
            f"speculative_config: found key(s) {unknown}, expected only {sorted(_SPECULATIVE_KEYS)} (the draft "
            "model is the checkpoint's own DSpark stages / MTP block)"
        )
    return {_SPECULATIVE_KEYS[k]: v for k, v in config.items()}


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """All engine options; build it with `EngineConfig.from_options(model=..., max_num_seqs=...)`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        table = _option_table()
        unknown = [k for k in options if k not in table]
        if unknown:
            parts = []
            for k in unknown:
                close = difflib.get_close_matches(k, list(table), n=3, cutoff=0.5)
                parts.append(f"{k!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
            raise ConfigError(f"unknown engine option(s): {'; '.join(parts)}. Valid options: {', '.join(table)}")
        per_section: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        for k, v in options.items():
            _check_type(k, v, table[k])
            per_section[table[k][0]][k] = v
        try:
            return cls(**{s: _SECTIONS[s](**kw) for s, kw in per_section.items()})
        except TypeError as exc:  # pragma: no cover - every name was checked above
            raise ConfigError(str(exc)) from exc

    def to_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in _SECTIONS:
            out.update(dataclasses.asdict(getattr(self, s)))
        return out

    def replace(self, **options: Any) -> EngineConfig:
        merged = self.to_options()
        merged.update(options)
        return EngineConfig.from_options(**merged)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, **overrides: Any) -> EngineConfig:
        opts = {k: getattr(ns, k) for k in _option_table() if hasattr(ns, k) and getattr(ns, k) is not None}
        opts.update(overrides)
        return cls.from_options(**opts)


def _option_table() -> dict[str, tuple[str, dataclasses.Field]]:
    table: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, klass in _SECTIONS.items():
        for f in dataclasses.fields(klass):
            table[f.name] = (section, f)
    return table


def _check_type(name: str, value: Any, entry: tuple[str, dataclasses.Field]) -> None:
    """Reject a value of the wrong type before the dataclass compares it (ConfigError naming the option)."""
    hints = typing.get_type_hints(_SECTIONS[entry[0]])
    annotation = hints[name]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation)
    if value is None:
        if optional:
            return
        raise ConfigError(f"{name}: found None, expected a value")
    typ, choices = _base_type(annotation)
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{name}: found {value!r}, expected one of {', '.join(map(str, choices))}")
        return
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(typ, True)
    if not ok:
        raise ConfigError(f"{name}: found {value!r} ({type(value).__name__}), expected {typ.__name__}")


def engine_option_names() -> list[str]:
    return list(_option_table())


def _base_type(annotation: Any) -> tuple[type, tuple | None]:
    hints = annotation
    if typing.get_origin(hints) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hints) if a is not type(None)]
        hints = args[0]
    if typing.get_origin(hints) is Literal:
        return str, typing.get_args(hints)
    return hints, None


def add_engine_args(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per engine option (defaults None: unset flags keep the dataclass defaults)."""
    group = parser.add_argument_group("engine options")
    for klass in _SECTIONS.values():
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            typ, choices = _base_type(hints[f.name])
            help_text = f.metadata.get("help", "")
            if "default" not in help_text:  # the help text may already explain a computed default
                help_text += f" (default: {'none' if f.default is None else f.default})"
            if typ is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            else:
                conv = f.metadata.get("parse", typ)
                group.add_argument(flag, dest=f.name, type=conv, choices=choices, default=None, help=help_text)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2GB', '1e9'-free plain integers -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a byte size like 4096, 512MiB or 2GB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
