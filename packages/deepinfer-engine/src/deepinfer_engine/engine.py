"""The engine core: schedule -> execute -> update, returning per-request token deltas (`EngineCoreOutput`).

Token state lives once, in the scheduler's `Request`s (the runner reads them by reference). Text, stop strings,
n > 1 fan-in, chat parsing and `RequestOutput`s are the output processor's (`output_processor.py`); validation
against the model happens before a request reaches `add_request` (`input_processor.py`). The core's API is
`add_request(EngineCoreRequest)`, `abort_requests(ids)`, `step() -> list[EngineCoreOutput]`; see docs/contracts.md.

`EngineCore.from_config` loads the checkpoint, sizes the caches from the families' per-token / per-sequence bytes
and a byte budget, and logs the plan once. `EngineCore(...)` takes ready components (tests drive stand-ins).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine.async_step import AsyncStepLoop
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.async_scheduler import AsyncScheduler
from deepinfer_engine.core.kv_cache import CachePlan, KVCacheManager, PrefixCaching, plan_cache
from deepinfer_engine.core.request import EngineCoreRequest, Request
from deepinfer_engine.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from deepinfer_engine.core.scheduler import Scheduler
from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.model.checkpoint_files import read_eos_ids
from deepinfer_engine.worker.async_runner import AsyncModelRunner
from deepinfer_engine.worker.model_runner import ModelRunner

_EMPTY_RESULT = ModelRunnerOutput()
logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
SEED_LIMIT = 1 << 63
DEFAULT_CPU_CACHE_BYTES = 64 * 2**20


def _limbs(p: int) -> list[int]:
    """64-bit words of an int: one word for 0 <= p < 2**64 (so such inputs hash as before), otherwise a marker
    word (sign and length) followed by every word of |p|, so that no two distinct ints feed the same words."""
    p = int(p)
    if 0 <= p <= _MASK64:
        return [p]
    mag = -p if p < 0 else p
    words = []
    while mag:
        words.append(mag & _MASK64)
        mag >>= 64
    return [(len(words) << 1 | (p < 0)) ^ 0xD1B54A32D192ED03, *words]


def mix_seed(*parts: int) -> int:
    """splitmix64 over every bit of the parts: derives per-request / per-sample seeds (63-bit, non-negative)."""
    x = 0x9E3779B97F4A7C15
    for part in parts:
        for p in _limbs(part):
            x = (x ^ p) & _MASK64
            x = (x + 0x9E3779B97F4A7C15) & _MASK64
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
            x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def sampler_seed(seed: int) -> int:
    """The sampler's 63-bit key for a user seed: seeds in [0, 2**63) are used as they are; any other int
    (negative, or 2**63 and beyond) is hashed over all its bits, so e.g. 2**64 and 0 do not collide."""
    return seed if 0 <= seed < SEED_LIMIT else mix_seed(seed)


@dataclass(kw_only=True)
class StepStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device: found {name!r}, expected auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ConfigError(f"device: found {name!r} but this machine has {count} CUDA device(s); use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_async_scheduling(config: EngineConfig, device: torch.device, *, as_rank: bool = False) -> EngineConfig:
    """`async_scheduling=None` (the default) -> on for a CUDA device without speculative decoding, outside a
    data-parallel world (`as_rank`: this engine core is a rank of one), off otherwise. On CUDA the host half of a decode step (sampled-id read, stop checks,
    scheduling, the next batch's inputs) is as long as a graphed forward at small batch, and overlapping it is what
    brings the engine's step to its forward (docs/async_scheduling.md); on the CPU there is nothing to overlap.
    Speculation runs under an explicit True (its overlap is the output processing only; mixed on the H200), and
    data-parallel ranks step synchronously. An explicit True / False is kept (and refused below where it cannot
    run)."""
    if config.scheduler.async_scheduling is not None:
        return config
    return config.replace(async_scheduling=device.type == "cuda" and not as_rank and _async_runs(config))


def _async_runs(config: EngineConfig) -> bool:
    """Whether the asynchronous loop is the default for this configuration: not for speculation (it runs there
    when asked for; docs/async_scheduling.md "Speculative decoding") nor data-parallel ranks (refused)."""
    return config.speculative.speculative_method is None and config.parallel.data_parallel_size == 1


def default_page_size(ratios: Sequence[int], hidden_size: int) -> int:
    """128 tokens for real models, 16 for tiny ones, rounded up to a multiple of every compress ratio."""
    lcm = 1
    for r in ratios:
        if r > 0:
            lcm = lcm * r // math.gcd(lcm, r)
    base = 128 if hidden_size >= 1024 else 16
    return -(-base // lcm) * lcm


class EngineCore:
    """schedule -> execute -> update over `EngineCoreRequest`s; `step()` returns the deltas of that step.

    A step whose execution raises fails exactly the requests it scheduled (finish_reason "error", the exception
    named in `error`, traceback logged); the engine stays usable.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        runner: ModelRunner,
        plan: CachePlan,
        max_model_len: int,
        args: Any = None,
        model_dir: Path | None = None,
        eos_token_ids: Sequence[int] = (1,),
        num_spec_tokens: int = 0,
        prefix: PrefixCaching | None = None,
    ) -> None:
        if config.scheduler.async_scheduling is None:  # built around a given runner: its kind decides
            config = config.replace(async_scheduling=hasattr(runner, "execute_async") and _async_runs(config))
        self.config = config
        self.runner = runner
        self.plan = plan
        self.max_model_len = max_model_len
        self.args = args
        self.model_dir = model_dir
        self.eos_token_ids = tuple(eos_token_ids)
        sc = config.scheduler
        self._async: AsyncStepLoop | None = None
        if sc.async_scheduling and config.parallel.data_parallel_size > 1:
            # a data-parallel rank steps in lock-step with its peers through its own synchronous loop (dp/)
            raise ConfigError(f"async_scheduling: found True with data_parallel_size="
                              f"{config.parallel.data_parallel_size}; the data-parallel ranks step synchronously "
                              "(no overlap yet). Fix: async_scheduling=False")
        if sc.async_scheduling and not hasattr(runner, "execute_async"):
            raise ConfigError(f"async_scheduling: found True with a {type(runner).__name__}, expected a runner with "
                              "execute_async (worker.async_runner.AsyncModelRunner)")
        # speculation: the asynchronous loop reads each round back before it schedules the next one (a round's
        # accepted drafts fix the next one's positions), so the synchronous scheduler plans it (async_step.py)
        speculative = config.speculative.speculative_method is not None
        self.scheduler = (AsyncScheduler if sc.async_scheduling and not speculative else Scheduler)(
            kv=KVCacheManager.from_plan(plan, prefix), max_num_seqs=min(sc.max_num_seqs, plan.num_slots),
            max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            long_prefill_token_threshold=sc.long_prefill_token_threshold, num_spec_tokens=num_spec_tokens,
        )
        self.total = StepStats()
        if sc.async_scheduling:
            self._async = AsyncStepLoop(self, collect_first=speculative)
        for line in plan.describe():
            logger.info(line)

    # ------------------------------------------------------------------ construction from a checkpoint
    @classmethod
    def from_config(
        cls, config: EngineConfig, *, device: torch.device | None = None,
        expert_slots: Callable[[int], Sequence[int]] | None = None, token_map: Any = None,
    ) -> EngineCore:  # fmt: skip
        """device / expert_slots / token_map: set by a data-parallel rank (deepinfer_engine.dp): its device, the
        checkpoint experts of its slots per MoE layer (`load_model(expert_slots=)`) and the Engram token map its
        front-end computed once for all ranks; a rank is one engine core."""
        from deepinfer_engine.model.args import ModelArgs
        from deepinfer_engine.model.cache import ModelCache, kv_storage
        from deepinfer_engine.model.cache_layout import cache_families

        refuse_unsupported(config, as_rank=device is not None)
        mc = config.model
        model_dir = model_dir_of(config)
        as_rank = device is not None
        device = device if device is not None else resolve_device(mc.device)
        config = resolve_async_scheduling(config, device, as_rank=as_rank)
        dtype = resolve_dtype(mc.dtype, device)
        args = ModelArgs.from_checkpoint_dir(model_dir)
        if mc.prefill_truncation == "compact":  # the model's split is checked before any weight loads
            from deepinfer_engine.model.truncation import decoder_split

            decoder_split(args, mc.prefill_truncation_keep)
        # the small files first: a malformed one fails in a second, not after the weights have loaded
        eos = read_eos_ids(model_dir, args)
        if device.type == "cpu":
            threads = mc.num_cpu_threads or (1 if int(args.hidden_size) < 1024 else None)
            if threads is not None:
                torch.set_num_threads(threads)  # process-wide; measured: tiny model 1.5 s/step on 2 busy cores -> 0.08 s
        kv_dtype = config.cache.kv_cache_dtype
        # "auto": the checkpoint's deployed numerics; the cache stores compact records where the layout allows
        # (V4.1 at real widths), otherwise the model rounds through the same formats into a plain cache
        storage = kv_storage(args, kv_dtype)
        model = _load_model(model_dir, dtype, device, deployed=kv_dtype == "auto", cache_records=storage == "auto",
                            expert_slots=expert_slots, token_map=token_map,
                            expert_layout=resolve_expert_layout(mc.expert_layout, device))
        model.set_prefill_truncation(mc.prefill_truncation, mc.prefill_truncation_keep)
        model.set_pdl(mc.pdl)  # before any CUDA graph is captured (they record the launches)
        model.set_overlap(mc.side_streams)  # likewise: graphs record the streams' fork / join
        ratios = [int(p.ratio) for p in args.layer_plans]
        page_size = config.cache.page_size or default_page_size(ratios, int(args.hidden_size))
        bad = [r for r in ratios if r > 0 and page_size % r]
        if bad:
            raise ConfigError(f"page_size: found {page_size}, expected a multiple of every compress ratio {sorted(set(bad))}")
        max_model_len = mc.max_model_len or int(args.max_position_embeddings)
        families = cache_families(args, page_size, dtype, kv_cache_dtype=storage)
        budget = config.cache.kv_cache_memory_bytes
        if budget is None and config.cache.num_kv_pages is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * config.cache.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_CACHE_BYTES
        cc = config.cache
        exact = cc.enable_prefix_caching and cc.prefix_replay == "exact"
        states = 0
        if exact:
            states = cc.num_prefix_state_slots
            if states is None:  # default: max_num_seqs blocks, at most a quarter of the budget
                per_slot = sum(f.bytes_per_slot for f in families if f.kind == "slot")
                states = config.scheduler.max_num_seqs
                if budget is not None and per_slot:
                    states = min(states, budget // 4 // per_slot)
        plan = plan_cache(families, page_size=page_size, memory_bytes=budget,
                          max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
                          num_pages=cc.num_kv_pages, num_state_slots=states)
        _log_record_formats(args)
        cache = ModelCache.allocate(args, num_slots=plan.num_slots + plan.num_state_slots, num_pages=plan.num_pages,
                                    page_size=page_size, dtype=dtype, device=device, kv_cache_dtype=storage)
        prefix = None
        if cc.enable_prefix_caching:
            host_pages = 0
            if cc.prefix_cache_host_bytes:
                host_pages = cc.prefix_cache_host_bytes // max(1, cache.host_tier_bytes_per_page())
                cache.allocate_host_pages(host_pages)
            prefix = PrefixCaching(mode=cc.prefix_replay, window=int(args.sliding_window), num_host_pages=host_pages,
                                   state_slots=tuple(range(plan.num_slots, plan.num_slots + plan.num_state_slots)),
                                   # as deep as the rings' slack allows (a rollback of <= slack + 1 rows)
                                   max_fork_rollback=cache.slack + 1,
                                   capture_tail=(mc.prefill_truncation_keep - int(args.sliding_window) + 1
                                                 if mc.prefill_truncation == "compact" else None))
            logger.info("prefix caching: %s replay, %d state slots, %d host pages", cc.prefix_replay,
                        plan.num_state_slots, host_pages)
        graphs = None
        if device.type == "cuda" and not mc.enforce_eager:
            from deepinfer_engine.worker.cuda_graph import CudaGraphRunner

            graphs = CudaGraphRunner(model, cache, device=device, max_num_seqs=min(config.scheduler.max_num_seqs,
                                     plan.num_slots), max_model_len=max_model_len)  # fmt: skip
        spec, num_spec = None, 0
        if config.speculative.speculative_method is not None:
            from deepinfer_engine.worker.spec_build import build_spec_decoder

            spec, num_spec = build_spec_decoder(config, model, cache, model_dir=model_dir, num_pages=plan.num_pages,
                                                device=device, graphs=graphs)
            if prefix is not None:  # a verify step writes up to num_spec rows past what it keeps: less to roll back
                prefix = replace(prefix, max_fork_rollback=max(0, cache.slack + 1 - num_spec))
        runner_cls = AsyncModelRunner if config.scheduler.async_scheduling else ModelRunner
        runner = runner_cls(model, cache, device=device, eos_token_ids=eos, cuda_graphs=graphs, spec=spec)
        return cls(config=config, runner=runner, plan=plan, max_model_len=max_model_len, args=args,
                   model_dir=model_dir, eos_token_ids=eos, num_spec_tokens=num_spec,
                   prefix=prefix)

    def spec_stats(self) -> Any:
        """The run's speculative-decoding `deepinfer_dspark.AcceptanceStats` (None without speculation)."""
        spec = getattr(self.runner, "spec", None)
        return None if spec is None else spec.stats

    @property
    def vocab_size(self) -> int | None:
        v = getattr(self.args, "vocab_size", None)
        return None if v is None else int(v)

    # ------------------------------------------------------------------ the API
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one validated sequence. A request this engine can never serve (prompt too long for
        max_model_len or for the whole cache) is finished at once with finish_reason "error" (next `step()`)."""
        if request.request_id in self.scheduler.requests:
            raise InputError(f"request_id: {request.request_id!r} is already in use")
        self.scheduler.add_request(Request.from_core_request(request), seed=request.seed)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop these sequences and free their cache; each unfinished one gets a final "abort" delta."""
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_updates()
                or (self._async is not None and self._async.busy))

    def step(self) -> list[EngineCoreOutput]:
        """With async_scheduling the deltas are those of the step launched by the previous call (async_step.py)."""
        if self._async is not None:
            return self._async.step()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - a failing step must fail its requests, never the engine
            self.fail_step(sched, exc)
            result = _EMPTY_RESULT
        outputs = self.scheduler.update_from_output(sched, result)
        self.account(sched, outputs, t0)
        return outputs

    def fail_step(self, sched: SchedulerOutput, exc: Exception) -> None:
        """Finish the requests of a step whose execution raised with finish_reason "error" (reported by the next
        `update_from_output`); their pages and slots return to the pools, the runner drops their state with the
        next step."""
        logger.error("engine step failed; finishing its %d request(s) with an error", len(sched.chunks),
                     exc_info=exc)
        ids = [c.req_id for c in sched.chunks]
        self.scheduler.fail_requests(ids, f"internal error while running this request's step: "
                                          f"{type(exc).__name__}: {exc}")

    def account(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput], t0: float) -> None:
        """Step statistics, and forget the requests `outputs` finished."""
        emitted = {o.req_id: len(o.new_token_ids) for o in outputs}
        for c in sched.chunks:
            if c.sample and c.num_tokens == 1 and c.start_position >= c.num_prompt_tokens:
                self.total.decode_tokens += max(1, emitted.get(c.req_id, 1))  # a speculative round emits several
            else:
                self.total.prefill_tokens += c.num_tokens
        for o in outputs:
            if o.finished:
                self.scheduler.release(o.req_id)
        self.total.seconds += time.perf_counter() - t0
        kv = self.scheduler.kv
        if kv.prefix is not None and outputs and not self.scheduler.has_unfinished_requests():
            st = kv.stats
            logger.info("prefix cache: hit rate %.3f (%d of %d prompt tokens cached, %d hits, %d replayed tokens, "
                        "%d pages loaded from host)", st.hit_rate, st.cached_tokens, st.query_tokens, st.hits,
                        st.replayed_tokens, st.host_loaded_pages)


