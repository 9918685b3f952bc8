"""The step loop: schedule -> execute -> update_from_output, plus detokenization, stop strings and n > 1.

`LLMEngine.from_config` loads the checkpoint, sizes the caches from the families' per-token / per-sequence bytes
and a byte budget, and logs the plan once. `LLMEngine(...)` takes ready components (tests drive stand-ins).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.kv_cache import CachePlan, KVCacheManager, plan_cache
from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.core.request import Request, RequestStatus
from deepinfer_engine.core.sched_output import RequestUpdate, TokenLogprobs
from deepinfer_engine.core.scheduler import Scheduler
from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.model.checkpoint_files import load_tokenizer, read_eos_ids
from deepinfer_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_engine.sampling_params import SamplingParams
from deepinfer_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
DEFAULT_CPU_CACHE_BYTES = 64 * 2**20


def mix_seed(*parts: int) -> int:
    """splitmix64 over the parts: derives per-request / per-sample seeds (63-bit, non-negative)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


@dataclass(kw_only=True)
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[str]
    output: RequestOutput
    done: set[str] = field(default_factory=set)
    detok: dict[int, _Detok] = field(default_factory=dict)


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


def default_page_size(ratios: Sequence[int], hidden_size: int) -> int:
    """128 tokens for real models, 16 for tiny ones, rounded up to a multiple of every compress ratio."""
    lcm = 1
    for r in ratios:
        if r > 0:
            lcm = lcm * r // math.gcd(lcm, r)
    base = 128 if hidden_size >= 1024 else 16
    return -(-base // lcm) * lcm


def families_from_cache(args: Any, page_size: int, dtype: torch.dtype) -> list[CacheFamily]:
    """Per-family sizes of the model's own `ModelCache` layout, measured on the meta device (no memory).

    Preferred source is M's `model.cache_layout.cache_families`; this is the fallback while it is missing and
    is exact for whatever `ModelCache.allocate` builds.
    """
    try:
        from deepinfer_engine.model.cache_layout import cache_families  # type: ignore[attr-defined]
    except ImportError:
        cache_families = None
    if cache_families is not None:
        return list(cache_families(args, page_size, dtype))
    from deepinfer_engine.model.cache import ModelCache

    c = ModelCache.allocate(args, num_slots=1, num_pages=1, page_size=page_size, dtype=dtype, device="meta")

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    fams = [
        CacheFamily(name="swa_ring", kind="slot", num_layers=len(c.swa),
                    bytes_per_slot=sum(nbytes(t) for t in c.swa.values())),
    ]
    if c.comp_state:
        fams.append(CacheFamily(name="compressor_state", kind="slot", num_layers=len(c.comp_state),
                                bytes_per_slot=sum(nbytes(t) for t in c.comp_state.values())))
    if c.token_ring is not None:
        fams.append(CacheFamily(name="engram_history", kind="slot", num_layers=1, bytes_per_slot=nbytes(c.token_ring)))
    if c.compressed_kv:
        fams.append(CacheFamily(name="compressed_kv", kind="paged", num_layers=len(c.compressed_kv),
                                bytes_per_token=sum(nbytes(t) for t in c.compressed_kv.values()) / page_size))
    if c.index_keys:
        fams.append(CacheFamily(name="indexer_keys", kind="paged", num_layers=len(c.index_keys),
                                bytes_per_token=sum(nbytes(t) for t in c.index_keys.values()) / page_size))
    return fams


class LLMEngine:
    def __init__(
        self,
        *,
        config: EngineConfig,
        runner: ModelRunner,
        plan: CachePlan,
        max_model_len: int,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (1,),
        bos_token_id: int | None = 0,
        args: Any = None,
        model_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.plan = plan
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.args = args
        self.model_dir = model_dir
        sc = config.scheduler
        self.scheduler = Scheduler(
            kv=KVCacheManager.from_plan(plan), max_num_seqs=min(sc.max_num_seqs, plan.num_slots),
            max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._child_parent: dict[str, tuple[str, int]] = {}
        self._arrivals = 0
        self.total = StepStats()
        for line in plan.describe():
            logger.info(line)

    # ------------------------------------------------------------------ construction from a checkpoint
    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from deepinfer_engine.model.args import ModelArgs
        from deepinfer_engine.model.cache import ModelCache

        mc = config.model
        if mc.model is None:
            from deepinfer_engine.default_model import default_model_dir

            model_dir = default_model_dir()
        else:
            model_dir = Path(mc.model)
        if not (model_dir / "config.json").exists():
            raise ConfigError(f"model: {str(model_dir)!r} has no config.json; expected a checkpoint directory")
        device = resolve_device(mc.device)
        dtype = resolve_dtype(mc.dtype, device)
        args = ModelArgs.from_checkpoint_dir(model_dir)
        # the small files first: a malformed one fails in a second, not after the weights have loaded
        eos = read_eos_ids(model_dir, args)
        tokenizer = load_tokenizer(mc.tokenizer) if mc.tokenizer else load_tokenizer(model_dir, required=False)
        if device.type == "cpu":
            threads = mc.num_cpu_threads or (1 if int(args.hidden_size) < 1024 else None)
            if threads is not None:
                torch.set_num_threads(threads)  # process-wide; measured: tiny model 1.5 s/step on 2 busy cores -> 0.08 s
        model = _load_model(model_dir, dtype, device)
        ratios = [int(p.ratio) for p in args.layer_plans]
        page_size = config.cache.page_size or default_page_size(ratios, int(args.hidden_size))
        bad = [r for r in ratios if r > 0 and page_size % r]
        if bad:
            raise ConfigError(f"page_size: found {page_size}, expected a multiple of every compress ratio {sorted(set(bad))}")
        max_model_len = mc.max_model_len or int(args.max_position_embeddings)
        families = families_from_cache(args, page_size, dtype)
        budget = config.cache.kv_cache_memory_bytes
        if budget is None and config.cache.num_kv_pages is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * config.cache.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_CACHE_BYTES
        plan = plan_cache(families, page_size=page_size, memory_bytes=budget,
                          max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
                          num_pages=config.cache.num_kv_pages)
        _log_record_formats(args)
        cache = ModelCache.allocate(args, num_slots=plan.num_slots, num_pages=plan.num_pages, page_size=page_size,
                                    dtype=dtype, device=device)
        runner = ModelRunner(model, cache, device=device, eos_token_ids=eos)
        return cls(config=config, runner=runner, plan=plan, max_model_len=max_model_len, tokenizer=tokenizer,
                   eos_token_ids=eos, bos_token_id=getattr(args, "bos_token_id", 0), args=args, model_dir=model_dir)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, text: str) -> list[int]:
        """Plain text -> ids: tokenizer ids with BOS prepended (the tokenizer itself adds nothing)."""
        if self.tokenizer is None:
            raise InputError("prompt: got text but this engine has no tokenizer; pass token ids instead")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def check_prompt(self, token_ids: Sequence[int], *, where: str = "prompt_token_ids") -> None:
        """Raise InputError for ids outside the vocabulary (length limits are the scheduler's: they finish the
        request with an error instead, so one long prompt does not stop a batch)."""
        vocab = getattr(self.args, "vocab_size", None)
        if vocab is None:
            return
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InputError(f"{where}: found token id {t!r}, expected integers in [0, {vocab})")

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *, prompt: str | None = None
    ) -> None:
        if request_id in self._tracked:
            raise InputError(f"request_id: {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        self.check_prompt(ids)
        arrival = self._arrivals
        self._arrivals += 1
        base_seed = params.seed if params.seed is not None else mix_seed(self.config.model.seed, arrival)
        children = [request_id if params.n == 1 else f"{request_id}#{i}" for i in range(params.n)]
        out = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=ids,
                            outputs=[CompletionOutput(index=i) for i in range(params.n)],
                            metrics=RequestMetrics(arrival_time=time.monotonic()))
        if params.logprobs is not None:
            for co in out.outputs:
                co.logprobs = []
                co.cumulative_logprob = 0.0
        if params.prompt_logprobs is not None:
            out.prompt_logprobs = [None]
        self._tracked[request_id] = _Tracked(request_id=request_id, prompt=prompt, prompt_token_ids=ids,
                                             params=params, children=children, output=out)
        max_tokens = params.max_tokens
        for i, cid in enumerate(children):
            self._child_parent[cid] = (request_id, i)
            req = Request(cid, ids, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                          stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                          min_tokens=params.min_tokens, arrival_index=arrival, payload=params)
            # seed of sample i: the request seed itself for n == 1, a derived one per sample otherwise
            self.scheduler.add_request(req, seed=base_seed if params.n == 1 else mix_seed(base_seed, i))

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            tr = self._tracked.get(rid)
            if tr is not None:
                self.scheduler.abort_requests(tr.children)

    def stop_sample(self, request_id: str, index: int = 0, stop_reason: int | str | None = None) -> None:
        """Finish sample `index` of a request now with finish_reason "stop" (e.g. a chat parser matched a stop
        sequence); the finish is reported by the next `step()`. Unknown or finished samples are ignored."""
        tr = self._tracked.get(request_id)
        if tr is None or not 0 <= index < len(tr.children):
            return
        self.scheduler.finish_requests([tr.children[index]], RequestStatus.FINISHED_STOPPED, stop_reason=stop_reason,
                                       emit=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_updates()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        updates = self.scheduler.update_from_output(sched, result)
        for c in sched.chunks:
            if c.sample and c.num_tokens == 1 and c.start_position >= c.num_prompt_tokens:
                self.total.decode_tokens += 1
            else:
                self.total.prefill_tokens += c.num_tokens
        touched: dict[str, _Tracked] = {}
        for u in updates:
            tr = self._apply(u)
            if tr is not None:
                touched[tr.request_id] = tr
        self.total.seconds += time.perf_counter() - t0
        outs = []
        for tr in touched.values():
            outs.append(tr.output)
            if tr.output.finished:
                del self._tracked[tr.request_id]
                for cid in tr.children:
                    self._child_parent.pop(cid, None)
                    self.scheduler.release(cid)
        return outs

    def _apply(self, u: RequestUpdate) -> _Tracked | None:
        link = self._child_parent.get(u.req_id)
        if link is None:
            return None
        parent, idx = link
        tr = self._tracked[parent]
        co = tr.output.outputs[idx]
        if co.finish_reason is not None:
            return None
        if u.new_token_ids:
            if tr.output.metrics.first_token_time is None:
                tr.output.metrics.first_token_time = time.monotonic()
            co.token_ids.extend(u.new_token_ids)
        for lp in u.new_logprobs:
            if co.logprobs is not None:
                co.logprobs.append(lp)
                co.cumulative_logprob = (co.cumulative_logprob or 0.0) + lp.logprob
        if u.new_prompt_logprobs and tr.output.prompt_logprobs is not None and idx == 0:
            tr.output.prompt_logprobs.extend(u.new_prompt_logprobs)
        finish_reason, stop_reason = u.finish_reason, u.stop_reason
        if u.new_token_ids and self.tokenizer is not None:
            text, hit = self._detokenize(co, tr.params, tr.detok.setdefault(idx, _Detok()))
            co.text = text
            if hit is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", hit
                self.scheduler.finish_requests([u.req_id], RequestStatus.FINISHED_STOPPED, stop_reason=hit)
        if u.error is not None:
            tr.output.error = u.error
        if finish_reason is not None:
            co.finish_reason = finish_reason
            co.stop_reason = stop_reason
            tr.done.add(u.req_id)
            if len(tr.done) == len(tr.children):
                tr.output.finished = True
                tr.output.metrics.finished_time = time.monotonic()
                req = self.scheduler.requests.get(u.req_id)
                if req is not None:
                    tr.output.metrics.num_preemptions = req.num_preemptions
        return tr

    def _detokenize(self, co: CompletionOutput, params: SamplingParams, state: _Detok) -> tuple[str, str | None]:
        """Incremental detokenization (decodes a short window per new token, not the whole output) and the
        stop-string search over the newly added text."""
        ids = co.token_ids
        if ids and (ids[-1] in self.eos_token_ids or ids[-1] in params.stop_token_ids):
            ids = ids[:-1]  # the token that stopped generation is kept in token_ids but not in text
        skip = params.skip_special_tokens
        before = len(state.text)
        while state.read < len(ids):
            # byte-level BPE: text of ids[read:] is only final once decoding it together with a few earlier ids
            # no longer ends in an incomplete UTF-8 sequence (U+FFFD)
            prefix = self.tokenizer.decode(ids[state.prefix : state.read], skip_special_tokens=skip)
            full = self.tokenizer.decode(ids[state.prefix : state.read + 1], skip_special_tokens=skip)
            state.read += 1
            if full.endswith("\ufffd"):
                continue
            state.text += full[len(prefix):]
            state.prefix = max(state.prefix, state.read - 4)
        if not params.stop:
            return state.text, None
        longest = max(len(x) for x in params.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for x in params.stop:
            i = state.text.find(x, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, x)
        if best is None:
            return state.text, None
        i, x = best
        return (state.text[: i + len(x)] if params.include_stop_str_in_output else state.text[:i]), x


@dataclass(kw_only=True)
class _Detok:
    prefix: int = 0  # first id of the decode window
    read: int = 0  # ids before this are in `text`
    text: str = ""


def _log_record_formats(args: Any) -> None:
    """Bytes per token of the compressed caches in the design's record formats (runtime.md §6.2), for comparison
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


def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from deepinfer_engine.model.loader import load_model

    model = load_model(model_dir, dtype=dtype, device=device)
    model.eval()
    return model


__all__ = ["LLMEngine", "StepStats", "TokenLogprobs", "mix_seed"]
