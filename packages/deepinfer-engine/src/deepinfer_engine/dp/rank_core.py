"""One data-parallel rank: an `EngineCore` (its own scheduler, caches and model, holding only its experts under
expert parallelism) that steps in lock-step with the other ranks (docs/parallel.md, "Engine integration").

Every step: schedule -> agree with the other ranks (`agree_step`: one all-gather of the prefill / decode token
counts on the CPU group) -> run the step, or an empty MoE step when this rank has nothing to run -> update. The
agreed kind picks the dispatch mode: the engine's scheduler mixes prefill chunks and decode tokens in one step, so
a step is a "prefill" step (throughput dispatch) when any rank schedules a prefill token, a "decode" step
(low-latency dispatch, fixed buffers) otherwise, and "idle" when no rank has work. A step that raises is a rank
failure here (one EngineCore fails only the step's requests instead): its peers would otherwise wait in a
collective the failed rank never reaches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepinfer_parallel import ParallelState, RankFailedError, agree_step

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.request import EngineCoreRequest
from deepinfer_engine.core.sched_output import EngineCoreOutput, SchedulerOutput
from deepinfer_engine.dp.rank_experts import RankExperts, fp8_dispatch_block
from deepinfer_engine.engine import EngineCore, StepStats, model_dir_of

__all__ = ["DPRankCore", "RankLoad", "RankStep", "token_counts"]


@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """What placement weighs (reported after every step): queued_tokens = prompt tokens of waiting requests not
    computed yet; running_tokens = tokens (context) of running requests; free / total cache pages and slots."""

    queued_tokens: int = 0
    running_tokens: int = 0
    free_pages: int = 0
    total_pages: int = 0
    free_slots: int = 0

    @property
    def tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


@dataclass(frozen=True, kw_only=True)
class RankStep:
    """One rank's account of one lock-step step: kind agreed by all ranks, its own tokens, whether it ran an
    empty MoE step, seconds, its load afterwards and whether EPLB moved experts after the step."""

    kind: str
    prefill_tokens: int
    decode_tokens: int
    empty: bool
    seconds: float
    load: RankLoad
    rebalanced: bool = False


def token_counts(sched: SchedulerOutput) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a scheduled step: a decode token is a sampled single-token chunk past
    the prompt (the same split as EngineCore's totals)."""
    prefill = decode = 0
    for c in sched.chunks:
        if c.sample and c.num_tokens == 1 and c.start_position >= c.num_prompt_tokens:
            decode += 1
        else:
            prefill += c.num_tokens
    return prefill, decode


class DPRankCore:
    """EngineCore of rank `state.rank` plus the lock-step loop. `step()` is collective over the world.

    spmd: the rank is one process of a `torchrun` world serving its own requests (LLM in every process), so
    `has_unfinished_requests` is a world vote: a rank keeps stepping (empty steps) while any rank has work.
    token_map: the Engram compressed token map when the front-end computed it (else the loader does).
    """

    def __init__(self, config: EngineConfig, state: ParallelState, *, spmd: bool = False,
                 token_map: Any = None) -> None:
        from deepinfer_engine.model.args import ModelArgs

        self.state = state
        self.spmd = spmd
        par = config.parallel
        layout = par.to_parallel()
        args = ModelArgs.from_checkpoint_dir(model_dir_of(config))
        self.experts = RankExperts(
            state, layout, expert_parallel=par.enable_expert_parallel, num_layers=int(args.num_hidden_layers),
            num_experts=int(args.n_routed_experts), hidden_size=int(args.hidden_size),
            top_k=int(args.num_experts_per_tok),
        )  # fmt: skip
        self.core = EngineCore.from_config(config, device=state.device, expert_slots=self.experts.loader_slots,
                                           token_map=token_map)
        model = self.core.runner.model
        self.dtype = model.dtype
        self.experts.install(
            model, max_tokens_per_rank=self.core.scheduler.max_num_seqs, dtype=self.dtype,
            fp8_block=fp8_dispatch_block(int(args.hidden_size), config.cache.kv_cache_dtype == "auto"),
        )  # fmt: skip
        self.steps = 0

    # the EngineCore facts LLMEngine reads
    config = property(lambda self: self.core.config)
    args = property(lambda self: self.core.args)
    model_dir = property(lambda self: self.core.model_dir)
    max_model_len = property(lambda self: self.core.max_model_len)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    vocab_size = property(lambda self: self.core.vocab_size)
    plan = property(lambda self: self.core.plan)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)

    @property
    def total(self) -> StepStats:
        return self.core.total

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.state.groups.released:  # refused before it is queued: nothing of the call is left behind
            raise RankFailedError(self.state.rank, None, "this rank's engine is closed (LLM.close() or the end of its "
                                  "with-block); create a new LLM to generate again")
        self.core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.core.abort_requests(request_ids)

    def has_local_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        """spmd: collective (MAX over the world of every rank's local answer); else this rank's answer."""
        local = self.has_local_work()
        if not self.spmd or self.state.world_group is None or self.state.world_size == 1:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.state.cpu_group)
        return bool(flag.item())

    def close(self) -> None:
        """Leave the process group this rank joined (torchrun SPMD); idempotent."""
        self.state.destroy()

    def load(self) -> RankLoad:
        s = self.core.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
        running = sum(r.num_tokens for r in s.running)
        return RankLoad(queued_tokens=queued, running_tokens=running, free_pages=s.kv.num_free_pages,
                        total_pages=self.core.plan.num_pages, free_slots=s.kv.num_free_slots)

    def step(self) -> list[EngineCoreOutput]:
        return self.step_report()[0]

    def step_report(self) -> tuple[list[EngineCoreOutput], RankStep]:
        """One lock-step step (collective): returns this rank's output deltas and its account of the step."""
        t0 = time.perf_counter()
        core = self.core
        sched = core.scheduler.schedule()
        prefill, decode = token_counts(sched)
        agreement = agree_step(self.state, prefill_tokens=prefill, decode_tokens=decode, prefill_policy="any")
        empty = sched.is_empty and agreement.kind != "idle"
        if agreement.kind != "idle":
            self.experts.set_mode(agreement.kind)
        result = core.runner.execute(sched)  # with an empty schedule: only the runner's bookkeeping
        if empty:
            self.experts.empty_step(self.state.device, self.dtype)
        rebalanced = agreement.kind != "idle" and self.experts.after_step()
        outputs = core.scheduler.update_from_output(sched, result)
        for o in outputs:
            if o.finished:
                core.scheduler.release(o.req_id)
        core.total.prefill_tokens += prefill
        core.total.decode_tokens += decode
        dt = time.perf_counter() - t0
        core.total.seconds += dt
        self.steps += 1
        return outputs, RankStep(kind=agreement.kind, prefill_tokens=prefill, decode_tokens=decode, empty=empty,
                                 seconds=dt, load=self.load(), rebalanced=rebalanced)
