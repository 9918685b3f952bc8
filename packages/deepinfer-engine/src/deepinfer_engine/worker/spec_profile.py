"""The cost policy's start-up latency profile (docs/dspark.md "Verification policies"): the target forward timed
over verify-shaped steps before any request holds cache rows.

Two kinds of curve:
- `profile_target_latency`: T(Q) over Q = 1, 2, 4, ... query tokens, each step ceil(Q / (k + 1)) verify chunks of
  k + 1 rows. It prices the steps no batch curve covers: eager steps (a prefill chunk rides along) and graph
  batches below `BATCH_PROFILE_MIN`.
- `profile_batch_latency`: per CUDA-graph batch bucket b, T_b(R) at every ragged row bucket R of b, each step b
  sequences with the R rows spread over them, i.e. the graph a verify step of b sequences replays. A step's time
  depends on its sequences as well as its rows (each sequence reads its own window and cache pages), so pricing
  R rows of b sequences by a step of R / (k + 1) sequences, as the T(Q) curve does, prices pruned drafts as if
  they removed whole sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from deepinfer_dspark import LatencyModel

from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
from deepinfer_engine.worker.cuda_graph import VERIFY_CAPTURE_AFTER, verify_row_sizes

__all__ = ["BATCH_PROFILE_MIN", "batch_profile_sizes", "profile_batch_latency", "profile_cost_curves",
           "profile_target_latency", "profiled_forward"]

# graph batch buckets below this many sequences get no curve of their own: their steps are launch-bound (flat, so
# the policy verifies every draft whatever the curve), and every point costs a graph capture at start-up
BATCH_PROFILE_MIN = 16
# untimed calls per profile size: a verify row bucket is captured on its VERIFY_CAPTURE_AFTER-th request (before
# that it runs in a wider captured bucket), so the timed calls replay the size's own graph
PROFILE_WARMUP = VERIFY_CAPTURE_AFTER


def _step(forward: Callable[[ForwardBatch], object], lens: Sequence[int], need: int, device: torch.device) -> None:
    """One forward over sequences of `lens` query tokens from position 0, sequence i in slot i and pages
    i * need .. (i + 1) * need - 1, synchronised."""
    s, q = len(lens), int(sum(lens))
    ids = np.full(q, 100, dtype=np.int64)
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    tables = np.arange(s * need, dtype=np.int32).reshape(s, need)
    batch = ForwardBatch(
        input_ids=torch.from_numpy(ids).to(device), positions=torch.from_numpy(pos).to(device),
        query_lens=tuple(int(n) for n in lens), slots=tuple(range(s)),
        block_tables=torch.from_numpy(tables).to(device), logits_indices=torch.arange(q, device=device),
        host=StepHost(ctx_lens=(0,) * s, input_ids=ids, block_tables=tables),
    )  # fmt: skip
    forward(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_target_latency(
    forward: Callable[[ForwardBatch], object], *, block_size: int, max_tokens: int, num_slots: int, pages: int,
    page_size: int, device: torch.device, ema: float = 0.05, repeats: int = 5,
) -> LatencyModel:
    """T(Q): the target forward over Q query tokens at Q = 1, 2, 4, ... up to `max_tokens` (and the cap), as
    ceil(Q / (N + 1)) sequences of at most N + 1 tokens (a verify step's shape), each in its own slot and pages;
    `repeats` interleaved rounds, the median per size, a non-decreasing fit and its noise
    (`LatencyModel.profile`). `forward(batch)` runs the model; the caller resets the slots afterwards."""
    per = block_size + 1
    need = -(-per // page_size)
    cap = min(max_tokens, num_slots * per, (pages // need) * per)
    sizes = sorted({q for q in [1 << i for i in range(20)] + [cap] if 1 <= q <= cap})
    if len(sizes) < 2:
        sizes = [1, 2]

    def step(q: int) -> None:
        _step(forward, [per] * (q // per) + ([q % per] if q % per else []), need, device)

    return LatencyModel.profile(step, sizes, warmup=PROFILE_WARMUP, repeats=repeats, ema=ema)


def batch_profile_sizes(batch_sizes: Sequence[int], per: int, *, max_tokens: int, num_slots: int, pages: int,
                        page_size: int, min_batch: int | None = None) -> dict[int, tuple[int, ...]]:
    """{b: its ragged row buckets of at most max_tokens rows (the scheduler's token budget)} for the graph batch
    buckets b >= min_batch (default BATCH_PROFILE_MIN) that a profile step of b sequences of up to `per` rows fits
    (b slots, b * ceil(per / page_size) pages) and that keep two or more buckets."""
    min_batch = BATCH_PROFILE_MIN if min_batch is None else min_batch
    need = -(-per // page_size)
    out = {}
    for b in batch_sizes:
        rows = tuple(r for r in verify_row_sizes(b, per) if r <= max_tokens)
        if min_batch <= b <= min(num_slots, pages // need) and len(rows) >= 2:
            out[b] = rows
    return out


def profile_batch_latency(
    forward: Callable[[ForwardBatch], object], sizes: dict[int, tuple[int, ...]], *, per: int, page_size: int,
    device: torch.device, ema: float = 0.05, repeats: int = 5,
) -> dict[int, LatencyModel]:
    """{b: T_b(R)} for `sizes` ({b: row buckets}, `batch_profile_sizes`): each R timed as a step of b sequences
    whose R rows are spread evenly (each 1 .. per rows), the graph a verify step of b sequences and R rows
    replays (`LatencyModel.profile` per b)."""
    need = -(-per // page_size)
    out = {}
    for b, rows in sizes.items():
        def step(r: int, b: int = b) -> None:
            base, extra = divmod(r, b)
            _step(forward, [base + 1] * extra + [base] * (b - extra), need, device)

        out[b] = LatencyModel.profile(step, rows, warmup=PROFILE_WARMUP, repeats=repeats, ema=ema)
    return out


def profiled_forward(model: Any, cache: Any, graphs: Any, capture: tuple[int, ...], max_tokens: int
                     ) -> Callable[[ForwardBatch], object]:  # fmt: skip
    """The forward the start-up profile times: the verify step as the engine will run it, i.e. the replay of its
    CUDA graph when `graphs` (worker/cuda_graph.py) can run the shape, else the eager forward."""

    def forward(batch: ForwardBatch) -> object:
        if graphs is not None:
            shape = graphs.verify_shape_of(batch, range(batch.num_tokens), max_tokens)
            out = graphs.run_verify(batch, shape, capture=capture) if shape is not None else None
            if out is not None:
                return out
        return model.forward_features(batch, cache, capture=capture)

    return forward


def profile_cost_curves(model: Any, cache: Any, graphs: Any, config: Any, k: int, num_pages: int,
                        device: torch.device) -> tuple[LatencyModel, dict[int, LatencyModel]]:
    """The cost policy's start-up curves (worker/spec_profile.py): T(Q), and with CUDA graphs one curve per
    graph batch bucket of 16 sequences or more. The profile's steps are verify chunks of up to k drafts (k + 1
    rows, the graphs' longest sequence); afterwards every slot is left fresh (no request holds these rows)."""
    sched = config.scheduler
    max_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * (k + 1))
    forward = profiled_forward(model, cache, graphs, tuple(model.args.dspark_target_layer_ids), k + 1)
    latency = profile_target_latency(forward, block_size=k, max_tokens=max_tokens, num_slots=cache.num_slots,
                                     pages=num_pages, page_size=cache.page_size, device=device)
    by_batch = {}
    if graphs is not None:
        sizes = batch_profile_sizes(graphs.batch_sizes, k + 1, max_tokens=max_tokens, num_slots=cache.num_slots,
                                    pages=num_pages, page_size=cache.page_size)
        by_batch = profile_batch_latency(forward, sizes, per=k + 1, page_size=cache.page_size, device=device)
    for s in range(cache.num_slots):
        cache.reset_slot(s)
        cache.high_water[s] = 0
    return latency, by_batch
