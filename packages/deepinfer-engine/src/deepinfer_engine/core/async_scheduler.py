"""The scheduler of asynchronous scheduling: plans step N+1 while step N's sampled ids are still on the device.

Pure Python, no torch. Same policy as `Scheduler` (budget, chunked prefill, LCFS preemption); what changes is
the bookkeeping (docs/async_scheduling.md):

* A request's scheduled-but-not-returned outputs are counted as placeholders (`num_in_flight`, at most one per
  request: the engine keeps one step in flight). Budgets, page allocation, `sample` and the RNG offset
  (`output_index`) count them as tokens, so a decode row for the next position is scheduled before its input id
  is known. Its id in `ScheduledChunk.token_ids` is `PLACEHOLDER_TOKEN`; the runner takes the real id from the
  previous step's sampled ids on the device.
* `num_computed_tokens` advances when a chunk is scheduled (the next step is planned on top of it), not when its
  result comes back.
* A result lands one step late: the real id replaces the placeholder; a stop found then ends the request, whose
  extra row in the step already in flight is computed and dropped. A request preempted while its output was in
  flight keeps that output (it was computed from the right prefix): it is appended before the recompute.
* A request whose in-flight output will end it by length (max_tokens, max_model_len) is not scheduled again, so
  length stops cost no extra row and never allocate past the request's end.
"""

from __future__ import annotations

from deepinfer_engine.core.request import Request, RequestStatus
from deepinfer_engine.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from deepinfer_engine.core.scheduler import Scheduler

__all__ = ["PLACEHOLDER_TOKEN", "AsyncScheduler"]

# Input id of a position whose token is the previous step's (not yet returned) sample. Never a vocabulary id.
PLACEHOLDER_TOKEN = -1
_MAX_OUTSTANDING = 4


class AsyncScheduler(Scheduler):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._in_flight: dict[str, int] = {}  # req_id -> outputs scheduled whose ids are not back yet
        # per scheduled step (by id of its SchedulerOutput): the Request object of each chunk. A result lands one
        # step late and applies only to the object it was computed for, never to a later request that reuses
        # the id of one that finished meanwhile.
        # (the engine keeps one step in flight, so at most two are outstanding; an entry whose step was never
        # updated (an interrupt between schedule and launch) is dropped once _MAX_OUTSTANDING newer ones exist)
        self._owners: dict[int, dict[str, Request]] = {}
        self._updating: dict[str, Request] = {}

    def num_in_flight(self, request_id: str) -> int:
        return self._in_flight.get(request_id, 0)

    def schedule(self) -> SchedulerOutput:
        sched = super().schedule()
        self._owners[id(sched)] = {c.req_id: self.requests[c.req_id] for c in sched.chunks}
        while len(self._owners) > _MAX_OUTSTANDING:
            del self._owners[next(iter(self._owners))]
        return sched

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self._updating = self._owners.pop(id(sched), {})
        try:
            return super().update_from_output(sched, out)
        finally:
            self._updating = {}

    # ------------------------------------------------------------------ hooks of Scheduler
    def _num_tokens(self, req: Request) -> int:
        return req.num_tokens + self._in_flight.get(req.request_id, 0)

    def _token_ids(self, req: Request, start: int, stop: int) -> list[int]:
        known = req.num_tokens
        if stop <= known:
            return req.token_slice(start, stop)
        return req.token_slice(start, known) + [PLACEHOLDER_TOKEN] * (stop - max(start, known))

    def _chunk_len(self, req: Request, budget: int) -> int:
        pending = self._in_flight.get(req.request_id, 0)
        if pending and self._ends_by_length(req, pending):
            return 0
        return super()._chunk_len(req, budget)

    def _ends_by_length(self, req: Request, pending: int) -> bool:
        """The outputs in flight bring the request to max_tokens or max_model_len (it finishes when they land)."""
        if req.max_tokens is not None and req.num_output_tokens + pending >= req.max_tokens:
            return True
        return req.num_tokens + pending >= self.max_model_len

    def _scheduled(self, chunks: list[ScheduledChunk]) -> None:
        for c in chunks:
            req = self.requests[c.req_id]
            req.num_computed_tokens += c.num_tokens
            if c.sample:
                self._in_flight[c.req_id] = self._in_flight.get(c.req_id, 0) + 1

    def _accept_output(self, req: Request, chunk: ScheduledChunk) -> bool:
        if req.is_finished or self._updating.get(chunk.req_id) is not req:
            return False  # stopped, aborted or failed while this step ran (or its id was reused): row dropped
        if chunk.sample:
            left = self._in_flight.get(req.request_id, 0) - 1
            if left < 0:
                raise RuntimeError(f"async scheduler: output of {req.request_id!r} returned with none in flight")
            if left:
                self._in_flight[req.request_id] = left
            else:
                self._in_flight.pop(req.request_id, None)
        # RUNNING, or PREEMPTED while the step ran (num_computed_tokens is already 0: the output is still kept)
        return req.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    def _finish(self, req: Request, status: RequestStatus, *, error: str | None = None, emit: bool = True) -> None:
        self._in_flight.pop(req.request_id, None)
        super()._finish(req, status, error=error, emit=emit)

    def has_in_flight(self) -> bool:
        return bool(self._in_flight)
