"""A speculative round's state between `SpecDecoder.begin` and its read-back, and the host time the rounds spent
(worker/spec_decode.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from deepinfer_dspark import DraftProposal, LatencyModel
from torch import Tensor

from deepinfer_engine.core.sched_output import ScheduledChunk, SpecResult

__all__ = ["SpecRound", "SpecTiming"]


@dataclass(kw_only=True)
class SpecRound:
    """One step's speculative state between `begin` and `finish` (B = verifying requests, round order)."""

    chunks: tuple[ScheduledChunk, ...]  # the step's chunks; verify chunks carry [g, d_1 .. d_m]
    index: dict[str, int]  # req_id -> b
    req_ids: list[str] = field(default_factory=list)
    proposal: DraftProposal | None = None
    drafts_host: list[int] = field(default_factory=list)
    survival_host: np.ndarray | None = None  # [B, N] float64 survivals the policy ranked (None: no confidence head)
    positions: Tensor | None = None  # [B] int64 anchor positions p
    seeds: Tensor | None = None  # [B] int64
    # [B, 5] int64 (anchor id, position, slot, max drafts, seed): the drafts' inputs; (position, seed) key the
    # verification's uniforms
    inputs_host: np.ndarray | None = None
    temps_host: Tensor | None = None  # [B] float32 on the host, 0 on greedy rows
    greedy: list[bool] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # per b: first logits row of its m + 1 rows
    started: float = 0.0  # perf_counter when the round began (before the draft pass)
    captured_before: float = 0.0  # the graphs' capture seconds when the round began (`SpecDecoder.capture_clock`)
    forward_started: float = 0.0  # ... when the draft pass and the policy were done (the target step begins)
    keep: dict[str, int] = field(default_factory=dict)  # rows of each chunk now part of its sequence
    results: dict[str, SpecResult] = field(default_factory=dict)
    hidden: Tensor | None = None  # the target's final streams [T, n, d] (drafters that read them: MTP)
    features: dict[int, Tensor] = field(default_factory=dict)  # captured target features, until collected
    num_tokens: int = 0  # query tokens of the step
    rows: int = 0  # rows its forward ran (num_tokens, or a replayed graph's padded rows): the latency model's Q
    launched_at: float = 0.0  # perf_counter when the verification was enqueued
    latency: LatencyModel | None = None  # the curve that priced the round (`SpecDecoder.latency_for`)
    # lagged cost: (shape, survival, max_drafts, base tokens, padding, greedy rows, all greedy) of the round
    lag_inputs: tuple | None = None
    timer: tuple[Any, Any] | None = None  # CUDA events around forward + verification (reads deferred on CUDA)


@dataclass
class SpecTiming:
    """Host wall time of the speculative rounds since the last `reset_stats` (perf_counter sums; the two host reads
    of a round synchronise the device, so on a GPU these are device-inclusive). draft_s: round start to the end
    of the draft pass and the policy (its host read); verify_s: from there to the host read of the verification
    (input preparation, the target forward, verification); finish_s: the bookkeeping after that read (results,
    statistics, draft-context insertion)."""

    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_s: float = 0.0
    # of draft_s: the verification policy's own host time (schedule_verification), which the cost policy spends more
    # of than the others
    policy_s: float = 0.0
    # lagged cost: the search over a round's survivals for the next round's budget, run before the round's host
    # read (while the device finishes the round; not in launch_s)
    lag_s: float = 0.0
    # of draft_s: round start to the end of the drafts' host read (the draft pass on the device, and the host work
    # before it); the rest of draft_s is host work after the read
    drafted_s: float = 0.0
    # of verify_s: from the forward's start to the verification's last launch (host time: input preparation, the
    # forward's launch or replay, the verification's launches); the rest of verify_s waits for the device
    launch_s: float = 0.0
    # rows the forward ran (a graph's row bucket) -> [rounds, verify seconds]: what each step size cost as run,
    # against the latency model's price of it
    by_rows: dict[int, list[float]] = field(default_factory=dict)
    # draft-ahead (`SpecDecoder.draft_ahead`): rounds whose drafts the previous step launched, of them those that
    # took a subset of the drafted rows (requests left the batch), and rounds that launched their own because a
    # request was not drafted ahead or its inputs changed
    ahead_used: int = 0
    ahead_selected: int = 0
    ahead_missed: int = 0
    # of drafted_s: rounds whose host ran the policy's previous call while the device still drafted (`begin`), and
    # its seconds
    warmed: int = 0
    warm_s: float = 0.0
    # the rounds' statistics and calibration updates, run after the next draft pass's launch (`SpecDecoder._flush`)
    deferred_s: float = 0.0
    # of drafted_s: rounds whose counts the device decided behind the draft pass (`SpecDecoder.decide_on_device`),
    # and the host's seconds planning and enqueueing those decisions (while the device drafted)
    decided: int = 0
    decide_s: float = 0.0

    def add_verify(self, rows: int, seconds: float) -> None:
        self.verify_s += seconds
        entry = self.by_rows.setdefault(int(rows), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def as_dict(self) -> dict[str, Any]:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "draft_ms": 1e3 * self.draft_s / n, "verify_ms": 1e3 * self.verify_s / n,
                "finish_ms": 1e3 * self.finish_s / n, "policy_ms": 1e3 * self.policy_s / n,
                "drafted_ms": 1e3 * self.drafted_s / n, "launch_ms": 1e3 * self.launch_s / n,
                "lag_ms": 1e3 * self.lag_s / n, "ahead_used": self.ahead_used,
                "ahead_selected": self.ahead_selected, "ahead_missed": self.ahead_missed, "warmed": self.warmed,
                "warm_ms": 1e3 * self.warm_s / n, "deferred_ms": 1e3 * self.deferred_s / n,
                "decided": self.decided, "decide_ms": 1e3 * self.decide_s / n,
                "verify_ms_by_rows": {r: [int(c), round(1e3 * t / c, 4)] for r, (c, t) in sorted(self.by_rows.items())}}
