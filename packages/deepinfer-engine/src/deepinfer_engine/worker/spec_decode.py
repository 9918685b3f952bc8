"""Speculative decoding inside one engine step (docs/dspark.md "Engine integration").

The scheduler reserves token budget and cache pages for up to `ScheduledChunk.num_spec_tokens` drafts after a
decode chunk's one token (the golden token g at position p). Per step, for the decode chunks that may speculate:

1. `begin`: propose a block of N drafts per request with the draft model (`deepinfer_dspark.propose`; its rings
   hold the target context of positions < p), choose how many to verify (`schedule_verification`: verify_all,
   threshold or cost), and extend each chunk to `[g, d_1 .. d_m]` at positions p .. p + m.
2. The runner runs ONE target forward over every chunk of the step (prefill chunks, plain decode chunks and the
   verify chunks) and captures the draft model's target layers.
3. `finish`: exact verification (`deepinfer_dspark.verify`: greedy argmax agreement, or rejection sampling
   against the target distribution after temperature / top-k / top-p / min-p), statistics, the latency model's
   online correction, and the draft context: the target features of every position this step made part of a
   sequence (all rows of prefill / plain chunks, rows 0 .. num_accepted of verify chunks) go into the draft rings
   (a CUDA graph replay when the step keeps at most k + 1 rows per sequence, `insert_runner`).

Rollback needs no copying: every cache family is addressed by absolute position, so the rows the verify forward
wrote for rejected drafts (window rings, compressor state, compressed pages, index keys, Engram token ring) are
overwritten when the sequence reaches those positions again; the rings keep `slack` extra rows so a rollback of
up to slack + 1 positions leaves the rows the next step reads intact (`ModelCache.check_resume` guards it). The
draft rings are written only for accepted positions. The scheduler advances `num_computed_tokens` by the
accepted drafts only.

Requests that need per-token state the verifier does not model (penalties, logprobs, min_tokens still pending)
decode without drafts in the same batch; they are sampled by the runner's sampler as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from deepinfer_dspark import (
    AcceptanceStats,
    DraftProposal,
    LatencyModel,
    StepPadding,
    SurvivalCalibration,
    TargetLogits,
    VerifyPolicy,
    allocate,
    allocate_above,
    cost_budget,
    cost_cutoff,
    plan_schedule,
    propose,
    row_plan,
    schedule_on_device,
    schedule_verification,
    verify,
    verify_counter_uniforms_host,
)
from deepinfer_kernels.sampling import logsumexp_rows, mask_logits
from torch import Tensor

from deepinfer_engine.core.sched_output import ScheduledChunk, SpecResult
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
from deepinfer_engine.worker.cuda_graph import pick_bucket
from deepinfer_engine.worker.spec_round import SpecRound, SpecTiming
from deepinfer_engine.worker.staging import HostStaging

__all__ = ["DEVICE_BOUND_WAIT_S", "SpecDecoder", "cuda_busy", "round_observations"]

# a round whose host read waited longer than this for the device was bound by the device's forward (a read of a
# finished result takes tens of microseconds): its span times the forward. A shorter wait means the host's own
# launch work set the span, which then bounds the forward from above only (`round_observations`).
DEVICE_BOUND_WAIT_S = 100e-6
# the survival calibration learns from one speculative round in this many (`SpecDecoder.calibration`)
CALIBRATE_EVERY = 4
# the lagged cost policy searches its budget on one round in this many and keeps it for the rounds between, while
# their shape stays (`SpecDecoder.next_budget`)
BUDGET_EVERY = 4


def cuda_busy() -> bool:
    """Whether the current CUDA stream still runs work enqueued before this call (an event recorded now and
    queried: no wait)."""
    event = torch.cuda.Event()
    event.record()
    return not event.query()


def round_observations(latency: LatencyModel, rows: int, host_s: float, span_s: float) -> tuple[float, float | None]:
    """What a synchronous round tells the latency model: (floor, forward span or None). host_s: the host's own
    seconds from the forward's launch to its read; span_s: up to the read's end. The host's time is the floor's
    observation. The span is the forward's when the read waited on the device; otherwise the forward ended within
    the host's work and the span is only an upper bound on it, which corrects the curve only where the curve
    predicts more than it (a profile that overstates the forward is pulled down even while the host is the bound,
    and a host-bound span never raises the forward: `LatencyModel` class docstring, floor)."""
    if span_s - host_s > DEVICE_BOUND_WAIT_S or span_s < latency.forward(rows):
        return host_s, span_s
    return host_s, None


class SpecDecoder:
    """The per-step speculative flow over a `deepinfer_dspark.DraftModel` (the model's draft stages).

    drafter: the DraftModel, with `slots` (the cache slot of each request of a round) and
        `insert_context(batch, features)` (writes the draft rings for accepted positions).
    capture: target layer ids whose features the drafter reads (the forward captures them).
    max_drafts: the most drafts a request verifies per step (the scheduler's reservation; default the block
        size): a CUDA-graphed verify step pads each sequence to at most max_drafts + 1 rows.
    latency: the cost policy's curve for steps no batch curve prices (eager steps, small graph batches);
        batch_latency: {graph batch bucket: its curve over the ragged row buckets} (`spec_profile`).
    explore_every: with the cost policy and online latency correction, every explore_every-th round verifies
        every draft (0 = never). The online correction only moves the curve near the step sizes the policy
        picks; a start-up profile that overstates the cost of large verify steps would otherwise never be
        corrected there (seen on the H200: docs/perf.md, DSpark policies on the H200).
    """

    def __init__(
        self,
        drafter: Any,
        *,
        policy: VerifyPolicy,
        latency: LatencyModel | None,
        capture: tuple[int, ...],
        max_position: int,
        online_latency: bool = True,
        explore_every: int = 32,
        max_drafts: int | None = None,
        batch_latency: Mapping[int, LatencyModel] | None = None,
    ) -> None:
        if explore_every < 0:
            raise ValueError(f"SpecDecoder.explore_every: expected >= 0, found {explore_every}")
        self.drafter = drafter
        self.policy = policy
        self.latency = latency
        self.batch_latency = dict(batch_latency or {})
        self.capture = tuple(capture)
        self.max_position = int(max_position)
        self.online_latency = online_latency
        self.explore_every = int(explore_every)
        self.rounds = 0  # rounds that verified drafts (the exploration schedule counts these)
        self.explored = 0
        self.block_size = int(drafter.block_size)
        self.max_drafts = self.block_size if max_drafts is None else int(max_drafts)
        if not 1 <= self.max_drafts <= self.block_size:
            raise ValueError(f"SpecDecoder.max_drafts: expected 1..{self.block_size}, found {self.max_drafts}")
        self._stats = AcceptanceStats(self.block_size)
        # rounds read but not yet counted (`_flush`): (accepted, verified, survivals, greedy rows or None)
        self._deferred: list[tuple[list[int], list[int], np.ndarray | None, np.ndarray | None]] = []
        self.timing = SpecTiming()
        # asynchronous scheduling reads a round back after other host work (worker/async_runner.py): its forward
        # is then timed by CUDA events (CPU: up to the end of the launch), not up to the host read
        self.deferred_reads = False
        # the ragged CUDA graphs that replay verify steps: batch bucket -> its row buckets (worker/cuda_graph.py
        # `verify_row_sizes`); None: eager
        self.graph_rows: dict[int, tuple[int, ...]] | None = None
        self._paddings: dict[int, StepPadding] = {}  # StepPadding per batch bucket of graph_rows
        self._stage: HostStaging | None = None  # pinned staging of each round's host inputs (`_staging`)
        # lagged cost policy, per class (0: rounds with sampled rows, 1: all-greedy rounds): ((speculating
        # requests, other query tokens, graph batch bucket), value) of the latest search, for the next rounds of
        # that class and shape (another shape runs the search): a budget K for class 0, a survival cutoff
        # (`cost_cutoff`) for class 1; and the rounds each value has been kept (`BUDGET_EVERY`)
        self._carried: list[tuple[tuple[int, int, int | None], float] | None] = [None, None]
        self._lag_age = [0, 0]
        # the draft-context insertion as a CUDA graph replay (worker/cuda_graph.py `run_insert`): (ctx, slots,
        # kept rows, first feature rows, features, rows per sequence) -> whether it replayed (False: eager)
        self.insert_runner: Callable[..., bool] | None = None
        # (start, forward span, capture clock at its read, the curve that priced it) of the previous round
        self._last_cycle: tuple[float, float, float, LatencyModel] | None = None
        # draft-ahead: the synchronous runner launches the next round's draft pass as soon as a round's results are
        # read (`launch_ahead`), so the device drafts while the host runs the scheduler and the output processing;
        # `begin` takes those drafts when its requests and their inputs are the ones drafted (`_take_ahead`)
        self.draft_ahead = False
        self._ahead: tuple[list[str], np.ndarray, Tensor, Any, DraftProposal] | None = None
        # seconds the engine's CUDA graphs spent capturing so far (None: no graphs): a round during which a graph
        # was captured (lazily, on a shape's first step) is not timed into the latency model, whose curve and
        # overhead would otherwise learn a capture's second as step time
        self.capture_clock: Callable[[], float] | None = None
        # on a device: whether the host would wait for the work queued so far (`cuda_busy`); then `begin` warms the
        # policy's code with its previous call (`_warm`, per policy) before it reads the drafts. None: never
        self.device_busy: Callable[[], bool] | None = None
        self._warm: dict[VerifyPolicy, tuple[Callable, tuple, dict]] = {}
        # on: while the device still drafts, `begin` enqueues the policy's decision behind the draft pass
        # (`deepinfer_dspark.schedule_on_device`, where the policy allows it) and reads the counts with the drafts.
        # Off by default: as eager torch ops (6-40 launches) it tied the host's NumPy decision on the H200 at best,
        # and lost up to 0.58 ms per round at 32 requests (docs/dspark.md "The decision on the device")
        self.decide_on_device = False
        # the cost policy prices survivals through the acceptance seen at their level, per sampling class (greedy
        # rows accept a draft on another event than the head was trained for: deepinfer_dspark.survival_calibration)
        self.calibration: SurvivalCalibration | None = None

    def set_policy(self, policy: VerifyPolicy, latency: LatencyModel | None = None, *,
                   online_latency: bool | None = None, batch_latency: Mapping[int, LatencyModel] | None = None) -> None:
        """Switch the verification policy of a running engine (benchmarks compare policies on one load). A new
        `latency` replaces the batch curves too (by `batch_latency`, none by default): the given curve prices
        every step."""
        if policy.kind == "cost" and latency is None and self.latency is None:
            raise ValueError("set_policy: the cost policy needs a LatencyModel")
        self.policy = policy
        self._carried = [None, None]
        if latency is not None:
            self.latency = latency
            self.batch_latency = dict(batch_latency or {})
        if online_latency is not None:
            self.online_latency = online_latency

    @property
    def stats(self) -> AcceptanceStats:
        """Acceptance statistics since `reset_stats` (the deferred updates of the rounds read so far applied)."""
        self._flush()
        return self._stats

    def _flush(self) -> None:
        """The statistics and the survival calibration of the rounds read since the last call. `collect_verify`
        defers them: the next draft pass needs neither, so they run after its launch (`launch_ahead`), while the
        device drafts, instead of between the round's read and that launch, where the device idled through them
        (0.22 ms of host time per round on the CPU engine at 128 requests: docs/perf.md)."""
        if not self._deferred:
            return
        started = time.perf_counter()
        pending, self._deferred = self._deferred, []
        for accepted, verified, surv, greedy in pending:
            self._stats.update(accepted, verified, survival=surv)
            if greedy is not None and self.calibration is not None:
                self.calibration.update(surv, np.asarray(verified), np.asarray(accepted), greedy)
        self.timing.deferred_s += time.perf_counter() - started

    def reset_stats(self) -> AcceptanceStats:
        """Start a new run's statistics; returns the previous accumulator."""
        self._flush()
        old, self._stats = self._stats, AcceptanceStats(self.block_size)
        self.timing = SpecTiming()
        return old

    # ------------------------------------------------------------------------------------------ which requests
    def speculates(self, chunk: ScheduledChunk, st: Any) -> bool:
        """Whether this decode chunk runs a speculative round (the verifier models the request's sampling)."""
        if chunk.num_spec_tokens <= 0 or chunk.num_tokens != 1 or not chunk.sample:
            return False
        if chunk.start_position + self.block_size > self.max_position:  # the draft block's positions must exist
            return False
        p = st.params
        return p.logprobs is None and not p.uses_penalties and len(st.output_ids) >= p.min_tokens

    def padding(self, chunks: Sequence[ScheduledChunk], speculating: Mapping[str, int]) -> StepPadding | None:
        """The ragged shape the step's forward will replay (`graph_rows`: a CUDA graph per batch bucket and row
        bucket), None when it runs eagerly: a chunk other than a verify chunk or a one-token decode chunk (a prefill
        chunk), or more sequences than the largest graph batch. The cost policy prices a step by its row bucket
        (docs/dspark.md "Verification policies")."""
        if self.graph_rows is None or any(c.num_tokens != 1 for c in chunks if c.req_id not in speculating):
            return None
        b = pick_bucket(len(chunks), sorted(self.graph_rows))
        if b is None:
            return None
        padding = self._paddings.get(b)
        if padding is None or padding.sizes != self.graph_rows[b]:  # kept per bucket: built (checked) once
            padding = self._paddings[b] = StepPadding(b, self.graph_rows[b], ragged=True)
        return padding

    def latency_for(self, padding: StepPadding | None) -> LatencyModel | None:
        """The curve that prices a step: its graph batch bucket's (`batch_latency`), else `latency`."""
        if padding is not None and padding.ragged:
            return self.batch_latency.get(padding.batch, self.latency)
        return self.latency

    # ------------------------------------------------------------------------------------------ 1. propose
    @torch.no_grad()
    def begin(self, chunks: Sequence[ScheduledChunk], states: Mapping[str, Any], device: torch.device) -> SpecRound:
        self._flush()  # a round read without `launch_ahead` after it (`finish`): the policy reads the calibration
        started = time.perf_counter()  # the step the policy trades against includes the draft pass
        captured = self.capture_clock() if self.capture_clock is not None else 0.0
        ahead, self._ahead = self._ahead, None  # drafts launched ahead serve the next step only
        picked = [c for c in chunks if self.speculates(c, states[c.req_id])]
        can_draft = getattr(self.drafter, "can_draft", None)
        if can_draft is not None:  # drafters whose draft comes from the previous step (MTP)
            picked = [c for c in picked if can_draft(c.slot, c.start_position)]
        rnd = SpecRound(chunks=tuple(chunks), index={c.req_id: b for b, c in enumerate(picked)})
        last, self._last_cycle = self._last_cycle, None
        if not picked:
            return rnd
        if last is not None and self.online_latency and last[2] == captured:
            # the previous round's whole cycle (round start to this round's start) less its forward: the draft
            # pass, the policy, the bookkeeping, the scheduler and the output processing. None of it grows with
            # the verified drafts, but all of it is step time the policy trades a draft's cost against; it grows
            # with the batch, so it is the overhead of the curve that priced that round
            last[3].observe_overhead(max(started - last[0] - last[1], 0.0))
        sts = [states[c.req_id] for c in picked]
        rnd.req_ids = [c.req_id for c in picked]
        rnd.params = [s.params for s in sts]
        rnd.greedy = [bool(p.greedy) for p in rnd.params]
        host = np.asarray([[c.token_ids[0], c.start_position, c.slot, min(c.num_spec_tokens, self.block_size),
                            s.seed & 0x7FFFFFFFFFFFFFFF] for c, s in zip(picked, sts)], dtype=np.int64)
        dev = self._staging(device).tensor(host, torch.int64)  # pinned: a pageable copy waits for the stream
        rnd.positions, rnd.seeds = dev[:, 1], dev[:, 4]
        # on the host: propose reads the greedy / sampled split there and copies it over without a device sync
        temps = torch.tensor([0.0 if g else float(p.temperature) for g, p in zip(rnd.greedy, rnd.params)],
                             dtype=torch.float32)
        rnd.inputs_host, rnd.temps_host = host, temps
        prop = self._take_ahead(ahead, rnd.req_ids, host, temps)
        if prop is None:
            prop = self._propose(host, dev, temps)
        base = sum(c.num_tokens for c in chunks if c.req_id not in rnd.index)
        n = self.block_size
        self.rounds += 1
        policy = self.policy
        if (policy.kind == "cost" and self.online_latency and self.latency is not None and self.explore_every
                and self.rounds % self.explore_every == 0):
            policy = VerifyPolicy(kind="verify_all")  # sample the curve at the large step sizes too
            self.explored += 1
        padding = self.padding(chunks, rnd.index)
        rnd.latency = self.latency_for(padding)
        shape = (len(picked), base, None if padding is None else padding.batch)
        # rounds with sampled rows allocate a count searched on an earlier round (the lag keeps the choice
        # non-anticipating); all-greedy rounds verify the drafts above a carried survival cutoff: at temperature 0
        # the number of drafts worth verifying varies by about 12% from round to round (bimodal survivals), which a
        # count cannot follow and a cutoff does (`next_budget`). Without one for this shape, the round searches
        deterministic = all(rnd.greedy)
        surv = prop.survival()
        kept = self._carried[deterministic] if policy.kind == "cost" and policy.lagged and surv is not None else None
        value = kept[1] if kept is not None and kept[0] == shape else None
        lagged = None if deterministic or value is None else int(value)
        cutoff = value if deterministic else None
        on_device = self.decide_on_device and policy.kind != "verify_all"
        warm = self._warm.get(self.policy)
        # asked only when something would use the answer (an event recorded and queried per call)
        busy = (surv is not None and self.device_busy is not None and (on_device or warm is not None)
                and self.device_busy())
        decided = None
        if busy and on_device:
            # the host would wait for the draft pass here: it plans the decision and the device runs it right
            # after the drafts, so the one read below brings the counts too
            decided = self._decide_on_device(policy, rnd, host, dev, surv, base, padding, lagged, cutoff, device)
        # the policy runs on the host otherwise: it is a few small sorts and scans, and m is needed there anyway
        # (the verify chunks' tokens); one copy brings the drafts, the survivals (and the device's counts) over
        cols = [prop.draft_ids.to(torch.float64)]
        cols += [] if surv is None else [surv.to(torch.float64)]
        cols += [] if decided is None else [decided[:, None].to(torch.float64)]
        wide = torch.cat(cols, 1) if len(cols) > 1 else cols[0]
        if busy and decided is None and warm is not None:
            # the host is about to wait for the draft pass: it runs this policy's previous call meanwhile and throws
            # the result away, so that this round's call finds its code and data in the caches (on the CPU a call
            # after the round's other host work took 4-6x a repeat of it: docs/dspark.md "Verification policies")
            warm_started = time.perf_counter()
            warm[0](*warm[1], **warm[2])
            self.timing.warm_s += time.perf_counter() - warm_started
            self.timing.warmed += 1
        wide = wide.cpu().numpy()  # the one host read before the forward
        self.timing.drafted_s += time.perf_counter() - started
        policy_started = time.perf_counter()
        survival = None if surv is None else wide[:, n: 2 * n].astype(np.float32)
        if decided is not None:
            m = torch.from_numpy(wide[:, -1].astype(np.int64))
        else:
            if lagged is not None:
                # the top K by this round's survivals (`next_budget`)
                call: tuple[Callable, tuple, dict] = (allocate, (survival, host[:, 3], lagged), {})
            elif cutoff is not None:
                call = (allocate_above, (survival, host[:, 3], cutoff), {})  # a threshold's work (`next_budget`)
            else:
                ranked, price = survival, None  # the survivals as the cost policy ranks and prices them
                if policy.kind == "cost" and self.calibration is not None and survival is not None:
                    ranked, price = self._priced(survival, rnd.greedy)
                call = (schedule_verification, (policy, host[:, 3]), dict(
                    survival=ranked, latency=rnd.latency, base_tokens=base, deterministic=deterministic,
                    padding=padding, price=price))
            m = call[0](*call[1], **call[2])
            if self.device_busy is not None and policy is self.policy:  # not an exploration round's verify_all
                self._warm[policy] = call
        if self.policy.kind == "cost" and self.policy.lagged and survival is not None and rnd.latency is not None:
            # `next_budget`, after the launch
            rnd.lag_inputs = (shape, survival, host[:, 3], base, padding, rnd.greedy, deterministic)
        self.timing.policy_s += time.perf_counter() - policy_started
        ids = wide[:, :n].astype(np.int64).tolist()
        rnd.survival_host = None if surv is None else wide[:, n: 2 * n]
        rnd.drafts_host = drafts = [int(k) for k in m.tolist()]
        rnd.proposal = prop
        index = rnd.index
        out = []
        for c in chunks:
            b = index.get(c.req_id)
            out.append(c if b is None else c.with_token_ids((c.token_ids[0], *ids[b][: drafts[b]])))
        rnd.chunks = tuple(out)
        rnd.started, rnd.captured_before = started, captured
        rnd.forward_started = time.perf_counter()
        if self.deferred_reads and device.type == "cuda":
            rnd.timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            rnd.timer[0].record()
        return rnd

    def _decide_on_device(self, policy: VerifyPolicy, rnd: SpecRound, host: np.ndarray, dev: Tensor, surv: Tensor,
                          base: int, padding: StepPadding | None, lagged: int | None, cutoff: float | None,
                          device: torch.device) -> Tensor | None:  # fmt: skip
        """`[B] int64` the round's counts, enqueued on the device behind the draft pass (`begin`), or None where the
        host decides: the sampled rows' early-stop search, or a search over a round of both sampling classes with
        the calibration on (it prices each class through its own map). The decision is the host's on the same
        inputs: the policy, the carried budget or cutoff, the curve of the round's step, the calibration of its
        class."""
        started = time.perf_counter()
        greedy = rnd.greedy
        price = None
        if cutoff is not None:  # a threshold at the carried cutoff; past every survival, a budget of none
            if cutoff > 1.0:
                lagged = 0
            else:
                policy = VerifyPolicy(kind="threshold", threshold=cutoff)
        if policy.kind == "cost" and lagged is None and self.calibration is not None:
            if any(greedy) and not all(greedy):
                return None
            price = self.calibration.curve(all(greedy))
        plan = plan_schedule(policy, host[:, 3], latency=rnd.latency, base_tokens=base, deterministic=all(greedy),
                             padding=padding, budget=lagged, price=price)
        counts = None
        if plan is not None:
            counts = schedule_on_device(plan, surv, dev[:, 3], upload=self._staging(device).stage)
            self.timing.decided += 1
        self.timing.decide_s += time.perf_counter() - started
        return counts

    # ------------------------------------------------------------------------------------------ draft-ahead
    def launch_ahead(self, rnd: SpecRound, device: torch.device) -> None:
        """After a round's results are read (and its draft context inserted): launch the next round's draft pass
        for every request whose round produced a result, at the inputs the scheduler will give it if it keeps
        decoding: anchor = the last emitted token, position p + accepted + 1, the same slot, seed and temperature.
        A draft pass reads the draft rings and writes nothing else, so drafts nobody takes cost device time only.
        Synchronous runners only: an asynchronous runner has launched the next step before this read. Then the
        round's deferred statistics (`_flush`), while the device drafts."""
        try:
            self._launch_ahead(rnd, device)
        finally:
            self._flush()

    @torch.no_grad()
    def _launch_ahead(self, rnd: SpecRound, device: torch.device) -> None:
        self._ahead = None
        if not self.draft_ahead or self.deferred_reads or not rnd.results or rnd.inputs_host is None:
            return
        # whole columns at once: element by element, NumPy's scalar indexing took 0.18 ms at 256 requests (0.05 ms
        # now), on the host's path from the round's read to this launch (the device idles through it)
        got = [rnd.results.get(rid) for rid in rnd.req_ids]
        rows = [b for b, r in enumerate(got) if r is not None]
        if not rows:
            return
        every = len(rows) == len(got)
        host = rnd.inputs_host.copy() if every else rnd.inputs_host[rows]
        live = got if every else [got[b] for b in rows]
        host[:, 0] = [r.token_ids[-1] for r in live]
        host[:, 1] += [r.num_accepted_tokens + 1 for r in live]
        fits = host[:, 1] + self.block_size <= self.max_position  # `speculates`: the block's positions must exist
        if not fits.all():
            keep = np.flatnonzero(fits)
            if not keep.size:
                return
            host, rows, every = host[keep], [rows[i] for i in keep], False
        temps = rnd.temps_host if every else rnd.temps_host[torch.as_tensor(rows)]
        prop = self._propose(host, self._staging(device).tensor(host, torch.int64), temps)
        self._ahead = ([rnd.req_ids[b] for b in rows], host, temps, getattr(self.drafter, "heads_version", None), prop)

    def _propose(self, host: np.ndarray, dev: Tensor, temps: Tensor) -> DraftProposal:
        """The drafter's proposal for rows (anchor id, position, slot, max drafts, seed): `host` `[B, 5]` int64 and
        its device copy `dev`, temps `[B]` float32 on the host (0 = greedy)."""
        anchors, positions, slots, _, seeds = dev.unbind(1)
        self.drafter.slots = slots
        self.drafter.round_host = (host[:, 2].tolist(), host[:, 0].tolist(), host[:, 1].tolist())
        return propose(self.drafter, anchors, positions, temperature=temps,
                       seeds=seeds if bool((temps > 0).any()) else None)

    def _take_ahead(self, ahead: tuple | None, req_ids: list[str], host: np.ndarray, temps: Tensor
                    ) -> DraftProposal | None:  # fmt: skip
        """The drafts `launch_ahead` launched for this round's requests (rows selected when fewer requests run),
        or None when a request was not drafted ahead or its anchor, position, slot, seed, temperature or the
        drafter's heads differ (then `begin` drafts the round itself, after the unused drafts on the stream).
        Drafts taken are the ones `propose` gives here; a subset's rows up to float rounding, since they were
        computed in a larger batch (verification stays exact: it reads the distributions the drafts came from)."""
        if ahead is None:
            return None
        ids, h, t, version, prop = ahead
        where = {rid: j for j, rid in enumerate(ids)}
        rows = [where.get(rid, -1) for rid in req_ids]
        cols = [0, 1, 2, 4]  # max drafts (column 3) does not change the drafts
        if (-1 in rows or version != getattr(self.drafter, "heads_version", None)
                or not np.array_equal(h[rows][:, cols], host[:, cols]) or not torch.equal(t[rows], temps)):
            self.timing.ahead_missed += 1
            return None
        self.timing.ahead_used += 1
        if rows == list(range(len(ids))):
            return prop
        self.timing.ahead_selected += 1
        idx = self._staging(prop.draft_ids.device).tensor(rows, torch.int64)
        # an all-greedy subset of a mixed round: no distribution, as `propose` gives for an all-greedy round
        probs = None if prop.draft_probs is None or not bool((temps > 0).any()) else prop.draft_probs.index_select(0, idx)
        return DraftProposal(draft_ids=prop.draft_ids.index_select(0, idx), draft_probs=probs,
                             confidence=None if prop.confidence is None else prop.confidence.index_select(0, idx))

    # ------------------------------------------------------------------------------------------ 3. verify
    def _target(self, logits: Tensor, rnd: SpecRound, per_row: dict[str, Tensor]) -> Tensor:
        """Target distributions of the verify rows (probabilities after temperature / top-k / top-p / min-p;
        greedy rows only need their argmax, which the softmax keeps). per_row: `_row_params`' values on the
        device."""
        scaled = logits / per_row["temperature"][:, None]
        if "top_k" in per_row:
            scaled = mask_logits(scaled, top_k=per_row["top_k"], top_p=per_row["top_p"], min_p=per_row["min_p"])
        return torch.softmax(scaled, dim=-1)

    @staticmethod
    def _row_params(rnd: SpecRound, lens: np.ndarray) -> list[tuple[str, np.ndarray, torch.dtype]]:
        """The sampled round's per-row sampling parameters on the host (each request's, repeated over its verify
        rows): temperature (1 on greedy rows), and top-k / top-p / min-p when any request sets them."""
        ps = rnd.params
        out = [("temperature", np.repeat(np.asarray([1.0 if g else float(p.temperature) for g, p in zip(
            rnd.greedy, ps)], dtype=np.float32), lens), torch.float32)]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in ps):
            for name, values, dtype in (("top_k", [max(p.top_k, 0) for p in ps], torch.int64),
                                        ("top_p", [float(p.top_p) for p in ps], torch.float32),
                                        ("min_p", [float(p.min_p) for p in ps], torch.float32)):
                out.append((name, np.repeat(np.asarray(values), lens), dtype))
        return out

    def _staging(self, device: torch.device) -> HostStaging:
        if self._stage is None or self._stage.device != device:
            self._stage = HostStaging(device, slots=8)  # two stagings a round, two rounds in flight (async)
        return self._stage

    @torch.no_grad()
    def finish(self, rnd: SpecRound, out: Any, num_tokens: int) -> tuple[dict[str, SpecResult], dict[str, str]]:
        """Verify the round, insert the draft context of the step, update statistics and the latency model:
        `collect_verify(rnd, launch_verify(rnd, out, num_tokens))`, the whole round at once."""
        return self.collect_verify(rnd, self.launch_verify(rnd, out, num_tokens))

    @torch.no_grad()
    def launch_verify(self, rnd: SpecRound, out: Any, num_tokens: int, rows: int | None = None) -> Tensor | None:
        """Enqueue the round's verification; reads nothing back. Returns its packed device result
        `[B, 2 + N + 1] int64` (per request: accepted drafts, non-finite verify rows, emitted ids) or None when no
        request verifies. `collect_verify` reads it; until then the round keeps the step's captured features (the
        draft context), which must be consumed before the next step overwrites them (the runner collects a
        speculative step before it launches the next one).

        out: the target's `ModelOutput` of the step: logits rows (the round's rows at `rnd.logit_rows`, m + 1
        consecutive rows each), `features` `{layer: [T, d]}` captured over the step's T = num_tokens rows, the
        final streams `hidden`. rows: the rows the forward ran (a replayed graph's padded rows; default
        num_tokens), where the latency model is corrected.
        """
        logits = out.logits
        rnd.hidden, rnd.features, rnd.num_tokens = out.hidden, out.features, num_tokens
        rnd.rows = num_tokens if rows is None else int(rows)
        if not rnd.req_ids:
            return None
        lens = np.asarray(rnd.drafts_host, dtype=np.int64) + 1
        starts = np.cumsum(lens) - lens
        sampled = not all(rnd.greedy)
        # every host input of the verification in ONE copy from pinned memory: a copy from pageable memory waits for
        # the stream (the forward just launched), which left the verification's launches after the forward's
        # device time instead of overlapping it (docs/dspark.md "Verification")
        m, index, _ = row_plan(rnd.drafts_host, self.block_size)
        parts = [(m, torch.int64), (index, torch.int64), (np.repeat(np.arange(len(rnd.req_ids)), lens), torch.int64)]
        identity = starts.tolist() == rnd.logit_rows and int(lens.sum()) == logits.shape[0]
        if not identity:  # request b's rows logit_rows[b] .. + lens[b] - 1, without a NumPy call per request
            parts.append((np.repeat(np.asarray(rnd.logit_rows, dtype=np.int64) - starts, lens)
                          + np.arange(int(lens.sum())), torch.int64))
        row_params = self._row_params(rnd, lens) if sampled else []
        if sampled:
            # the uniforms on the host (the same values as `verify_counter_uniforms`): on the device their hash is
            # ~70 launches, most of a sampled round's verification on the H200, whose host is the bound there
            parts.append((verify_counter_uniforms_host(rnd.inputs_host[:, 4], rnd.inputs_host[:, 1], self.block_size),
                          torch.float32))
            parts += [(values, dtype) for _, values, dtype in row_params]
        staged = self._staging(logits.device).stage(parts)
        m_dev, index_dev, seg = staged[:3]
        raw = logits if identity else logits.index_select(0, staged[3])
        rest = staged[3 + (not identity):]
        uniforms = rest[0] if sampled else None
        per_row = {name: t for (name, _, _), t in zip(row_params, rest[1:])}
        # one pass over the vocabulary gives the greedy argmax and the finiteness check (max propagates NaN), in the
        # logits' own dtype: widening is exact, so the argmax (first maximum) is the fp32 one, and a greedy round
        # skips an fp32 copy of every row (1,536 x 129,280 x 4 bytes written and read again at 256 requests)
        top, best = raw.max(-1)
        bad = ~torch.isfinite(top)
        if not sampled:
            target = raw
        elif "top_k" in per_row:  # masks need the distribution of every row
            target = self._target(raw.float(), rnd, per_row)
        else:  # probabilities read where verification needs them: no softmax of every row (`TargetLogits`)
            temps = per_row["temperature"]
            target = TargetLogits(logits=raw, temperature=temps, lse=logsumexp_rows(raw, temps))
        # host num_drafts / greedy flags: verify checks and splits them without device reads; the drafts come
        # from this vocabulary, so their range check is skipped
        # accept_prob=False: the analytic acceptance is a pass over [B, N, V] that only offline statistics read
        res = verify(target, rnd.proposal, m, greedy=torch.tensor(rnd.greedy), uniforms=uniforms, argmax=best,
                     check_ids=False, accept_prob=False, plan=(m_dev, index_dev))
        nonfinite = torch.zeros(len(rnd.req_ids), dtype=torch.int64, device=raw.device).index_add_(
            0, seg, bad.to(torch.int64))
        packed = torch.cat([res.num_accepted[:, None], nonfinite[:, None], res.output_ids], 1)
        if rnd.timer is not None:
            rnd.timer[1].record()
        rnd.launched_at = time.perf_counter()
        return packed

    def next_budget(self, rnd: SpecRound) -> None:
        """Lagged cost policy: what the next rounds of this round's shape and class carry, from this round's
        survivals, run where the host would otherwise wait for the device: in `collect_verify`, before the round's
        read. A round with sampled rows gives the next such rounds a budget (the global argmax over its row buckets,
        `VerifyPolicy(exact=False)`); an all-greedy round gives the next greedy rounds a survival cutoff
        (`cost_cutoff`: the early-stop search's price of a draft), which a round applies at a threshold's host
        time. Between the forward's launch and the verification's launches (tried) the search delayed those
        launches by its whole time on the H200, where the testbed's forward ends before the host has launched the
        verification: cost's launch took 0.15-0.4 ms longer than a threshold's, about the search's time, at every
        batch size (docs/perf.md, "The lagged search off the launch path").
        The search runs on one round in BUDGET_EVERY per class; the rounds between keep its value while the step's
        shape stays: its host time (0.25-0.57 ms per round on the H200 with the calibration, searched every round)
        is round time wherever the device finishes first, and the budgets of consecutive rounds differ by noise
        (docs/perf.md, "The policies round by round; the host's floor ...")."""
        if rnd.lag_inputs is None or rnd.latency is None:
            return
        t0 = time.perf_counter()
        shape, survival, max_drafts, base, padding, greedy, deterministic = rnd.lag_inputs
        rnd.lag_inputs = None
        cls = int(deterministic)
        kept = self._carried[cls]
        if kept is not None and kept[0] == shape and self._lag_age[cls] + 1 < BUDGET_EVERY:
            self._lag_age[cls] += 1
            self.timing.lag_s += time.perf_counter() - t0
            return
        self._lag_age[cls] = 0
        price = None
        if self.calibration is not None:
            survival, price = self._priced(survival, greedy)
        # `padding` is ragged or None (`SpecDecoder.padding`); a one-class map runs only if the search reads values
        search = (cost_cutoff(survival, max_drafts, rnd.latency, base_tokens=base, padding=padding, price=price)
                  if cls else cost_budget(survival, max_drafts, rnd.latency, exact=False, base_tokens=base,
                                          deterministic=True, padding=padding, price=price))
        self._carried[cls] = (shape, search)
        self.timing.lag_s += time.perf_counter() - t0

    def _priced(self, survival: np.ndarray, greedy: Sequence[bool]) -> tuple[np.ndarray, Callable | None]:
        """(survivals, price) that price a round through the calibration (`cost_budget`'s `price`): a round of one
        sampling class keeps its survivals, whose ranking the class's map keeps, and maps the ranked values only
        when the choice reads them; a mixed round ranks and prices its calibrated survivals (two maps)."""
        cal = self.calibration
        greedy_rows = sum(map(bool, greedy))  # plain Python: a NumPy copy of the list costs more on this path
        if greedy_rows in (0, len(greedy)):
            cls = greedy_rows == len(greedy)
            return survival, lambda values: cal.map(values, cls)
        return cal.apply(survival, np.asarray(greedy, dtype=bool)), None

    @torch.no_grad()
    def collect_verify(self, rnd: SpecRound, packed: Tensor | None, drop: frozenset[str] = frozenset()
                       ) -> tuple[dict[str, SpecResult], dict[str, str]]:  # fmt: skip
        """The round's host read (`packed` from `launch_verify`, on the device or already copied to the host) and
        its bookkeeping: results, errors, statistics, the latency model, the draft context of the step.

        drop: requests that finished (stop string, abort) after the step was launched (asynchronous scheduling):
        their rows are not reported, counted or inserted, so results and statistics are those of a synchronous
        run, which would not have scheduled them. Returns (results, errors)."""
        results: dict[str, SpecResult] = {}
        errors: dict[str, str] = {}
        accepted_rows = {c.req_id: c.num_tokens for c in rnd.chunks if c.req_id not in drop}
        self.next_budget(rnd)  # while the device finishes the round
        read_at = time.perf_counter()
        if rnd.req_ids:
            host_done = read_at
            host = packed.tolist()  # the round's one host read after the forward
            read_at = time.perf_counter()
            floor = None  # the host's own time in the forward's window, when the device runs beside it
            if rnd.timer is not None:  # launched ahead of its read: the device time of the forward + verification
                span = rnd.timer[0].elapsed_time(rnd.timer[1]) / 1e3
            elif self.deferred_reads:  # the CPU ran the forward inside the launch
                span = rnd.launched_at - rnd.forward_started
            else:
                span = read_at - rnd.forward_started
                if packed.device.type != "cpu":
                    floor = host_done - rnd.forward_started
            self.timing.rounds += 1
            self.timing.draft_s += rnd.forward_started - rnd.started
            self.timing.launch_s += rnd.launched_at - rnd.forward_started
            self.timing.add_verify(rnd.rows, span)
            captured = self.capture_clock() if self.capture_clock is not None else 0.0
            if rnd.latency is not None and self.online_latency and captured == rnd.captured_before:
                # the forward as the start-up profile timed it, and the draft pass as a per-step overhead: the
                # overhead does not grow with the verified drafts, so it must not read as growth of T(Q); the
                # next round's start closes this cycle (its overhead is observed if no capture ran by then)
                forward = span
                if floor is not None:
                    floor, forward = round_observations(rnd.latency, rnd.rows, floor, span)
                    rnd.latency.observe_floor(floor)
                if forward is not None:
                    rnd.latency.observe(rnd.rows, max(forward, 1e-9))
                self._last_cycle = (rnd.started, span, captured, rnd.latency)
            live = [b for b, rid in enumerate(rnd.req_ids) if rid not in drop]
            if live:
                surv = rnd.survival_host
                if surv is not None and len(live) < len(rnd.req_ids):
                    surv = surv[live]
                accepted, verified = [host[b][0] for b in live], [rnd.drafts_host[b] for b in live]
                # the calibration learns from every CALIBRATE_EVERY-th cost round: the map needs no more
                calibrate = (self.calibration is not None and self.policy.kind == "cost" and surv is not None
                             and self.rounds % CALIBRATE_EVERY == 0)
                self._deferred.append((accepted, verified, surv,
                                       np.asarray([rnd.greedy[b] for b in live]) if calibrate else None))
            for b in live:
                rid, a = rnd.req_ids[b], host[b][0]
                if host[b][1]:
                    errors[rid] = ("the model's logits are not finite (NaN or Inf) in a speculative verify step: "
                                   "the checkpoint or a kernel produced invalid values")
                    accepted_rows[rid] = 0
                    continue
                results[rid] = SpecResult(token_ids=tuple(host[b][2 : 3 + a]), num_draft_tokens=self.block_size,
                                          num_verified_tokens=rnd.drafts_host[b], num_accepted_tokens=a)
                accepted_rows[rid] = a + 1
        self.insert_context(rnd.chunks, accepted_rows, rnd.features)
        rnd.features = {}
        rnd.keep, rnd.results = accepted_rows, results
        if rnd.req_ids:
            self.timing.finish_s += time.perf_counter() - read_at
        return results, errors

    @torch.no_grad()
    def after_sampling(self, rnd: SpecRound, sampled: Mapping[str, int], states: Mapping[str, Any]) -> None:
        """After the runner sampled the step's other chunks: drafters that draft from this step's target
        streams (`after_step`, MTP) get every position the step added and the token that follows it."""
        after = getattr(self.drafter, "after_step", None)
        if after is None or rnd.hidden is None:
            return
        next_ids: dict[str, list[int]] = {}
        for c in rnd.chunks:
            r = rnd.results.get(c.req_id)
            if r is not None:
                next_ids[c.req_id] = list(r.token_ids)
            elif c.req_id not in rnd.index:
                st = states[c.req_id]
                end = c.start_position + c.num_tokens
                if c.sample:
                    if c.req_id not in sampled:
                        continue
                    tail = [sampled[c.req_id]]
                else:  # the next known token of the prompt (or of the outputs, when recomputing)
                    p = len(st.prompt_ids)
                    tail = [st.prompt_ids[end] if end < p else st.output_ids[end - p]]
                next_ids[c.req_id] = list(c.token_ids[1:]) + tail
        after(rnd.chunks, rnd.keep, next_ids, rnd.hidden)

    def insert_context(self, chunks: Sequence[ScheduledChunk], keep: Mapping[str, int],
                       features: Mapping[int, Tensor]) -> None:
        """Draft rings <- target features of the first keep[req] rows of each chunk (positions that are now
        part of the sequence). Rows of rejected drafts are never inserted. With `insert_runner` (CUDA graphs)
        a step whose sequences each keep at most max_drafts + 1 rows replays the insertion's graph (the same
        ring writes: `dspark.StaticInsert`); other steps, or when the runner declines, insert eagerly."""
        if not self.capture or not hasattr(self.drafter, "insert_context"):
            return
        starts, lens, slots, firsts = [], [], [], []
        row = 0
        for c in chunks:
            k = keep.get(c.req_id, 0)
            if k > 0:
                starts.append(c.start_position)
                lens.append(k)
                slots.append(c.slot)
                firsts.append(row)
            row += c.num_tokens
        if not lens:
            return
        # every sequence padded to max_drafts + 1 rows, the longest a verify chunk keeps: one graph per batch
        # bucket (the runner declines steps that keep more, e.g. prefill chunks)
        if self.insert_runner is not None and self.insert_runner(starts, slots, lens, firsts, features,
                                                                 self.max_drafts + 1):
            return
        n = np.asarray(lens, dtype=np.int64)
        within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)  # 0 .. k - 1 per sequence
        rows_np = np.repeat(np.asarray(firsts, dtype=np.int64), n) + within
        pos_np = np.repeat(np.asarray(starts, dtype=np.int64), n) + within
        device = next(iter(features.values())).device
        packed = torch.from_numpy(np.concatenate([rows_np, pos_np])).to(device, non_blocking=device.type == "cuda")
        sel, positions = packed.split([rows_np.size, pos_np.size])
        ids = np.zeros(pos_np.size, dtype=np.int64)
        tables = np.full((len(lens), 1), -1, dtype=np.int32)
        batch = ForwardBatch(
            input_ids=torch.zeros_like(positions), positions=positions, query_lens=tuple(lens), slots=tuple(slots),
            block_tables=torch.from_numpy(tables).to(device, non_blocking=device.type == "cuda"),
            logits_indices=positions[:0],
            host=StepHost(ctx_lens=tuple(starts), input_ids=ids, block_tables=tables),
        )  # fmt: skip
        self.drafter.insert_context(batch, {lid: f.index_select(0, sel) for lid, f in features.items()})
