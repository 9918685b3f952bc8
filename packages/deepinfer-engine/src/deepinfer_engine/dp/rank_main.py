"""The loop of one spawned rank process: build its `DPRankCore`, report ready, then serve the front-end's
commands from its pipe until told to stop (docs/parallel.md, "Engine integration").

Commands (tuples, picklable): ("step", new requests, request ids to abort) -> ("step", output deltas, RankStep);
("stop",) -> the loop returns (SpawnedRanks reports the return value). The front-end sends "step" to every rank
each iteration, so every rank runs the same number of lock-step steps. Anything raised ends the process with
its traceback (SpawnedRanks turns it into RankFailedError naming this rank).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from deepinfer_parallel import ParallelState

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.kv_cache import CachePlan
from deepinfer_engine.dp.rank_core import DPRankCore, RankLoad

__all__ = ["RankInfo", "serve_rank"]


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Sent once a rank is ready: its cache plan and sequence limit, the checkpoint experts of its slots per
    backbone MoE layer, the load of its (empty) engine."""

    rank: int
    max_model_len: int
    max_num_seqs: int
    plan: CachePlan
    held_experts: list[Sequence[int]]
    load: RankLoad


def serve_rank(state: ParallelState, config: EngineConfig, conns: Sequence[Connection],
               token_map: Any = None) -> dict[str, Any]:
    """`SpawnedRanks` target: rank `state.rank` talks to the front-end through `conns[state.rank]`."""
    # Ctrl-C reaches the whole process group: the front-end decides (it stops or kills the ranks), a rank dying
    # on its own would only turn the interrupt into a rank failure
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = conns[state.rank]
    rank = DPRankCore(config, state, token_map=token_map)
    conn.send(("ready", RankInfo(
        rank=state.rank, max_model_len=rank.max_model_len, max_num_seqs=rank.scheduler.max_num_seqs,
        plan=rank.plan, held_experts=[tuple(h) for h in rank.experts.held_experts()], load=rank.load(),
    )))  # fmt: skip
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] != "step":
            raise ValueError(f"rank {state.rank}: unknown command {msg[0]!r} from the front-end")
        _, new, aborts = msg
        for request in new:
            rank.add_request(request)
        if aborts:
            rank.abort_requests(aborts)
        outputs, report = rank.step_report()
        conn.send(("step", outputs, report))
    return {"steps": rank.steps, "rearrangements": rank.experts.num_rearrangements,
            "held_experts": [tuple(h) for h in rank.experts.held_experts()]}
