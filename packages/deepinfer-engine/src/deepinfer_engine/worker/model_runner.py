"""Model runner: `SchedulerOutput` (a diff) -> persistent `InputBatch` -> `ForwardBatch` -> model forward ->
sampler -> `ModelRunnerOutput`.

Keeps per-request sampling state (params, seed, and the scheduler's token lists by reference for penalties and
min_tokens: sampled ids are stored once, by the scheduler) and, in the input batch, each request's block table,
built from the scheduler's page diffs; a preemption drops the table (the resumed request is sent again as new),
so recompute needs nothing special here.

`execute` = `collect(launch(sched))`: `launch` enqueues the step and reads nothing back, `collect` does the step's
one host read. Asynchronous scheduling (worker/async_runner.py) collects a step after launching the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_engine.core.sched_output import (
    ModelRunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprobs,
)
from deepinfer_engine.worker.cache_ops import apply_cache_ops
from deepinfer_engine.worker.input_batch import InputBatch, StepInputs
from deepinfer_engine.worker.sampler import (
    INVALID_TOKEN,
    Sampler,
    SamplingBatch,
    build_sampling_batch,
    plain_greedy,
)
from deepinfer_engine.worker.staging import HostStaging


@dataclass
class _RequestState:
    params: Any  # SamplingParams
    seed: int
    prompt_ids: Sequence[int]  # the scheduler's Request lists, by reference (read-only here)
    output_ids: Sequence[int]
    next_prompt_logprob: int = 1  # next prompt index j whose logprob (given ids < j) is still to be returned


@dataclass
class LaunchedStep:
    """One enqueued step: its device results and what `collect` needs to package them (no runner state, so a
    step can be collected after the next one was launched).

    sampled: (req_id, output index, logprobs wanted) per sampled row; token_ids [len(sampled)] int64
    (INVALID_TOKEN where the logits were not finite); logprobs: (chosen [N], top ids [N, k], top values [N, k],
    rank [N]); prompt_targets: (req_id, target id, top wanted) per prompt-logprob row, prompt_logprobs its tensors.
    """

    sampled: list[tuple[str, int, int | None]] = field(default_factory=list)
    token_ids: torch.Tensor | None = None
    logprobs: tuple[torch.Tensor, ...] | None = None
    prompt_targets: list[tuple[str, int, int]] = field(default_factory=list)
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    spec_round: Any = None  # the speculative round verified in this step (worker/spec_decode.py) or None
    spec_packed: torch.Tensor | None = None  # its verification result, read by `collect` (SpecDecoder.launch_verify)


def _default_batch_cls() -> type:
    from deepinfer_engine.model.forward_batch import ForwardBatch

    return ForwardBatch


class ModelRunner:
    """Runs `model.forward(batch, cache) -> logits [N, V] float32` for one scheduled step.

    `model` and `cache` honour contracts.md §3 (`Transformer` / `ModelCache`); `batch_cls` builds the
    `ForwardBatch` (injectable so tests can drive a stand-in model).
    """

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        cache: Any,
        *,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        batch_cls: type | None = None,
        cuda_graphs: Any = None,
        spec: Any = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.batch_cls = batch_cls or _default_batch_cls()
        self.sampler = Sampler()
        self.states: dict[str, _RequestState] = {}
        self.input_batch = InputBatch(self.device)
        self.staging = HostStaging(self.device)  # the step's small host arrays (sampling, row indices)
        self.cuda_graphs = cuda_graphs  # worker.cuda_graph.CudaGraphRunner (decode steps replayed) or None
        self.spec = spec  # speculative decoding (worker/spec_decode.SpecDecoder) or None

    def _banned(self, st: _RequestState, output_index: int) -> tuple[int, ...]:
        # output_index, not len(output_ids): with asynchronous scheduling the list lags the step by one token
        p = st.params
        if output_index >= p.min_tokens:
            return ()
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(sched))

    # Hook points of asynchronous scheduling (worker/async_runner.py); the synchronous runner has no placeholders.
    def _resolve_placeholders(self, sched: SchedulerOutput, inp: StepInputs) -> None:
        """Fill the input rows whose id is the previous step's sample (device and host copies of the inputs)."""

    def _complete_sampling(self, sbatch: SamplingBatch, chunks: list[ScheduledChunk]) -> SamplingBatch:
        """The sampling batch of rows `chunks` with what the host lists do not hold yet."""
        return sbatch

    def _sampled(self, req_ids: list[str], token_ids: torch.Tensor | None) -> None:
        """The step's sampled ids on the device ([len(req_ids)] int64), before any host read."""

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Enqueue the step (forward, sampler, prompt logprobs) without reading anything back to the host."""
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for nr in sched.new_requests:
            if nr.req_id not in self.states:  # a preempted request keeps its state (outputs so far)
                self.states[nr.req_id] = _RequestState(params=nr.sampling, seed=nr.seed,
                                                       prompt_ids=nr.prompt_token_ids, output_ids=nr.output_token_ids)
        self.input_batch.update(sched)
        if sched.cache_ops is not None:  # prefix cache copies, before the forward reads the cache
            apply_cache_ops(self.cache, sched.cache_ops)
        if sched.is_empty:
            self._sampled([], None)
            return LaunchedStep()

        # speculative decoding: drafts extend the decode chunks that verify them (worker/spec_decode.py)
        rnd = self.spec.begin(sched.chunks, self.states, self.device) if self.spec is not None else None
        chunks = sched.chunks if rnd is None else rnd.chunks
        logit_rows: list[int] = []
        sample_at: list[tuple[str, int]] = []  # (req_id, index into logit_rows)
        plp_at: list[tuple[str, int, int]] = []  # (req_id, index into logit_rows, target prompt index j)
        row = 0
        known: list[int] = []  # per chunk, its request's known tokens (prefill truncation; 0 = every row needed)
        for c in chunks:
            st = self.states[c.req_id]
            n = c.num_tokens
            known.append(0 if st.params.prompt_logprobs is not None else c.num_prompt_tokens + c.output_index)
            if st.params.prompt_logprobs is not None:
                for p in range(c.start_position, c.start_position + n):
                    j = p + 1
                    if st.next_prompt_logprob <= j < len(st.prompt_ids):
                        plp_at.append((c.req_id, len(logit_rows), j))
                        logit_rows.append(row + p - c.start_position)
            if rnd is not None and c.req_id in rnd.index:  # every row of [g, d_1 .. d_m] is verified
                rnd.logit_rows.append(len(logit_rows))
                logit_rows.extend(range(row, row + n))
            elif c.sample:
                sample_at.append((c.req_id, len(logit_rows)))
                logit_rows.append(row + n - 1)
            row += n

        inp = self.input_batch.prepare(chunks, logit_rows)
        self._resolve_placeholders(sched, inp)
        batch = self.batch_cls(
            input_ids=inp.input_ids, positions=inp.positions, query_lens=inp.query_lens, slots=inp.slots,
            block_tables=inp.block_tables, logits_indices=inp.logits_indices, host=inp.host, seq=inp.seq,
            seq_of_token=inp.seq_of_token, known_lens=tuple(known),
        )  # fmt: skip
        step = LaunchedStep(spec_round=rnd)
        greedy_ids = None  # a graphed decode step's greedy ids of its rows (computed inside the graph)
        if rnd is not None:  # a speculative step: several rows per sequence, the draft model's features
            graphs, out, rows = self.cuda_graphs, None, batch.num_tokens
            shape = graphs.verify_shape_of(batch, logit_rows, self.spec.max_drafts + 1) if graphs is not None else None
            if shape is not None:  # replays the verify forward captured for its row bucket (None: eager)
                out = graphs.run_verify(batch, shape, capture=self.spec.capture)
                rows = shape[2]
            if out is None:
                out, rows = self.model.forward_features(batch, self.cache, capture=self.spec.capture), batch.num_tokens
            logits = out.logits
            step.spec_packed = self.spec.launch_verify(rnd, out, batch.num_tokens, rows)
        else:
            graph = self.cuda_graphs.shape_of(batch, logit_rows) if self.cuda_graphs is not None else None
            # a decode step replays the forward captured for its padded shape (None: not capturable, eager)
            logits = self.cuda_graphs.run(batch, graph) if graph is not None else None
            if logits is None:  # [len(logit_rows), V] float32; runs even with no rows (cache fill)
                logits = self.model(batch, self.cache)
            else:
                greedy_ids = self.cuda_graphs.greedy_ids(batch.num_seqs)
        if not logit_rows:
            self._sampled([], None)
            return step
        logits = logits.float()

        if sample_at:
            chunk_by_id = {c.req_id: c for c in chunks}
            chunks = [chunk_by_id[rid] for rid, _ in sample_at]
            states = [self.states[rid] for rid, _ in sample_at]
            params = [s.params for s in states]
            banned = [self._banned(s, c.output_index) for s, c in zip(states, chunks)]
            at = [i for _, i in sample_at]
            identity = at == list(range(logits.shape[0]))  # every logit row samples, in order: no gather
            if plain_greedy(params, banned):
                # the sampler's plain greedy path without building its per-row tensors; a graphed decode step
                # computed the same argmax inside its graph (copied out: the next replay rewrites it)
                if greedy_ids is not None and identity:
                    tokens = greedy_ids.clone()
                else:
                    tokens = self.sampler.greedy(logits if identity else self._rows(logits, at))
            else:
                sbatch = build_sampling_batch(
                    params, [s.seed for s in states], [c.output_index for c in chunks],
                    [s.prompt_ids for s in states], [s.output_ids for s in states], banned, logits.device,
                    staging=self.staging,
                )  # fmt: skip
                sbatch = self._complete_sampling(sbatch, chunks)
                out = self.sampler(logits if identity else self._rows(logits, at), sbatch)
                step.logprobs = out.logprobs
                tokens = out.token_ids
            step.sampled = [(rid, c.output_index, s.params.logprobs) for (rid, _), s, c in zip(sample_at, states, chunks)]
            step.token_ids = tokens
            self._sampled([rid for rid, _ in sample_at], tokens)
        else:
            self._sampled([], None)

        if plp_at:
            from deepinfer_kernels.sampling import logprobs_topk

            k_max = max(self.states[rid].params.prompt_logprobs for rid, _, _ in plp_at)
            rows, targets = self.staging.stage([([i for _, i, _ in plp_at], torch.int64),
                                                ([self.states[rid].prompt_ids[j] for rid, _, j in plp_at], torch.int64)])
            step.prompt_logprobs = logprobs_topk(logits.index_select(0, rows), targets, k_max)
            for rid, _, j in plp_at:
                st = self.states[rid]
                step.prompt_targets.append((rid, st.prompt_ids[j], st.params.prompt_logprobs))
                st.next_prompt_logprob = j + 1
        return step

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return logits.index_select(0, self.staging.tensor(rows, torch.int64))

    def collect(self, step: LaunchedStep, drop: frozenset[str] = frozenset()) -> ModelRunnerOutput:
        """The step's `ModelRunnerOutput`: reads its ids (and logprobs) back, the one host sync of the step.
        `step`'s tensors may already be host copies (asynchronous scheduling: worker/async_output.py).
        drop: requests finished since the launch, whose speculative rows are neither reported nor counted."""
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        errors: dict[str, str] = {}
        spec: dict[str, Any] = {}
        if step.spec_round is not None:  # before anything else: it inserts the draft context of the step
            spec, errors = self.spec.collect_verify(step.spec_round, step.spec_packed, drop)
        if step.sampled:
            tokens = step.token_ids.tolist()
            lp = [t.tolist() for t in step.logprobs] if step.logprobs is not None else None
            for k, ((rid, out_index, want), tok) in enumerate(zip(step.sampled, tokens)):
                if tok == INVALID_TOKEN:
                    errors[rid] = (f"the model's logits are not finite (NaN or Inf) at output position "
                                   f"{out_index}: the checkpoint or a kernel produced invalid values")
                    continue
                sampled[rid] = tok
                if lp is not None and want is not None:
                    logprobs[rid] = TokenLogprobs(token_id=tok, logprob=lp[0][k], rank=lp[3][k],
                                                  top=tuple(zip(lp[1][k][:want], lp[2][k][:want])))

        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if step.prompt_targets:
            chosen, top_ids, top_vals, rank = (t.tolist() for t in step.prompt_logprobs)
            for k, (rid, token_id, want) in enumerate(step.prompt_targets):
                prompt_logprobs.setdefault(rid, []).append(TokenLogprobs(
                    token_id=token_id, logprob=chosen[k], rank=rank[k],
                    top=tuple(zip(top_ids[k][:want], top_vals[k][:want]))))
        if step.spec_round is not None:
            self.spec.after_sampling(step.spec_round, sampled, self.states)
            # after every host read of the step: the next round's drafts run while the host does its bookkeeping
            self.spec.launch_ahead(step.spec_round, self.device)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 errors=errors, spec=spec)
