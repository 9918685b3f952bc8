"""Request placement over the data-parallel ranks by load, and the per-rank imbalance statistics
(docs/parallel.md, "Engine integration"). Pure Python.

A new request goes to the rank with the fewest tokens of work: queued prompt tokens not computed yet plus the
context tokens of its running requests, as reported after the last step, plus the prompt tokens placed on it
since that report. Ties go to the rank with more free cache pages (after the pages its unreported requests
will need), then to the lowest rank. A rank whose free pages cannot hold the prompt comes after every rank that
can. Not round-robin: a long prompt and several short ones end up on different ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer_engine.dp.rank_core import RankLoad, RankStep

__all__ = ["DPStats", "LoadBalancer"]


class LoadBalancer:
    """Chooses a rank for each request from the ranks' last load reports."""

    def __init__(self, loads: Sequence[RankLoad], *, page_size: int) -> None:
        self.page_size = max(page_size, 1)
        self.loads = list(loads)
        self.pending_tokens = [0] * len(loads)  # placed since the rank's last report
        self.pending_pages = [0] * len(loads)
        self.placed = [0] * len(loads)

    def choose(self, num_tokens: int) -> int:
        pages = -(-num_tokens // self.page_size)

        def key(r: int) -> tuple[int, int, int, int]:
            free = self.loads[r].free_pages - self.pending_pages[r]
            return (0 if free >= pages else 1, self.loads[r].tokens + self.pending_tokens[r], -free, r)

        rank = min(range(len(self.loads)), key=key)
        self.pending_tokens[rank] += num_tokens
        self.pending_pages[rank] += pages
        self.placed[rank] += 1
        return rank

    def report(self, rank: int, load: RankLoad) -> None:
        """A rank's load after a step: it includes every request sent to it so far."""
        self.loads[rank] = load
        self.pending_tokens[rank] = 0
        self.pending_pages[rank] = 0


@dataclass
class DPStats:
    """Per-rank work over the engine's life: tokens run, empty MoE steps, steps by agreed kind; the imbalance
    of a step = max / mean of the ranks' tokens in it (1.0 = even), averaged over steps with work."""

    world_size: int
    tokens: list[int] = field(default_factory=list)
    empty_steps: list[int] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)
    imbalance_sum: float = 0.0
    rearrangements: int = 0

    def __post_init__(self) -> None:
        self.tokens = self.tokens or [0] * self.world_size
        self.empty_steps = self.empty_steps or [0] * self.world_size

    def add_step(self, reports: Sequence[RankStep]) -> float | None:
        kind = reports[0].kind
        self.steps[kind] = self.steps.get(kind, 0) + 1
        if kind == "idle":
            return None
        work = [r.prefill_tokens + r.decode_tokens for r in reports]
        for i, (r, w) in enumerate(zip(reports, work)):
            self.tokens[i] += w
            self.empty_steps[i] += int(r.empty)
        self.rearrangements += int(reports[0].rebalanced)
        mean = sum(work) / len(work)
        imbalance = max(work) / mean if mean else 1.0
        self.imbalance_sum += imbalance
        return imbalance

    @property
    def working_steps(self) -> int:
        return sum(n for k, n in self.steps.items() if k != "idle")

    def as_dict(self, placed: Sequence[int]) -> dict[str, object]:
        total = sum(self.tokens)
        mean = total / self.world_size if self.world_size else 0.0
        return {
            "world_size": self.world_size,
            "requests_per_rank": list(placed),
            "tokens_per_rank": list(self.tokens),
            "empty_steps_per_rank": list(self.empty_steps),
            "steps_by_kind": dict(self.steps),
            "token_imbalance": (max(self.tokens) / mean) if mean else 1.0,
            "mean_step_imbalance": self.imbalance_sum / self.working_steps if self.working_steps else 1.0,
            "eplb_rearrangements": self.rearrangements,
        }
