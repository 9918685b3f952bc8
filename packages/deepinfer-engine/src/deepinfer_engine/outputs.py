"""Typed results of `LLM.generate` / `LLM.chat` (vLLM field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer_engine.core.sched_output import TokenLogprobs

__all__ = ["CompletionOutput", "RequestOutput", "RequestMetrics", "TokenLogprobs"]


@dataclass(kw_only=True)
class CompletionOutput:
    """One sample of a request.

    finish_reason: "stop" (EOS, stop string or stop token id), "length" (max_tokens / max_model_len),
    "abort", "error" (see RequestOutput.error), None while running. stop_reason: the stop string or token id
    that ended it. logprobs: one TokenLogprobs per generated token when requested. For chat, `reasoning_content`,
    `content` and `tool_calls` hold the recipe's parse of the generated ids; `parse_error` names the problem when
    the recipe could not parse them (those three are then None and `text` is the raw output).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    parse_error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True)
class RequestMetrics:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_replayed_tokens: int = 0  # of num_cached_tokens, recomputed by the bounded replay (docs/prefix_cache.md)
    # speculative decoding (all samples of the request together; 0 without speculation): drafts proposed,
    # drafts the target verified, drafts accepted, and the speculative rounds (verify steps) they came from
    num_draft_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per speculative round (accepted drafts + the correction / bonus token); None
        before any round."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps


@dataclass(kw_only=True)
class RequestOutput:
    """Result for one prompt, in input order. `error` says why when a sample finished with finish_reason
    "error": the request could not be served at all (a prompt longer than max_model_len or than the whole cache:
    every sample), its logits turned non-finite, or the step computing it failed (the samples concerned).
    `token_ids` of each output is the only copy of its ids outside the engine core, filled from the core's deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's name; docs/prefix_cache.md)
