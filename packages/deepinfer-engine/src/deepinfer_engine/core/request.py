"""One request's runtime state as the scheduler sees it (token ids and progress only). Pure Python, no torch."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in `waiting`, will recompute its whole prefix
    FINISHED_STOPPED = "stop"  # EOS or a stop token id (stop strings are the output processor's)
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # cancelled by the caller
    FINISHED_ERROR = "error"  # cannot be served (too long, cache too small, non-finite logits, a failed step)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass(frozen=True, kw_only=True)
class EngineCoreRequest:
    """One sequence handed to the engine core, already validated against the model at admission.

    A prompt with n > 1 samples becomes n of these (one per sample, each with its own id and seed); the output
    processor fans their outputs back in. `sampling` is the engine's SamplingParams, opaque to the core;
    `seed` the resolved seed of the counter-based sampler, in [0, 2**63).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Any
    seed: int
    max_tokens: int | None
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    arrival_index: int = 0
    use_prefix_cache: bool = True  # False: compute every prompt position (e.g. prompt logprobs are wanted)


class Request:
    """Mutable per-request state: prompt + generated ids and how many of them are in the cache.

    The sequence to be cached is `all_token_ids` = prompt + outputs; `num_computed_tokens` of them are in the
    cache. After preemption `num_computed_tokens` goes back to 0 and the whole sequence is recomputed (the
    outputs so far are kept, so a preempted request resumes exactly where it stopped).
    `payload` is opaque to the core (the engine keeps its SamplingParams there).

    This object owns the request's token state: `output_token_ids` is the only list the engine core appends
    sampled ids to; the runner reads it by reference (penalties, min_tokens) and never keeps a copy.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        arrival_index: int = 0,
        payload: Any = None,
        use_prefix_cache: bool = True,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self.arrival_index = arrival_index
        self.payload = payload
        self.use_prefix_cache = use_prefix_cache
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prefix cache (docs/prefix_cache.md): tokens of the first admission served from the cache, of which
        # `num_replayed_tokens` were recomputed (bounded replay)
        self.num_cached_tokens = 0
        self.num_replayed_tokens = 0
        self.error: str | None = None
        self.stop_reason: int | str | None = None

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest) -> Request:
        return cls(r.request_id, r.prompt_token_ids, max_tokens=r.max_tokens, eos_token_ids=r.eos_token_ids,
                   stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos, min_tokens=r.min_tokens,
                   arrival_index=r.arrival_index, payload=r.sampling, use_prefix_cache=r.use_prefix_cache)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Ids at absolute positions [start, stop) of prompt + outputs."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
