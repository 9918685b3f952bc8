"""Results of a launched step read back without stalling the launch of the next one (asynchronous scheduling).

`AsyncOutput(step, collect)` enqueues non-blocking copies of the step's sampled ids and logprobs into pinned host
memory on a side stream that first waits for the compute stream, then records an event; nothing waits. Its
`result()` (called one engine iteration later, while the next step runs) waits for that event only and packages
the host copies with the runner's `collect`. A speculative step's verification result (`LaunchedStep.spec_packed`)
is copied the same way. `token_ids()` gives the host ids alone (waits for the copy; the runner's launches never
call it). On CPU the copies are plain tensors and nothing is asynchronous.

Host cost per step matters here (a B = 1 decode step is host-bound when its host work outgrows the graph replay):
the pinned buffers and events come from a `ReadbackPool` that the runner keeps, so a step allocates no pinned
memory and creates no event. A buffer returns to the pool once `result()` turned it into Python values; an output
that is dropped unread keeps its buffer (the pool makes a new one). The device tensors stay referenced until the
copy is waited for, so the caching allocator cannot hand their memory to the compute stream while the side stream
still reads it (no `record_stream`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer_engine.core.sched_output import ModelRunnerOutput
from deepinfer_engine.worker.model_runner import LaunchedStep

__all__ = ["AsyncOutput", "ReadbackPool"]


_ALIGN = 16  # bytes: each read-back tensor starts at an aligned offset of its slot's buffer


class _Slot:
    """One pinned byte buffer, the event recorded after the copies into it, and the event the copy stream waits
    on (recorded on the compute stream)."""

    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.done = torch.cuda.Event()
        self.ready = torch.cuda.Event()


class ReadbackPool:
    """Pinned read-back buffers (and their events) reused across steps: `acquire(nbytes)` gives a free slot of at
    least nbytes, `release(slot)` returns it once its copies were waited for and read."""

    def __init__(self) -> None:
        self._free: list[_Slot] = []

    def acquire(self, nbytes: int) -> _Slot:
        for i, slot in enumerate(self._free):
            if slot.host.shape[0] >= nbytes:
                return self._free.pop(i)
        return _Slot(1 << max(8, (nbytes - 1).bit_length()))

    def release(self, slot: _Slot) -> None:
        if len(self._free) < 8:  # a handful cover the steps in flight; more would only pin memory
            self._free.append(slot)


def _nbytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


class AsyncOutput:
    """The pending host copy of one launched step's results."""

    def __init__(self, step: LaunchedStep, collect: Callable[..., ModelRunnerOutput], *,
                 copy_stream: torch.cuda.Stream | None = None, pool: ReadbackPool | None = None) -> None:
        self._collect = collect
        self._event: torch.cuda.Event | None = None
        self._result: ModelRunnerOutput | None = None
        self._consumed = False  # result() was called (it may have raised: a failed read-back is not retried)
        self._pool, self._slot, self._keep = pool, None, None
        self._ids: list[int] | None = None
        tensors = [step.token_ids, step.spec_packed, *(step.logprobs or ()), *(step.prompt_logprobs or ())]
        dev = [t for t in tensors if t is not None and t.device.type == "cuda"]
        if not dev:
            self._step = step
            return
        pool = pool if pool is not None else ReadbackPool()
        slot = self._slot = pool.acquire(sum(_nbytes(t) for t in dev))
        # the copies must follow the sampler on the compute stream; on a side stream they do not delay the next
        # step's launches behind the copy engine
        main = torch.cuda.current_stream()
        stream = copy_stream if copy_stream is not None else main
        if stream is not main:
            slot.ready.record(main)
            stream.wait_event(slot.ready)
        offset = 0
        hosts: dict[int, torch.Tensor] = {}
        with torch.cuda.stream(stream):
            for t in dev:
                n = t.numel() * t.element_size()
                host = slot.host[offset : offset + n].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                hosts[id(t)] = host
                offset += _nbytes(t)
            slot.done.record(stream)
        self._event = slot.done
        self._keep = dev  # read on the copy stream: referenced until the copy was waited for

        def host_of(t: torch.Tensor | None) -> torch.Tensor | None:
            return hosts.get(id(t), t) if t is not None else None

        self._step = dataclasses.replace(
            step,
            token_ids=host_of(step.token_ids),
            spec_packed=host_of(step.spec_packed),
            logprobs=None if step.logprobs is None else tuple(host_of(t) for t in step.logprobs),
            prompt_logprobs=None if step.prompt_logprobs is None else tuple(
                host_of(t) for t in step.prompt_logprobs),
        )

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = self._keep = None

    def token_ids(self) -> list[int]:
        """Host list of the step's sampled ids (INVALID_TOKEN rows included); waits for the copy."""
        if self._ids is not None:  # result() ran and gave its buffer back
            return list(self._ids)
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
            if self._slot is not None and self._pool is not None:  # collect turned the host copies into values
                self._ids = [] if self._step.token_ids is None else self._step.token_ids.tolist()
                self._step = dataclasses.replace(self._step, token_ids=None, spec_packed=None, logprobs=None,
                                                 prompt_logprobs=None)
                self._pool.release(self._slot)
                self._slot = None
        return self._result