def _log_record_formats(args: Any) -> None:
    """Bytes per token of the compressed caches in the design's record formats (docs/runtime.md §6.2), for comparison
    with the cache actually allocated (which stores the reference dtype)."""
    from deepinfer_engine.core.kv_cache_spec import compressed_owners, paged_bytes_per_token

    try:
        owners = compressed_owners(args.compress_ratios, args.num_hidden_layers,
                                   getattr(args, "kv_source_layer_ids", None) or None)
        kw = dict(head_dim=args.head_dim, index_head_dim=args.index_head_dim, rope_dim=args.qk_rope_head_dim)
        bf16 = paged_bytes_per_token(owners, **kw)
        if args.arch == "v41":
            prod = {"NVFP4 main + MXFP4 index": paged_bytes_per_token(owners, main_format="nvfp4",
                                                                      index_format="mxfp4", **kw),
                    "MXFP8 main + MXFP4 index": paged_bytes_per_token(owners, main_format="mxfp8",
                                                                      index_format="mxfp4", **kw)}
        else:
            prod = {"FP8 main + MXFP4 index": paged_bytes_per_token(owners, main_format="fp8_ds",
                                                                    index_format="mxfp4", **kw)}
    except (AttributeError, TypeError, ValueError):  # configs without compressed layers / fields
        return
    logger.info("compressed cache record formats: bf16 %g B/token; %s", bf16,
                "; ".join(f"{k} {v:g} B/token" for k, v in prod.items()))


