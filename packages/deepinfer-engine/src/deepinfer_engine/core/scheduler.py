"""Continuous batching with chunked prefill under a token budget, LCFS preemption (recompute) when pages run out.

Pure Python, no torch. Shape follows vLLM v1: each step schedules {req_id: num_tokens} over running requests
first (decode tokens and unfinished prefill chunks), then admits waiting requests FIFO while budget, sequence
count, slots and pages allow.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterable

from deepinfer_engine.core.kv_cache import KVCacheManager
from deepinfer_engine.core.request import Request, RequestStatus
from deepinfer_engine.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledChunk,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        *,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        num_spec_tokens: int = 0,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.num_spec_tokens = num_spec_tokens  # speculative decoding: most drafts per decode chunk (0 = off)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the runner next step
        self._pending_updates: list[EngineCoreOutput] = []  # finished outside a model step (errors, aborts)
        self._seeds: dict[str, int] = {}
        self._pages_sent: dict[str, int] = {}  # pages of each running request the runner already holds
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request, *, seed: int = 0) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        self._seeds[request.request_id] = seed
        error = self._never_fits(request)
        if error is not None:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=error)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _never_fits(self, req: Request) -> str | None:
        n = req.num_prompt_tokens
        if n == 0:
            return "prompt is empty: give at least one token"
        if n >= self.max_model_len:
            return (f"prompt has {n} tokens but max_model_len is {self.max_model_len} (prompt + output must fit): "
                    f"shorten the prompt or raise max_model_len")
        if not self.kv.can_ever_fit(n):
            return (f"prompt has {n} tokens and needs {self.kv.pages_for(n)} cache pages of {self.kv.page_size} "
                    f"tokens, but the whole cache has {self.kv.num_pages} pages "
                    f"({self.kv.num_pages * self.kv.page_size} tokens): raise kv_cache_memory_bytes")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (f"prompt has {n} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens}, and "
                    f"chunked prefill is off: enable_chunked_prefill=True or raise max_num_batched_tokens")
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def fail_requests(self, request_ids: Iterable[str], error: str) -> None:
        """Finish with finish_reason "error" (e.g. the step that computed them raised); reported next step."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ERROR, error=error)

    def _finish(self, req: Request, status: RequestStatus, *, error: str | None = None, emit: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self._pages_sent.pop(req.request_id, None)
        req.status = status
        req.error = error
        self._finished_ids.add(req.request_id)
        if emit:
            self._pending_updates.append(
                EngineCoreOutput(req_id=req.request_id, finish_reason=status.finish_reason,
                                 stop_reason=req.stop_reason, error=error, num_preemptions=req.num_preemptions)
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_updates(self) -> bool:
        return bool(self._pending_updates)

    def get_request(self, request_id: str) -> Request:
        return self.requests[request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request (the engine calls this after reporting it)."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            self._seeds.pop(request_id, None)

    # ------------------------------------------------------------------ one step
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self._pages_sent.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (recompute %d tokens)", req.request_id, req.num_tokens)

    # Hook points (overridden by the asynchronous scheduler, core/async_scheduler.py): the synchronous scheduler
    # knows every token of a running request when it schedules the next step.
    def _num_tokens(self, req: Request) -> int:
        """Tokens the request will hold once its outputs in flight have landed (prompt + outputs)."""
        return req.num_tokens

    def _token_ids(self, req: Request, start: int, stop: int) -> list[int]:
        """Ids fed at positions [start, stop)."""
        return req.token_slice(start, stop)

    def _scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """Called once the step's chunks are fixed (before the step runs)."""

    def _accept_output(self, req: Request, chunk: ScheduledChunk) -> bool:
        """Whether this chunk's result still applies to `req`; records the chunk as computed when it does."""
        if req.status is not RequestStatus.RUNNING:
            return False  # aborted while the step ran
        req.num_computed_tokens += chunk.num_tokens
        return True

    def _chunk_len(self, req: Request, budget: int) -> int:
        n = min(self._num_tokens(req) - req.num_computed_tokens, budget)
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def _spec_len(self, req: Request, n: int, budget: int) -> int:
        """Drafts a decode chunk may verify: budget and pages are reserved for them; never more than the
        request may still emit after its one guaranteed token (max_tokens, max_model_len)."""
        if self.num_spec_tokens <= 0 or n != 1 or req.num_output_tokens == 0:
            return 0
        if req.num_tokens - req.num_computed_tokens != 1:
            return 0
        k = min(self.num_spec_tokens, budget - n, self.max_model_len - req.num_tokens - 1)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _admit_len(self, req: Request, budget: int) -> int | None:
        """Tokens of a waiting request's first chunk from its (possibly prefix-cached) start; None when the prompt
        does not fit the budget and chunked prefill is off."""
        n = self._chunk_len(req, budget)
        if n < req.num_tokens - req.num_computed_tokens and not self.enable_chunked_prefill:
            return None
        return n

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        planned: list[tuple[Request, int]] = []
        spec: dict[str, int] = {}
        new_reqs: list[Request] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_len(req, budget)
            if n <= 0:
                i += 1
                continue
            if not self.kv.can_ever_fit(req.num_computed_tokens + n):
                total = req.num_computed_tokens + n
                self._finish(req, RequestStatus.FINISHED_ERROR, error=(
                    f"sequence reached {total} tokens, more than the whole cache holds "
                    f"({self.kv.num_pages} pages x {self.kv.page_size} tokens): raise kv_cache_memory_bytes or "
                    f"lower max_tokens / max_model_len"))
                continue
            k = self._spec_len(req, n, budget)
            # drafts only where their pages fit without preempting; those pages hold the chunk's own token too
            reserved = k > 0 and self.kv.allocate(req, n + k)
            if reserved:
                spec[req.request_id] = k
                budget -= k
            ok = True
            while not reserved and not self.kv.allocate(req, n):
                victim = self.running[-1]  # most recently admitted first (LCFS)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            planned.append((req, n))
            self.kv.plan_step(req, req.num_computed_tokens, req.num_computed_tokens + n)  # prefix cache
            budget -= n
            i += 1

        if not preempted:
            w = 0
            prior = list(self.running)  # fork sources: their slots hold what they computed (admitted ones' do not yet)
            while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[w]
                if self.kv.waits_for_inflight(req):  # its next page is computed this step: share it next step
                    w += 1
                    continue
                n = self.kv.admit(req, prior, functools.partial(self._admit_len, budget=budget))
                if n is None:
                    break
                del self.waiting[w]
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                new_reqs.append(req)
                planned.append((req, n))
                self.kv.plan_step(req, req.num_computed_tokens, req.num_computed_tokens + n)
                budget -= n

        chunks = []
        pages_sent = self._pages_sent
        for req, n in planned:
            rid = req.request_id
            pages = self.kv.page_ids(rid)
            sent = pages_sent.get(rid, 0)
            pages_sent[rid] = len(pages)
            start, total, prompt = req.num_computed_tokens, self._num_tokens(req), len(req.prompt_token_ids)
            chunks.append(ScheduledChunk(
                req_id=rid,
                token_ids=tuple(self._token_ids(req, start, start + n)),
                start_position=start,
                slot=self.kv.slot(rid),
                new_page_ids=tuple(pages[sent:]) if sent < len(pages) else (),  # a diff: the runner keeps the table
                sample=start + n == total,
                output_index=total - prompt,
                num_prompt_tokens=prompt,
                num_spec_tokens=spec.get(rid, 0),
            ))
        new_data = tuple(
            NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                           output_token_ids=r.output_token_ids, sampling=r.payload,
                           seed=self._seeds.get(r.request_id, 0))
            for r in new_reqs
        )
        self._scheduled(chunks)
        finished = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(chunks=tuple(chunks), new_requests=new_data, finished_req_ids=finished,
                               preempted_req_ids=frozenset(preempted), cache_ops=self.kv.take_ops())

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        updates = self._pending_updates
        self._pending_updates = []
        prompt_lps, errors, spec, logprobs = out.prompt_logprobs, out.errors, out.spec, out.logprobs
        for chunk in sched.chunks:
            rid = chunk.req_id
            req = self.requests.get(rid)
            if req is None or not self._accept_output(req, chunk):
                continue
            self.kv.commit(req, upto=chunk.start_position + chunk.num_tokens)  # its full pages become shareable
            plp = tuple(prompt_lps[rid]) if rid in prompt_lps else ()
            error = errors.get(rid) if errors else None
            if error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR, error=error, emit=False)
                updates.append(EngineCoreOutput(req_id=rid, new_prompt_logprobs=plp, finish_reason="error",
                                                error=error, num_preemptions=req.num_preemptions))
                continue
            if not chunk.sample:
                if plp:
                    updates.append(EngineCoreOutput(req_id=rid, new_prompt_logprobs=plp))
                continue
            sr = spec.get(rid) if spec else None
            toks = tuple(sr.token_ids) if sr is not None else (out.sampled_token_ids[rid],)
            # a speculative round: the accepted drafts were fed at the positions after the chunk's token, so
            # they are in the cache now; the last emitted token is the next one to feed
            req.num_computed_tokens += len(toks) - 1
            emitted, status = self._append_outputs(req, toks)
            lp = logprobs.get(rid) if logprobs else None
            if status is not None:
                self._finish(req, status, emit=False)
            updates.append(EngineCoreOutput(
                req_id=rid, new_token_ids=emitted, new_logprobs=(lp,) if lp is not None else (),
                new_prompt_logprobs=plp, finish_reason=status.finish_reason if status is not None else None,
                stop_reason=req.stop_reason, num_preemptions=req.num_preemptions,
                num_draft_tokens=sr.num_draft_tokens if sr else 0,
                num_verified_tokens=sr.num_verified_tokens if sr else 0,
                num_accepted_tokens=sr.num_accepted_tokens if sr else 0,
                num_cached_tokens=req.num_cached_tokens, num_replayed_tokens=req.num_replayed_tokens))
        return updates

    def _append_outputs(self, req: Request, toks: tuple[int, ...]) -> tuple[tuple[int, ...], RequestStatus | None]:
        """Append a step's sampled ids to the request up to the first stop condition (later ids of a speculative
        round are dropped): (the ids appended, the stop status or None)."""
        out_ids = req.output_token_ids
        last = len(out_ids) + len(toks)  # outputs once every id is in
        # nearly every step: no id is a stop id and the last one reaches no length limit (checked id by id below,
        # which is what this short cut answers for the whole step at once)
        if ((req.max_tokens is None or last < req.max_tokens) and len(req.prompt_token_ids) + last < self.max_model_len
                and req.stop_token_ids.isdisjoint(toks) and (req.ignore_eos or req.eos_token_ids.isdisjoint(toks))):
            out_ids.extend(toks)
            return toks, None
        for i, tok in enumerate(toks):
            out_ids.append(tok)
            status = self._stop_status(req, tok)
            if status is not None:
                return toks[: i + 1], status
        return toks, None

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        if req.num_output_tokens >= req.min_tokens:
            if not req.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in req.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.max_tokens is not None and req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
