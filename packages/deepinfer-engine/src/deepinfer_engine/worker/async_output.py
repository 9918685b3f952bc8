"""Results of a launched step read back without stalling the launch of the next one (asynchronous scheduling).

`AsyncOutput(step, collect)` enqueues non-blocking copies of the step's sampled ids and logprobs into pinned host
memory on a side stream that first waits for the compute stream, then records an event; nothing waits. Its
`result()` (called one engine iteration later, while the next step runs) waits for that event only and packages
the host copies with the runner's `collect`. A speculative step's verification result (`LaunchedStep.spec_packed`)
is copied the same way. `token_ids()` gives the host ids alone (waits for the copy; the runner's launches never
call it). On CPU the copies are plain tensors and nothing is asynchronous.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer_engine.core.sched_output import ModelRunnerOutput
from deepinfer_engine.worker.model_runner import LaunchedStep

__all__ = ["AsyncOutput"]


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class AsyncOutput:
    """The pending host copy of one launched step's results."""

    def __init__(self, step: LaunchedStep, collect: Callable[..., ModelRunnerOutput], *,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        self._collect = collect
        self._event: torch.cuda.Event | None = None
        self._result: ModelRunnerOutput | None = None
        self._consumed = False  # result() was called (it may have raised: a failed read-back is not retried)
        cuda = any(t is not None and t.device.type == "cuda" for t in (
            step.token_ids, step.spec_packed, *(step.prompt_logprobs or ())[:1]))
        if not cuda:
            self._step = step
            return
        # the copies must follow the sampler on the compute stream; on a side stream they do not delay the next
        # step's launches behind the copy engine
        main = torch.cuda.current_stream()
        stream = copy_stream if copy_stream is not None else main
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            self._step = dataclasses.replace(
                step,
                token_ids=_to_host(step.token_ids),
                spec_packed=_to_host(step.spec_packed),
                logprobs=None if step.logprobs is None else tuple(_to_host(t) for t in step.logprobs),
                prompt_logprobs=None if step.prompt_logprobs is None else tuple(
                    _to_host(t) for t in step.prompt_logprobs),
            )
            self._event = torch.cuda.Event()
            self._event.record(stream)
        # the device tensors were allocated on the compute stream and are read on the copy stream
        for t in (step.token_ids, step.spec_packed, *(step.logprobs or ()), *(step.prompt_logprobs or ())):
            if t is not None and t.device.type == "cuda":
                t.record_stream(stream)

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def token_ids(self) -> list[int]:
        """Host list of the step's sampled ids (INVALID_TOKEN rows included); waits for the copy."""
        self._wait()
        return [] if self._step.token_ids is None else self._step.token_ids.tolist()

    @property
    def collected(self) -> bool:
        """result() ran, successfully or not."""
        return self._consumed

    def result(self, drop: frozenset[str] = frozenset()) -> ModelRunnerOutput:
        """The step's output (computed once). drop: requests finished since the launch (speculative rows of
        those are not reported or counted, `ModelRunner.collect`); only the first call's set applies."""
        if self._result is None:
            if self._consumed:
                raise RuntimeError("AsyncOutput.result: this step's read-back already failed")
            self._consumed = True
            self._wait()
            self._result = self._collect(self._step, drop)
        return self._result