def model_dir_of(config: EngineConfig) -> Path:
    """The checkpoint directory of `config` (the embedded default when none is given), checked to hold one."""
    if config.model.model is None:
        from deepinfer_engine.default_model import default_model_dir

        return default_model_dir()
    model_dir = Path(config.model.model)
    if not (model_dir / "config.json").exists():
        raise ConfigError(f"model: {str(model_dir)!r} has no config.json; expected a checkpoint directory")
    return model_dir


# what expert_layout="auto" picks on a CUDA device: the chunked layout (H200, 2026-12-02: the FP4 expert kernels
# 1.3x faster at T = 8 and 64, the V4.1 decode step at B = 64 12.9 -> 10.5 ms; docs/perf.md). The CPU keeps the
# checkpoint bytes: only the GPU kernels read the chunked layout faster.
AUTO_EXPERT_LAYOUT_CUDA = "chunked"


def resolve_expert_layout(option: str, device: torch.device) -> str:
    """ModelConfig.expert_layout -> the loader's layout: "chunked" only on CUDA (the repack is a GPU-kernel layout)."""
    if device.type != "cuda":
        return "checkpoint"
    return AUTO_EXPERT_LAYOUT_CUDA if option == "auto" else option


def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, *, deployed: bool, cache_records: bool,
                expert_slots: Callable[[int], Sequence[int]] | None = None, token_map: Any = None,
                expert_layout: str = "checkpoint"):
    # deployed numerics: FP8 activation quantization before every FP8 GEMM and the KV record formats
    from deepinfer_engine.model.loader import load_model

    model = load_model(model_dir, dtype=dtype, device=device, quantize_activations=deployed,
                       expert_slots=expert_slots, token_map=token_map, expert_layout=expert_layout)
    model.set_deployed_numerics(deployed, cache_records=cache_records)
    model.eval()
    return model


