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
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from deepinfer_engine.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer_engine.engine import EngineCore
    from deepinfer_engine.worker.async_output import AsyncOutput

__all__ = ["AsyncStepLoop"]


class AsyncStepLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._in_flight: tuple[SchedulerOutput, AsyncOutput] | None = None

    @property
    def busy(self) -> bool:
        """A launched step whose results were not returned yet."""
        return self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        core = self.core
        t0 = time.perf_counter()
        sched = core.scheduler.schedule()
        pending: AsyncOutput | None = None
        failure: Exception | None = None
        try:
            pending = core.runner.execute_async(sched)
        except Exception as exc:  # noqa: BLE001 - a failing step must fail its requests, never the engine
            failure = exc
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            prev, prev_out = self._in_flight
            self._in_flight = None
            outputs = self._finish(prev, prev_out)
            core.account(prev, outputs, t0)
            t0 = time.perf_counter()
        if failure is not None:
            core.fail_step(sched, failure)
        if failure is not None or sched.is_empty:
            done = core.scheduler.update_from_output(sched, ModelRunnerOutput())
            core.account(sched, done, t0)
            outputs += done
        else:
            self._in_flight = (sched, pending)
        return outputs

    def _finish(self, sched: SchedulerOutput, out: AsyncOutput) -> list[EngineCoreOutput]:
        try:
            result = out.result()
        except Exception as exc:  # noqa: BLE001 - e.g. a device error surfacing at the read-back
            self.core.fail_step(sched, exc)
            result = ModelRunnerOutput()
        return self.core.scheduler.update_from_output(sched, result)
