"""Batched sampler over the rows of one step: penalties, min-tokens masking, temperature / min-p / top-k / top-p,
counter-based seeded sampling, logprobs. One packed host->device copy of the per-row arrays per step
(worker/staging.py), no per-request syncs.

Rows whose raw logits are not finite (a NaN anywhere, +Inf, or all -Inf) come back as token id -1
(`INVALID_TOKEN`): the check is one reduction on the device, folded into the sampled ids so that the caller's
single read of the ids also carries it (no extra host synchronization).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_kernels import backend_from_env
from deepinfer_kernels.sampling import apply_penalties, greedy_argmax, logprobs_topk, sample

from deepinfer_engine.worker.staging import HostStaging


@dataclass(frozen=True, kw_only=True)
class SamplingBatch:
    """Per-row sampling inputs of one step (row i = the i-th request that samples this step).

    temperature/top_p/min_p: [N] float32; top_k/seeds/offsets: [N] int64 on the logits' device.
    penalties: (prompt_ids [N, Lp] int64 -1 padded, output_ids [N, Lo], repetition [N], presence [N],
    frequency [N]) or None when no row uses penalties. banned: (rows, token ids) pairs set to -inf
    (EOS / stop ids before min_tokens). max_logprobs: top-k alternatives to return (None = no logprobs).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    all_greedy: bool
    any_masks: bool = True
    penalties: tuple[torch.Tensor, ...] | None = None
    banned: tuple[list[int], list[int]] | None = None
    max_logprobs: int | None = None


INVALID_TOKEN = -1


@dataclass(frozen=True, kw_only=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64; INVALID_TOKEN where the row's logits were not finite
    logprobs: tuple[torch.Tensor, ...] | None = None  # (chosen [N], top_ids [N,k], top_vals [N,k], rank [N])


def to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a device tensor without a host synchronization: staged in pinned memory and copied
    asynchronously (a plain `torch.tensor(values, device=cuda)` copies from pageable memory and waits)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _pad(rows: list[list[int]]) -> np.ndarray:
    width = max(1, max((len(r) for r in rows), default=1))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = r
    return out


def build_sampling_batch(
    params: list, seeds: list[int], offsets: list[int], prompt_ids: list[list[int]], output_ids: list[list[int]],
    banned_ids: list[tuple[int, ...]], device: torch.device, *, staging: HostStaging | None = None,
) -> SamplingBatch:
    """From per-row SamplingParams (and the request state the runner keeps) to device tensors: every per-row
    array of the step in one host -> device copy (`staging`: the runner's persistent pinned buffers; None: a
    one-off staging, e.g. in tests)."""
    f32, i64 = torch.float32, torch.int64
    staging = staging if staging is not None else HostStaging(device, slots=1)
    parts: list[tuple[object, torch.dtype]] = [
        ([p.temperature for p in params], f32),
        ([max(p.top_k, 0) for p in params], i64),
        ([p.top_p for p in params], f32),
        ([p.min_p for p in params], f32),
        ([s & 0x7FFFFFFFFFFFFFFF for s in seeds], i64),
        (offsets, i64),
    ]
    use_penalties = any(p.uses_penalties for p in params)
    if use_penalties:
        parts += [
            (_pad(prompt_ids), i64),
            (_pad(output_ids), i64),
            ([p.repetition_penalty for p in params], f32),
            ([p.presence_penalty for p in params], f32),
            ([p.frequency_penalty for p in params], f32),
        ]
    staged = staging.stage(parts)
    rows = [i for i, ids in enumerate(banned_ids) for _ in ids]
    cols = [t for ids in banned_ids for t in ids]
    wants = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperature=staged[0], top_k=staged[1], top_p=staged[2], min_p=staged[3], seeds=staged[4],
        offsets=staged[5],
        all_greedy=all(p.greedy for p in params),
        any_masks=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        penalties=tuple(staged[6:]) if use_penalties else None,
        banned=(rows, cols) if rows else None,
        max_logprobs=max(wants) if wants else None,
    )


def plain_greedy(params: list, banned_ids: list[tuple[int, ...]]) -> bool:
    """Rows whose sampling is the greedy argmax of the raw logits and nothing else (`Sampler.greedy`): greedy,
    no penalties, no logprobs, no banned ids; what `Sampler.__call__` does for such a batch."""
    return (all(p.greedy and not p.uses_penalties and p.logprobs is None for p in params)
            and not any(banned_ids))


class Sampler:
    def __init__(self) -> None:
        # resolved once, as the model does (DEEPINFER_KERNEL_BACKEND=torch keeps the references here too):
        # "device" = the Triton greedy argmax on CUDA, the torch reference elsewhere
        self.kernel_backend = backend_from_env()

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[N] int64 ids of plain greedy rows (`plain_greedy`): the argmax and the finiteness check of the raw
        logits [N, V] in one two-stage pass (INVALID_TOKEN where not finite)."""
        return greedy_argmax(logits, invalid=INVALID_TOKEN, backend=self.kernel_backend)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] float32 raw model outputs (row order = batch rows)."""
        raw = logits
        if batch.all_greedy and batch.penalties is None and batch.banned is None and batch.max_logprobs is None:
            return SamplerOutput(token_ids=self.greedy(raw))
        # amax propagates NaN: one reduction flags NaN, +Inf and all -Inf rows. Every op below is row-wise, so a
        # bad row yields garbage only in its own row, which is replaced by INVALID_TOKEN at the end.
        finite = torch.isfinite(raw.amax(dim=-1))
        if batch.penalties is not None:
            prompt_ids, output_ids, rep, pres, freq = batch.penalties
            logits = apply_penalties(logits, prompt_ids=prompt_ids, output_ids=output_ids, repetition_penalty=rep,
                                     presence_penalty=pres, frequency_penalty=freq)
        if batch.banned is not None:
            rows, cols = batch.banned
            logits = logits.clone() if logits is raw else logits
            at = to_device([rows, cols], torch.int64, logits.device)  # one copy for both index vectors
            logits[at[0], at[1]] = float("-inf")
        if batch.all_greedy:
            tokens = greedy_argmax(logits, backend=self.kernel_backend)
        else:
            tokens = sample(logits, temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p,
                            min_p=batch.min_p, seeds=batch.seeds, offsets=batch.offsets, apply_masks=batch.any_masks)
        lps = None
        if batch.max_logprobs is not None:
            lps = logprobs_topk(raw, tokens, batch.max_logprobs)
        tokens = torch.where(finite, tokens, torch.full_like(tokens, INVALID_TOKEN))
        return SamplerOutput(token_ids=tokens, logprobs=lps)