__all__ = ["EngineCore", "StepStats", "mix_seed", "model_dir_of", "sampler_seed"]


def refuse_unsupported(config: EngineConfig, *, as_rank: bool = False) -> None:
    """Options the config accepts (vLLM names, validated) that this engine loop does not run yet: refuse them
    before any loading rather than silently decode without them. as_rank: built as one rank of a data-parallel
    engine (deepinfer_engine.dp), which runs data_parallel_size > 1."""
    spec, par = config.speculative, config.parallel
    if spec.speculative_method is not None and config.model.prefill_truncation != "off":
        # the drafter's context rows are indexed over every row of the step; truncation keeps only the last ones
        raise ConfigError(
            f"prefill_truncation: found {config.model.prefill_truncation!r} with speculative_method="
            f"{spec.speculative_method!r}; speculative decoding reads the draft context from every prefill row. "
            "Fix: prefill_truncation='off' when speculating"
        )
    if spec.speculative_method is not None and (par.data_parallel_size > 1 or par.enable_expert_parallel):
        raise ConfigError(
            f"speculative_method: found {spec.speculative_method!r} with data_parallel_size="
            f"{par.data_parallel_size} / enable_expert_parallel={par.enable_expert_parallel}; the data-parallel "
            "ranks do not speculate yet. Fix: leave speculative_method unset, or run one rank"
        )
    if (par.data_parallel_size > 1 or par.enable_expert_parallel) and not as_rank:
        raise ConfigError(
            f"data_parallel_size: found {par.data_parallel_size} (enable_expert_parallel={par.enable_expert_parallel}"
            "); one EngineCore runs one rank. Fix: build the engine through LLM / LLMEngine.from_config, which "
            "starts the data-parallel ranks"
        )

