"""The model runner of asynchronous scheduling: launches step N+1 before step N's sampled ids reach the host.

Rows whose input id is `PLACEHOLDER_TOKEN` (the async scheduler's decode rows) take it from the previous step's
sampled ids, which stay on the device: one index_copy of a gather into the step's input ids, no device -> host ->
device round trip (docs/async_scheduling.md). The host copy of the inputs (`StepHost.input_ids`) gets 0 there:
no model reads input ids on the host (V4.1's Engram row ids are hashed on the device from these ids and the
cache's device token ring), so no launch waits for the previous step's ids; the host ids are only
range-checked, and sampled ids are in range by construction. A row whose previous sample was invalid (NaN logits:
its request fails when that output lands) is fed id 0 and dropped.

Penalties count the output ids; the host lists lag by the in-flight token, so rows with penalties get it
appended on the device.

Speculative steps: the verification result is copied back like the sampled ids; `collect` reads it, inserts the
step's draft context and reports the round (worker/spec_decode.py `launch_verify` / `collect_verify`). The draft
pass of the next step reads that context, so a speculative step is collected before the next launch (the engine
loop does; `execute_async` enforces it).

`execute_async(sched) -> AsyncOutput`; `execute(sched)` (the synchronous call) stays available and gives the same
results, so the async engine loop and direct callers share one runner.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_engine.core.async_scheduler import PLACEHOLDER_TOKEN
from deepinfer_engine.core.sched_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from deepinfer_engine.errors import InputError
from deepinfer_engine.worker.async_output import AsyncOutput, ReadbackPool
from deepinfer_engine.worker.input_batch import StepInputs
from deepinfer_engine.worker.model_runner import ModelRunner
from deepinfer_engine.worker.sampler import SamplingBatch

__all__ = ["AsyncModelRunner"]


@dataclasses.dataclass(frozen=True)
class _Feed:
    """The last launched step's sampled ids: on the device (rows by request) and their pending host copy."""

    row_of: dict[str, int]
    token_ids: torch.Tensor  # [rows] int64 on the device
    output: AsyncOutput


class AsyncModelRunner(ModelRunner):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._feed: _Feed | None = None  # the step the next one reads its placeholder ids from
        self._prev: _Feed | None = None  # during a launch: the step before it
        self._launched: tuple[list[str], torch.Tensor] | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._readback = ReadbackPool() if self.device.type == "cuda" else None
        self._last: AsyncOutput | None = None  # the last launched step
        if self.spec is not None:
            self.spec.deferred_reads = True


    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput) -> AsyncOutput:
        """Launch the step; its results come from `.result()` of the returned object (after the next launch)."""
        if self.spec is not None and self._last is not None and not self._last.collected:
            # a speculative step's collect inserts its draft context (read by the next draft pass) from features
            # the next forward may overwrite (CUDA-graph buffers): it must run first. The engine loop collects
            # before it launches (async_step.py); this covers any other caller.
            self._last.result()
        self._last = None
        self._prev, self._feed, self._launched = self._feed, None, None
        try:
            step = self.launch(sched)
        finally:
            self._prev = None
        out = AsyncOutput(step, self.collect, copy_stream=self._copy_stream, pool=self._readback)
        self._last = out
        if self._launched is not None:
            ids, tokens = self._launched
            self._feed = _Feed(row_of={rid: i for i, rid in enumerate(ids)}, token_ids=tokens, output=out)
        self._launched = None
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(sched).result()

    # ------------------------------------------------------------------ hooks of ModelRunner
    def _placeholder_rows(self, chunks: tuple[ScheduledChunk, ...]) -> tuple[list[int], list[str]]:
        """Rows (and their requests) fed a placeholder. With one step in flight a placeholder is the last token
        of its chunk; one anywhere else would reach the model as id -1 and fail its input check."""
        rows, rids = [], []
        t = 0
        for c in chunks:
            t += c.num_tokens
            if c.token_ids[-1] == PLACEHOLDER_TOKEN:
                rows.append(t - 1)
                rids.append(c.req_id)
        return rows, rids

    def _source_rows(self, rids: list[str]) -> list[int]:
        feed = self._prev
        missing = [r for r in rids if feed is None or r not in feed.row_of]
        if missing:
            raise InputError(f"scheduler output: placeholder ids of {missing} but the previous step sampled no "
                             "token for them; expected placeholders only for rows sampled in the step just before")
        return [feed.row_of[r] for r in rids]

    def _resolve_placeholders(self, sched: SchedulerOutput, inp: StepInputs) -> None:
        rows, rids = self._placeholder_rows(sched.chunks)
        if not rows:
            return
        src = self._source_rows(rids)
        k = len(rows)
        if src == rows == list(range(k)):  # steady decode: row i takes the previous step's row i, one launch
            torch.clamp(self._prev.token_ids[:k], min=0, out=inp.input_ids[:k])
        else:
            src_dst = self.staging.tensor([src, rows], torch.int64)  # one small copy for both index vectors
            ids = self._prev.token_ids.index_select(0, src_dst[0]).clamp_(min=0)
            inp.input_ids.index_copy_(0, src_dst[1], ids)
        inp.host.input_ids[rows] = 0  # the real ids exist on the device only (nothing reads them on the host)

    def _complete_sampling(self, sbatch: SamplingBatch, chunks: list[ScheduledChunk]) -> SamplingBatch:
        if sbatch.penalties is None:
            return sbatch
        pending = [i for i, c in enumerate(chunks) if c.token_ids[-1] == PLACEHOLDER_TOKEN]
        if not pending:
            return sbatch
        prompt_ids, output_ids, *rest = sbatch.penalties
        dev = output_ids.device
        extra = torch.full((output_ids.shape[0], 1), -1, dtype=torch.int64, device=dev)
        src = self._source_rows([chunks[i].req_id for i in pending])
        src_dst = self.staging.tensor([src, pending], torch.int64)
        extra.index_copy_(0, src_dst[1], self._prev.token_ids.index_select(0, src_dst[0])[:, None])
        # the in-flight token goes last: -1 (an invalid sample) counts as padding
        return dataclasses.replace(sbatch, penalties=(prompt_ids, torch.cat([output_ids, extra], dim=1), *rest))

    def _sampled(self, req_ids: list[str], token_ids: torch.Tensor | None) -> None:
        self._launched = (req_ids, token_ids) if token_ids is not None and req_ids else None
