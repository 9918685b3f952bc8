"""Attention data parallelism + expert-parallel MoE in the engine (docs/parallel.md, "Engine integration").

`core_from_config(config)` builds the engine core of `LLMEngine` when data_parallel_size > 1 or
enable_expert_parallel is set: inside a `torchrun` world (RANK / WORLD_SIZE in the environment) this process is
one rank (`DPRankCore`, SPMD: every process serves its own prompts, stepping in lock-step with the others);
otherwise the caller's process is the front-end of N spawned ranks (`DPEngineCore`).
"""

from __future__ import annotations

import os

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.dp.front_end import DPEngineCore
from deepinfer_engine.dp.placement import DPStats, LoadBalancer
from deepinfer_engine.dp.rank_core import DPRankCore, RankLoad, RankStep
from deepinfer_engine.errors import ConfigError

__all__ = ["DPEngineCore", "DPRankCore", "DPStats", "LoadBalancer", "RankLoad", "RankStep", "core_from_config",
           "in_torchrun_world", "uses_data_parallel"]


def uses_data_parallel(config: EngineConfig) -> bool:
    par = config.parallel
    return par.data_parallel_size > 1 or par.enable_expert_parallel


def in_torchrun_world() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def core_from_config(config: EngineConfig) -> DPEngineCore | DPRankCore:
    if not in_torchrun_world():
        return DPEngineCore(config)
    from deepinfer_parallel import ParallelConfigError, ParallelState

    from deepinfer_engine.engine import resolve_device

    world = int(os.environ["WORLD_SIZE"])
    n = config.parallel.data_parallel_size
    if world != n:
        raise ConfigError(f"data_parallel_size: found {n}, but this torchrun world has WORLD_SIZE={world}; one rank "
                          "per process. Fix: data_parallel_size=WORLD_SIZE (torchrun --nproc-per-node)")
    device = resolve_device(config.model.device)
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    backend, dev = ("nccl", f"cuda:{local}") if device.type == "cuda" else ("gloo", "cpu")
    try:
        state = ParallelState.from_env(config.parallel.to_parallel(), backend=backend, device=dev)
    except ParallelConfigError as exc:
        raise ConfigError(str(exc)) from exc
    return DPRankCore(config, state, spmd=True)
