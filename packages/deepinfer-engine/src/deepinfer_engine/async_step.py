"""The engine-core iteration of asynchronous scheduling (docs/async_scheduling.md).

One call of `step()`:
  1. schedule step N+1 (the async scheduler counts step N's outputs as placeholders),
  2. launch it (`runner.execute_async`: forward + sampler enqueued, continuing rows read their input ids from
     step N's sampled ids on the device, the results are copied to pinned host memory behind an event),
  3. wait for step N's copy only now, and turn it into deltas (`scheduler.update_from_output`) while N+1 runs,
  4. return step N's deltas.
So `step()` returns the deltas of the step launched by the previous call; the last one is drained by one more
call (`busy` keeps `EngineCore.has_unfinished_requests` true meanwhile). A step whose launch or whose read-back
raises fails exactly its requests, as in the synchronous loop; the step before it is still reported first.

Speculative decoding (`collect_first=True`) reorders the call: the next round needs the accepted drafts of the
previous one (its positions, pages and anchor token) and its draft context, so step N is read back and applied
first, then step N+1 is scheduled (by the synchronous scheduler, no placeholders) and launched, and step N's
deltas are returned while N+1's forward and verification run: the caller's output processing (detokenization,
stop strings, streaming) overlaps the device. Requests finished by the caller meanwhile (stop string, abort) have
their rows of the step in flight dropped, as in the placeholder loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from deepinfer_engine.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer_engine.engine import EngineCore
    from deepinfer_engine.worker.async_output import AsyncOutput

__all__ = ["AsyncStepLoop"]


class AsyncStepLoop:
    def __init__(self, core: EngineCore, *, collect_first: bool = False) -> None:
        self.core = core
        self.collect_first = collect_first  # speculative decoding: read step N back before scheduling N+1
        self._in_flight: tuple[SchedulerOutput, AsyncOutput] | None = None
        self._owners: dict[str, Any] = {}  # collect_first: the Request object of each chunk of the step in flight

    @property
    def busy(self) -> bool:
        """A launched step whose results were not returned yet."""
        return self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        core = self.core
        t0 = time.perf_counter()
        outputs: list[EngineCoreOutput] = []
        if self.collect_first:  # read step N back (and apply it) before scheduling N + 1
            outputs, t0 = self._collect(t0)
            sched = core.scheduler.schedule()
            pending, failure = self._launch(sched)
        else:  # launch step N + 1, then read step N back while N + 1 runs
            sched = core.scheduler.schedule()
            pending, failure = self._launch(sched)
            outputs, t0 = self._collect(t0)
        outputs += self._settle(sched, pending, failure, t0)
        if self.collect_first and self._in_flight is not None:
            self._owners = {c.req_id: core.scheduler.requests[c.req_id] for c in sched.chunks}
        return outputs

    def _launch(self, sched: SchedulerOutput) -> tuple[AsyncOutput | None, Exception | None]:
        try:
            return self.core.runner.execute_async(sched), None
        except Exception as exc:  # noqa: BLE001 - a failing step must fail its requests, never the engine
            return None, exc

    def _collect(self, t0: float) -> tuple[list[EngineCoreOutput], float]:
        """The outputs of the step in flight (none: []) and the time the next step's accounting starts from."""
        if self._in_flight is None:
            return [], t0
        core = self.core
        prev, prev_out = self._in_flight
        self._in_flight = None
        drop: frozenset[str] = frozenset()
        if self.collect_first:
            requests = core.scheduler.requests
            # finished (stop string, abort, error) or replaced by a new request of the same id since the launch
            drop = frozenset(rid for rid, req in self._owners.items()
                             if req.is_finished or requests.get(rid) is not req)
        outputs = self._finish(prev, prev_out, drop)
        core.account(prev, outputs, t0)
        return outputs, time.perf_counter()

    def _settle(self, sched: SchedulerOutput, pending: AsyncOutput | None, failure: Exception | None,
                t0: float) -> list[EngineCoreOutput]:  # fmt: skip
        """A step that failed to launch, or had nothing to run, ends now; a launched one stays in flight."""
        core = self.core
        if failure is not None:
            core.fail_step(sched, failure)
        if failure is not None or sched.is_empty:
            done = core.scheduler.update_from_output(sched, ModelRunnerOutput())
            core.account(sched, done, t0)
            return done
        self._in_flight = (sched, pending)
        return []

    def _finish(self, sched: SchedulerOutput, out: AsyncOutput, drop: frozenset[str] = frozenset()
                ) -> list[EngineCoreOutput]:  # fmt: skip
        try:
            result = out.result(drop) if drop else out.result()
        except Exception as exc:  # noqa: BLE001 - e.g. a device error surfacing at the read-back
            self.core.fail_step(sched, exc)
            result = ModelRunnerOutput()
        return self.core.scheduler.update_from_output(sched, result)
