"""Model runner: `SchedulerOutput` (a diff) -> persistent `InputBatch` -> `ForwardBatch` -> model forward ->
sampler -> `ModelRunnerOutput`.

Keeps per-request sampling state (params, seed, and the scheduler's token lists by reference for penalties and
min_tokens: sampled ids are stored once, by the scheduler) and, in the input batch, each request's block table,
built from the scheduler's page diffs; a preemption drops the table (the resumed request is sent again as new),
so recompute needs nothing special here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from deepinfer_engine.worker.cache_ops import apply_cache_ops
from deepinfer_engine.worker.input_batch import InputBatch
from deepinfer_engine.worker.sampler import INVALID_TOKEN, Sampler, build_sampling_batch, to_device


@dataclass
class _RequestState:
    params: Any  # SamplingParams
    seed: int
    prompt_ids: Sequence[int]  # the scheduler's Request lists, by reference (read-only here)
    output_ids: Sequence[int]
    next_prompt_logprob: int = 1  # next prompt index j whose logprob (given ids < j) is still to be returned


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
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.batch_cls = batch_cls or _default_batch_cls()
        self.sampler = Sampler()
        self.states: dict[str, _RequestState] = {}
        self.input_batch = InputBatch(self.device)
        self.cuda_graphs = cuda_graphs  # worker.cuda_graph.CudaGraphRunner (decode steps replayed) or None

    def _banned(self, st: _RequestState) -> tuple[int, ...]:
        p = st.params
        if len(st.output_ids) >= p.min_tokens:
            return ()
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
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
            return ModelRunnerOutput()

        logit_rows: list[int] = []
        sample_at: list[tuple[str, int]] = []  # (req_id, index into logit_rows)
        plp_at: list[tuple[str, int, int]] = []  # (req_id, index into logit_rows, target prompt index j)
        row = 0
        known: list[int] = []  # per chunk, its request's known tokens (prefill truncation; 0 = every row needed)
        for c in sched.chunks:
            st = self.states[c.req_id]
            n = c.num_tokens
            known.append(0 if st.params.prompt_logprobs is not None else c.num_prompt_tokens + c.output_index)
            if st.params.prompt_logprobs is not None:
                for p in range(c.start_position, c.start_position + n):
                    j = p + 1
                    if st.next_prompt_logprob <= j < len(st.prompt_ids):
                        plp_at.append((c.req_id, len(logit_rows), j))
                        logit_rows.append(row + p - c.start_position)
            if c.sample:
                sample_at.append((c.req_id, len(logit_rows)))
                logit_rows.append(row + n - 1)
            row += n

        inp = self.input_batch.prepare(sched.chunks, logit_rows)
        batch = self.batch_cls(
            input_ids=inp.input_ids, positions=inp.positions, query_lens=inp.query_lens, slots=inp.slots,
            block_tables=inp.block_tables, logits_indices=inp.logits_indices, host=inp.host, seq=inp.seq,
            seq_of_token=inp.seq_of_token, known_lens=tuple(known),
        )  # fmt: skip
        graph = self.cuda_graphs.shape_of(batch, logit_rows) if self.cuda_graphs is not None else None
        # a decode step replays the forward captured for its padded shape (None: not capturable, eager)
        logits = self.cuda_graphs.run(batch, graph) if graph is not None else None
        if logits is None:  # [len(logit_rows), V] float32; runs even with no rows (cache fill)
            logits = self.model(batch, self.cache)
        if not logit_rows:
            return ModelRunnerOutput()
        logits = logits.float()

        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        errors: dict[str, str] = {}
        if sample_at:
            chunk_by_id = {c.req_id: c for c in sched.chunks}
            states = [self.states[rid] for rid, _ in sample_at]
            sbatch = build_sampling_batch(
                [s.params for s in states],
                [s.seed for s in states],
                [chunk_by_id[rid].output_index for rid, _ in sample_at],
                [s.prompt_ids for s in states],
                [s.output_ids for s in states],
                [self._banned(s) for s in states],
                logits.device,
            )
            rows = to_device([i for _, i in sample_at], torch.int64, logits.device)
            out = self.sampler(logits.index_select(0, rows), sbatch)
            tokens = out.token_ids.tolist()  # the one sync of the step (plus logprobs when asked for)
            lp = [t.tolist() for t in out.logprobs] if out.logprobs is not None else None
            for k, ((rid, _), st, tok) in enumerate(zip(sample_at, states, tokens)):
                if tok == INVALID_TOKEN:
                    errors[rid] = (f"the model's logits are not finite (NaN or Inf) at output position "
                                   f"{len(st.output_ids)}: the checkpoint or a kernel produced invalid values")
                    continue
                sampled[rid] = tok
                if lp is not None and st.params.logprobs is not None:
                    want = st.params.logprobs
                    logprobs[rid] = TokenLogprobs(token_id=tok, logprob=lp[0][k], rank=lp[3][k],
                                                  top=tuple(zip(lp[1][k][:want], lp[2][k][:want])))

        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if plp_at:
            from deepinfer_kernels.sampling import logprobs_topk

            k_max = max(self.states[rid].params.prompt_logprobs for rid, _, _ in plp_at)
            rows = to_device([i for _, i, _ in plp_at], torch.int64, logits.device)
            targets = to_device([self.states[rid].prompt_ids[j] for rid, _, j in plp_at], torch.int64, logits.device)
            chosen, top_ids, top_vals, rank = (t.tolist() for t in
                                               logprobs_topk(logits.index_select(0, rows), targets, k_max))
            for k, (rid, _, j) in enumerate(plp_at):
                st = self.states[rid]
                want = st.params.prompt_logprobs
                prompt_logprobs.setdefault(rid, []).append(TokenLogprobs(
                    token_id=st.prompt_ids[j], logprob=chosen[k], rank=rank[k],
                    top=tuple(zip(top_ids[k][:want], top_vals[k][:want]))))
                st.next_prompt_logprob = j + 1
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 errors=errors)
