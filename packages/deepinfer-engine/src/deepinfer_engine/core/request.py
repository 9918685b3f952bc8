"""One request's runtime state as the scheduler sees it (token ids and progress only). Pure Python, no torch."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in `waiting`, will recompute its whole prefix
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or (set by the engine) a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # cancelled by the caller
    FINISHED_ERROR = "error"  # can never be served (too long, cache too small); `error` says why

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


class Request:
    """Mutable per-request state: prompt + generated ids and how many of them are in the cache.

    The sequence to be cached is `all_token_ids` = prompt + outputs; `num_computed_tokens` of them are in the
    cache. After preemption `num_computed_tokens` goes back to 0 and the whole sequence is recomputed (the
    outputs so far are kept, so a preempted request resumes exactly where it stopped).
    `payload` is opaque to the core (the engine keeps its SamplingParams there).
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
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.error: str | None = None
        self.stop_reason: int | str | None = None

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
