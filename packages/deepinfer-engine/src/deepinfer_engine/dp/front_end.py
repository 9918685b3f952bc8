"""`DPEngineCore`: the data-parallel engine seen from the caller's process (docs/parallel.md, "Engine
integration"). It has EngineCore's API (`add_request`, `abort_requests`, `step`, `has_unfinished_requests`), so
`LLMEngine` / `LLM` use it unchanged.

It starts N rank processes (`SpawnedRanks`: free-port rendezvous, supervised, children die with the caller),
each building a `DPRankCore`, and talks to each over its own pipe. It owns placement: `add_request` picks a rank
by load (`LoadBalancer`); the request travels with the next `step`, which sends one command to every rank (so
every rank runs the same lock-step steps, idle ranks empty ones) and merges their output deltas. A rank that
raises or dies makes every call raise `RankFailedError` naming it, after every rank is gone. `close()` (also the
context manager and a finalizer when the object is dropped) stops the ranks and reaps them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import time
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
from deepinfer_parallel import ParallelConfigError, RankFailedError, SpawnedRanks

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.request import EngineCoreRequest
from deepinfer_engine.core.sched_output import EngineCoreOutput
from deepinfer_engine.dp.placement import DPStats, LoadBalancer
from deepinfer_engine.dp.rank_core import RankStep
from deepinfer_engine.dp.rank_main import RankInfo, serve_rank
from deepinfer_engine.engine import StepStats, model_dir_of, resolve_device
from deepinfer_engine.errors import ConfigError, InputError

__all__ = ["DPEngineCore"]

logger = logging.getLogger(__name__)

RANK_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 3600.0  # a real checkpoint is hundreds of GB
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.05


def _stop(ranks: SpawnedRanks, conns: list[Connection], timeout_s: float) -> Any:
    """Ask every rank to stop, wait for them (bounded), kill what is left; returns their results or None."""
    try:
        for c in conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        return ranks.join(timeout_s)
    except RankFailedError:
        return None
    finally:
        ranks.close()
        for c in conns:
            c.close()


def _engram_token_map(model_dir: Path, args: Any) -> Any:
    """The Engram compressed token map (V4.1), computed once here instead of in every rank (it decodes the whole
    vocabulary); None when the model has no Engram or no tokenizer.json (the rank's loader then reports it)."""
    tok = model_dir / "tokenizer.json"
    if not getattr(args, "engram_layer_ids", None) or not tok.is_file():
        return None
    from deepinfer_engine.model.checkpoint_files import load_tokenizer
    from deepinfer_engine.model.engram_hash import compressed_token_map

    return compressed_token_map(load_tokenizer(tok, required=False))


class DPEngineCore:
    """N data-parallel ranks behind EngineCore's API. config.parallel: data_parallel_size ranks; with
    enable_expert_parallel the routed experts are spread over them (EP group = all ranks), else every rank holds
    all experts. start_method: "fork" (default on Linux when the ranks run on the CPU and CUDA is not initialised
    here: ranks start in milliseconds) or "spawn" (default otherwise). timeout_s bounds each step and the
    collectives inside the ranks; load_timeout_s the start-up (checkpoint loading) of every rank."""

    def __init__(self, config: EngineConfig, *, start_method: str | None = None,
                 timeout_s: float = RANK_TIMEOUT_S, load_timeout_s: float = LOAD_TIMEOUT_S,
                 log_interval: int = 100) -> None:
        from deepinfer_engine.model.args import ModelArgs
        from deepinfer_engine.model.checkpoint_files import read_eos_ids

        par = config.parallel
        n = par.data_parallel_size
        layout = par.to_parallel()
        model_dir = model_dir_of(config)
        self.config = config
        self.args = ModelArgs.from_checkpoint_dir(model_dir)
        self.model_dir = model_dir
        self.eos_token_ids = tuple(read_eos_ids(model_dir, self.args))
        if par.enable_expert_parallel:
            try:
                layout.check_experts(int(self.args.n_routed_experts))
            except ParallelConfigError as exc:  # before any process starts
                raise ConfigError(str(exc)) from exc
        device = resolve_device(config.model.device)
        if device.type == "cuda":
            count, first = torch.cuda.device_count(), device.index or 0  # device="cuda:k": ranks on k, k+1, ...
            if first + n > count:
                raise ConfigError(f"data_parallel_size: found {n} ranks from cuda:{first}, but this host has {count} "
                                  "CUDA device(s); one rank per GPU. Fix: fewer ranks, or device='cpu'")
            devices, backend = [f"cuda:{first + i}" for i in range(n)], "nccl"
        else:
            devices, backend = ["cpu"] * n, "gloo"
        if start_method is None:
            cpu_fork = device.type == "cpu" and sys.platform.startswith("linux") and not torch.cuda.is_initialized()
            start_method = "fork" if cpu_fork else "spawn"
        self.backend = backend
        self.device = torch.device(devices[0])  # rank 0's (bench / device reports)
        self.timeout_s = timeout_s
        self.log_interval = log_interval
        ctx = mp.get_context(start_method)
        pairs = [ctx.Pipe(duplex=True) for _ in range(n)]
        self._conns = [p for p, _ in pairs]
        children = [c for _, c in pairs]
        token_map = _engram_token_map(model_dir, self.args)
        self._ranks = SpawnedRanks(serve_rank, n, config, children, token_map, config=layout, backend=backend,
                                   devices=devices, start_method=start_method, timeout_s=timeout_s)
        for c in children:
            c.close()
        self._finalizer = weakref.finalize(self, _stop, self._ranks, self._conns, _STOP_TIMEOUT_S)
        self.world_size = n
        self.failure: RankFailedError | None = None
        self.stats = DPStats(world_size=n)
        infos: list[RankInfo] = [m[1] for m in self._gather("ready", load_timeout_s)]
        self.infos = infos
        self.max_model_len = infos[0].max_model_len
        self.plan = infos[0].plan
        self.balancer = LoadBalancer([i.load for i in infos], page_size=infos[0].plan.page_size)
        self.total = StepStats()
        self._new: list[list[EngineCoreRequest]] = [[] for _ in range(n)]
        self._aborts: list[list[str]] = [[] for _ in range(n)]
        self._owner: dict[str, int] = {}
        self._in_flight = False
        self.last_reports: list[RankStep] = []
        self.results: list[Any] | None = None
        held = ", ".join(f"rank {i.rank}: {list(i.held_experts[0])}" for i in infos)
        logger.info("data-parallel engine: %d ranks (%s, %s), expert parallel %s; layer-0 experts %s", n,
                    backend, start_method, par.enable_expert_parallel, held)

    # ------------------------------------------------------------------ EngineCore facts
    @property
    def vocab_size(self) -> int | None:
        v = getattr(self.args, "vocab_size", None)
        return None if v is None else int(v)

    runner = None  # the models live in the rank processes
    scheduler = None

    # ------------------------------------------------------------------ rank traffic
    def _gather(self, kind: str, timeout_s: float) -> list[tuple]:
        """One message of `kind` from every rank, watching the ranks meanwhile (a failure raises
        RankFailedError naming the rank, every rank gone; later calls raise it again)."""
        try:
            return self._gather_or_raise(kind, timeout_s)
        except RankFailedError as exc:
            self.failure = exc
            self.close()
            raise

    def _gather_or_raise(self, kind: str, timeout_s: float) -> list[tuple]:
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            pending = [self._conns[r] for r in range(self.world_size) if r not in got]
            for c in wait(pending, timeout=_POLL_S):
                r = self._conns.index(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    continue  # the rank is gone: poll() below names it
                if msg[0] != kind:
                    raise RankFailedError(r, None, f"sent {msg[0]!r} while the front-end expected {kind!r}")
                got[r] = msg
            self._ranks.poll()
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in got]
                raise RankFailedError(silent[0], None, f"ranks {silent} sent no {kind!r} within {timeout_s} s")
        return [got[r] for r in range(self.world_size)]

    # ------------------------------------------------------------------ the API
    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self._owner:
            raise InputError(f"request_id: {request.request_id!r} is already in use")
        rank = self.balancer.choose(len(request.prompt_token_ids))
        self._owner[request.request_id] = rank
        self._new[rank].append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            rank = self._owner.get(rid)
            if rank is not None:
                self._aborts[rank].append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[EngineCoreOutput]:
        if self.failure is not None:
            raise RankFailedError(self.failure.rank, self.failure.exitcode, self.failure.detail)
        if not self._finalizer.alive:
            raise RankFailedError(-1, None, "the data-parallel engine is closed")
        t0 = time.perf_counter()
        # a call interrupted while waiting (Ctrl-C) left its step running: collect that one, send nothing new
        if not self._in_flight:
            for r, conn in enumerate(self._conns):
                try:
                    conn.send(("step", self._new[r], self._aborts[r]))
                except OSError:
                    break  # the rank is gone: _gather names it
                self._new[r], self._aborts[r] = [], []
            self._in_flight = True
        replies = self._gather("step", self.timeout_s)
        self._in_flight = False
        outputs: list[EngineCoreOutput] = []
        reports: list[RankStep] = []
        for r, (_, outs, report) in enumerate(replies):
            outputs.extend(outs)
            reports.append(report)
            self.balancer.report(r, report.load)
            self.total.prefill_tokens += report.prefill_tokens
            self.total.decode_tokens += report.decode_tokens
        for o in outputs:
            if o.finished:
                self._owner.pop(o.req_id, None)
        imbalance = self.stats.add_step(reports)
        self.last_reports = reports
        self.total.seconds += time.perf_counter() - t0
        steps = self.stats.working_steps
        if imbalance is not None and self.log_interval and steps % self.log_interval == 0:
            self.log_stats()
        return outputs

    def dp_stats(self) -> dict[str, object]:
        """Placement and per-rank work so far (what `deepinfer bench` writes into its JSON)."""
        return self.stats.as_dict(self.balancer.placed)

    def log_stats(self) -> None:
        s = self.dp_stats()
        logger.info("data-parallel ranks after %d steps: requests %s, tokens %s (imbalance max/mean %.2f, mean per "
                    "step %.2f), empty MoE steps %s, EPLB rebalances %d", self.stats.working_steps,
                    s["requests_per_rank"], s["tokens_per_rank"], s["token_imbalance"], s["mean_step_imbalance"],
                    s["empty_steps_per_rank"], s["eplb_rearrangements"])

    # ------------------------------------------------------------------ lifetime
    @property
    def pids(self) -> list[int]:
        return self._ranks.pids

    def close(self) -> None:
        """Stop the ranks (they return their summaries into `results`) and reap them; idempotent."""
        if self._finalizer.alive:
            if self.stats.working_steps:
                self.log_stats()
            self.results = self._finalizer()

    def __enter__(self) -> DPEngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
