"""Per-step agreement of the DP ranks (docs/parallel.md, "Process layout"): every rank of an EP group must run the
same kind of step (prefill steps use the throughput dispatch, decode steps the low-latency one) and the same MoE
layers, so before each step the ranks exchange what they could run, in one small all-gather on the CPU group.

`agree_step` gives every rank the same answer: the step kind chosen by the policy below, and the largest token
count of any rank (what a low-latency dispatch must be sized for, or the CUDA-graph bucket). A rank with nothing
of the chosen kind runs an empty step (T = 0) so the collectives line up.

Policy (`prefill_policy`): "any" = run a prefill step when at least one rank has prompts waiting (prompt latency
first); "all" = only when every rank with work has prompts waiting, otherwise decode (decode latency first). The
engine can alternate them (e.g. "all" normally, "any" every N steps so an isolated rank's prompts are not starved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.state import ParallelState

__all__ = ["StepAgreement", "agree_step"]

StepKind = Literal["prefill", "decode", "idle"]


@dataclass(frozen=True, kw_only=True)
class StepAgreement:
    """kind: what every rank runs now ("idle": no rank has work); per_rank: every rank's (prefill, decode) token
    counts, by rank (for load logging and imbalance statistics)."""

    kind: StepKind
    per_rank: tuple[tuple[int, int], ...]

    @property
    def max_prefill_tokens(self) -> int:
        return max(p for p, _ in self.per_rank)

    @property
    def max_decode_tokens(self) -> int:
        return max(d for _, d in self.per_rank)

    @property
    def max_tokens(self) -> int:
        """Tokens per rank the chosen step must be sized for."""
        return self.max_prefill_tokens if self.kind == "prefill" else self.max_decode_tokens

    @property
    def ranks_with_work(self) -> int:
        return sum(1 for p, d in self.per_rank if p or d)


def agree_step(
    state: ParallelState, *, prefill_tokens: int, decode_tokens: int, prefill_policy: str = "any"
) -> StepAgreement:
    """Collective over the world (one all-gather of two ints per rank on the CPU group): prefill_tokens /
    decode_tokens = what this rank could schedule now. Every rank gets the same StepAgreement."""
    for name, value in (("prefill_tokens", prefill_tokens), ("decode_tokens", decode_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ParallelConfigError(f"{name}: expected an int >= 0, found {value!r}")
    if prefill_policy not in ("any", "all"):
        raise ParallelConfigError(f"prefill_policy: expected 'any' or 'all', found {prefill_policy!r}")
    mine = torch.tensor([prefill_tokens, decode_tokens], dtype=torch.int64)
    if state.world_group is not None and state.world_size > 1:
        parts = [torch.empty_like(mine) for _ in range(state.world_size)]
        dist.all_gather(parts, mine, group=state.cpu_group)
    else:
        parts = [mine]
    per_rank = tuple((int(p), int(d)) for p, d in (t.tolist() for t in parts))
    working = [(p, d) for p, d in per_rank if p or d]
    if not working:
        kind: StepKind = "idle"
    elif any(p for p, _ in working) and (prefill_policy == "any" or all(p for p, _ in working)
                                         or not any(d for _, d in working)):
        kind = "prefill"
    else:
        kind = "decode"
    return StepAgreement(kind=kind, per_rank=per_rank)
