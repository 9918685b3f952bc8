"""The per-step contracts between scheduler and model runner (vLLM v1 shape). Pure Python, no torch.

One step = {req_id: num_tokens}: a prefill chunk, a whole prompt, a recompute after preemption and a decode
token are all just "feed these tokens at these positions", so there is no phase flag.

The output is a diff against what the runner already holds (vLLM v1's shape): a request's prompt and sampling
data come once in `new_requests` (again after a preemption, which also drops its pages), and each step's chunk
carries only its new tokens and the pages appended since the runner last saw the request (`new_page_ids`); the
runner keeps every request's block table in its persistent input batch and drops it on `finished_req_ids` /
`preempted_req_ids`.

The records made per request per step (`ScheduledChunk`, `SpecResult`, `EngineCoreOutput`) are not frozen:
a frozen dataclass sets each field through `object.__setattr__` in `__init__` (measured: an `EngineCoreOutput` 2.5 µs
frozen, 0.7 µs not), which at 256 requests was about a millisecond of every speculative round. They are still
treated as immutable: nothing writes a field after construction (derive a new one with `dataclasses.replace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer_engine.core.cache_ops import CacheOps


@dataclass(frozen=True, kw_only=True)
class NewRequestData:
    """Sent the first time the runner sees a request (and again after a preemption, which drops nothing but
    the cache contents): what the sampler needs for the request's whole life.

    `prompt_token_ids` / `output_token_ids` are the scheduler's own lists of the `Request`, passed by reference
    (read-only for the runner): the scheduler appends each sampled id once and the runner sees it there.
    """

    req_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    sampling: Any  # the engine's SamplingParams (opaque to the core)
    seed: int  # resolved seed of the counter-based RNG (requests without a seed get one from the engine)


@dataclass(kw_only=True)  # not frozen: built per request per step (module docstring)
class ScheduledChunk:
    """Tokens [start_position, start_position + len(token_ids)) of one request, fed in this step.

    `new_page_ids` are the pages appended to the request's block table since the runner last saw it (all of
    them the first time and after a preemption); the runner's table is the concatenation (page of token t =
    table[t // page_size]). `slot` its per-sequence state slot; `sample` is True when the chunk ends at the request's last known token, i.e. the
    step produces its next token. `output_index` = number of tokens the request has generated so far (the RNG
    offset of the token sampled now).
    """

    req_id: str
    token_ids: tuple[int, ...]
    start_position: int
    slot: int
    new_page_ids: tuple[int, ...]
    sample: bool
    output_index: int
    num_prompt_tokens: int
    # speculative decoding: drafts the runner may verify after this chunk's one token (budget and pages are
    # reserved for them; 0 = plain decode). The runner reports what it emitted in ModelRunnerOutput.spec.
    num_spec_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def with_token_ids(self, token_ids: tuple[int, ...]) -> ScheduledChunk:
        """This chunk feeding `token_ids` instead (speculative decoding: the verify chunk [g, d_1 .. d_m]).
        `dataclasses.replace` without its field introspection: ~2 µs less per speculating request per round."""
        return ScheduledChunk(req_id=self.req_id, token_ids=token_ids, start_position=self.start_position,
                              slot=self.slot, new_page_ids=self.new_page_ids, sample=self.sample,
                              output_index=self.output_index, num_prompt_tokens=self.num_prompt_tokens,
                              num_spec_tokens=self.num_spec_tokens)


@dataclass(frozen=True, kw_only=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # batch order (running requests first, then newly admitted)
    new_requests: tuple[NewRequestData, ...] = ()
    finished_req_ids: frozenset[str] = frozenset()  # runner may drop their state
    preempted_req_ids: frozenset[str] = frozenset()
    cache_ops: CacheOps | None = None  # prefix cache copies to apply before the forward (docs/prefix_cache.md)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.req_id: c.num_tokens for c in self.chunks}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, kw_only=True)
class TokenLogprobs:
    """Log-probabilities (raw model distribution) at one position: the chosen token and the top ones."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(kw_only=True)  # not frozen: built per request per step (module docstring)
class SpecResult:
    """One request's speculative round: `token_ids` = accepted drafts then the correction / bonus token (in
    order, 1 .. 1 + num_accepted ids); drafts proposed / verified by the target / accepted."""

    token_ids: tuple[int, ...]
    num_draft_tokens: int
    num_verified_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True, kw_only=True)
class ModelRunnerOutput:
    """sampled_token_ids: one per chunk with sample=True, except rows listed in `errors` (req_id -> why the
    request cannot continue, e.g. non-finite logits); the scheduler finishes those with finish_reason "error"."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # new prompt positions only
    errors: dict[str, str] = field(default_factory=dict)
    # requests that ran a speculative round (instead of an entry in sampled_token_ids)
    spec: dict[str, SpecResult] = field(default_factory=dict)


@dataclass(kw_only=True)  # not frozen: built per request per step (module docstring)
class EngineCoreOutput:
    """What changed for one sequence in one engine-core step: the delta the output processor consumes.

    new_token_ids: ids sampled this step (the core keeps the full list; this is only the news). finish_reason:
    "stop" (EOS or a stop token id; stop_reason = that id, None for EOS), "length", "abort", "error" (`error`
    says why) or None while running. A finishing delta is the last one for its request id.
    """

    req_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    new_prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # speculative decoding counts of this step (drafts proposed / verified / accepted; 0 without speculation)
    num_draft_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_replayed_tokens: int = 0  # of those, recomputed by the bounded replay

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
