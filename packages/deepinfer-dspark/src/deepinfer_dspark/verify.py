"""Verification of speculative drafts against the target model: greedy acceptance and exact rejection-sampling
acceptance (docs/dspark.md), batched over requests that verify different numbers of drafts. Imports torch only.

Layout shared by every function here (B requests, N = max drafts in the batch, V vocab):
  target rows `[R, V]`, R = sum_b (num_drafts[b] + 1), sequence-major: request b owns num_drafts[b] + 1 consecutive
    rows; its row j is the target's next-token distribution after [anchor, d_1 .. d_j], so rows 0..m-1 verify
    d_1..d_m and row m (m = num_drafts[b]) gives the bonus token when every draft is accepted.
    (This is the order of the engine's `logits_indices` for a verify step.)
  draft_ids `[B, N] int64`: the proposals, entries at j >= num_drafts[b] are ignored (any value, e.g. -1).
  draft_probs `[B, N, V] float`: the distribution each draft was sampled from (after the request's temperature /
    top-k / top-p), only read at j < num_drafts[b].
  num_drafts: `[B]` ints in [0, N] (a sequence of ints or an int64 tensor).
Result: `AcceptResult.output_ids [B, N + 1] int64`, request b's emitted tokens first (num_accepted[b] drafts, then
  one correction or bonus token), -1 after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_kernels.sampling import inverse_cdf_sample, residual_sample
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError
from deepinfer_dspark.protocol import DraftProposal

__all__ = ["AcceptResult", "TargetLogits", "greedy_accept", "probs_from_logits", "rejection_accept", "row_plan",
           "verify", "verify_uniforms"]


@dataclass(frozen=True, kw_only=True)
class AcceptResult:
    """Outcome of one verification step.

    output_ids: `[B, N + 1] int64`, the num_accepted[b] + 1 emitted tokens of request b first, then -1.
    num_accepted: `[B] int64`, accepted drafts per request (0..num_drafts[b]).
    accept_prob: `[B, N] float32` analytic acceptance probability sum_v min(p, q) = 1 - TV(p, q) of every verified
        position (rejection sampling only; 0 at j >= num_drafts[b]) — the confidence head's training target, for
        calibration monitoring. None for greedy acceptance.
    """

    output_ids: Tensor
    num_accepted: Tensor
    accept_prob: Tensor | None = None

    @property
    def num_emitted(self) -> Tensor:
        """`[B] int64` tokens emitted per request (accepted drafts + the correction/bonus token)."""
        return self.num_accepted + 1

    def next_anchors(self) -> Tensor:
        """`[B] int64` the last emitted token of each request (correction or bonus): the next round's anchor,
        at position p + 1 + num_accepted (p = this round's anchor position)."""
        return self.output_ids.gather(1, self.num_accepted[:, None]).squeeze(1)

    def rejected(self, num_drafts: Sequence[int] | Tensor) -> Tensor:
        """`[B] int64` verified drafts that were rejected: the target forward wrote cache rows for positions
        p + 1 + num_accepted .. p + num_drafts that the accepted sequence does not contain (roll them back, or let
        the next step overwrite them)."""
        m = torch.as_tensor(num_drafts, dtype=torch.int64).to(self.num_accepted.device)
        return m - self.num_accepted

    def tokens(self) -> list[list[int]]:
        """Emitted token ids per request as Python lists (one host sync)."""
        rows = self.output_ids.tolist()
        counts = self.num_emitted.tolist()
        return [row[:n] for row, n in zip(rows, counts)]


@dataclass(frozen=True, kw_only=True)
class TargetLogits:
    """Sampled target rows given as logits, for `verify` / `_rejection_rows`: p[r] = softmax(logits[r] / T[r]) is
    read only where verification needs it (one value per verified draft, one row per request), so the [R, V]
    distribution of every row is never written (at 1,536 rows of 129,280 entries that was several fp32 passes of
    0.8 GB each). Without top-k / top-p / min-p: those need the masked distribution of every row.

    logits: `[R, V]` float (bf16 read as is); temperature: `[R] float32` > 0; lse: `[R] float32`
    log sum_v exp(logits / T) (`deepinfer_kernels.sampling.logsumexp_rows`)."""

    logits: Tensor
    temperature: Tensor
    lse: Tensor

    def at(self, rows: Tensor, ids: Tensor) -> Tensor:
        """p[rows, ids] (float32, any matching index shapes)."""
        return torch.exp(self.logits[rows, ids].float() / self.temperature[rows] - self.lse[rows])

    def rows(self, rows: Tensor) -> Tensor:
        """p[rows] (`[..., V] float32`)."""
        return torch.softmax(self.logits[rows].float() / self.temperature[rows][..., None], dim=-1)


def row_plan(num_drafts: Sequence[int] | np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """On the host: (num_drafts `[B] int64`, the `[B, N + 1] int64` row index of `_row_index`, total target rows
    sum(num_drafts + 1)), the counts checked against draft_ids' width N. Callers that copy several host arrays per
    round pass the first two to `verify(plan=...)` in their own copy (the engine stages them with the round's
    other inputs in one pinned copy)."""
    m = np.asarray(num_drafts).astype(np.int64, copy=False)
    if m.ndim != 1:
        raise DSparkInputError(f"num_drafts: expected a [B] sequence, found shape {m.shape}")
    lens = m + 1
    if m.size and (int(m.min()) < 0 or int(m.max()) > width):
        raise DSparkInputError(
            f"num_drafts: expected values in [0, {width}] (draft_ids has {width} columns), found "
            f"[{int(m.min())}, {int(m.max())}]"
        )
    index = (np.cumsum(lens) - lens)[:, None] + np.minimum(np.arange(width + 1)[None, :], m[:, None])
    return m, index, int(lens.sum())


def _plan(num_drafts: Sequence[int] | Tensor | np.ndarray, batch: int, width: int, device: torch.device,
          num_rows: int, given: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(num_drafts `[B] int64`, the `[B, N + 1]` row index `_row_index`), both on `device`, after checking the
    counts against draft_ids' width and the target's `num_rows` = sum(num_drafts + 1). Counts the caller keeps on
    the host (a sequence, a NumPy array, a CPU tensor: the engine's) are checked and indexed there and copied over
    at once: no device sync, and one copy instead of the dozen small launches of the index (the verification of a
    round is bound by its launches on the H200's host). given: that pair already on the device (`row_plan`), then
    only checked. Counts on a device are read once for the checks."""
    if isinstance(num_drafts, Tensor) and num_drafts.device.type != "cpu":
        m = num_drafts.to(torch.int64)
        if m.shape != (batch,):
            raise DSparkInputError(f"num_drafts: expected shape ({batch},) (one per draft_ids row), found {tuple(m.shape)}")
        lo, hi, total = (int(v) for v in torch.stack([m.min(), m.max(), m.sum()]).tolist()) if batch else (0, 0, 0)
        _check_counts(lo, hi, total + batch, width, num_rows)
        if given is not None:
            return given
        m = m.to(device)
        return m, _row_index(m, width)
    host = num_drafts.numpy() if isinstance(num_drafts, Tensor) else num_drafts
    if np.shape(host) != (batch,):
        raise DSparkInputError(f"num_drafts: expected shape ({batch},) (one per draft_ids row), found {np.shape(host)}")
    if given is not None:  # the caller built the index from these counts (`row_plan`): the checks only
        if tuple(given[0].shape) != (batch,) or tuple(given[1].shape) != (batch, width + 1):
            raise DSparkInputError(f"plan: expected [{batch}] and [{batch}, {width + 1}] tensors, found "
                                   f"{tuple(given[0].shape)} / {tuple(given[1].shape)}")
        m = np.asarray(host).astype(np.int64, copy=False)
        lo, hi = (int(m.min()), int(m.max())) if batch else (0, 0)
        _check_counts(lo, hi, int(m.sum()) + batch, width, num_rows)
        return given
    m, index, rows = row_plan(host, width)
    _check_counts(0, 0, rows, width, num_rows)
    packed = torch.from_numpy(np.concatenate([m, index.reshape(-1)]))
    packed = packed.to(device, non_blocking=device.type == "cuda")
    return packed[:batch], packed[batch:].view(batch, width + 1)


def _check_counts(lo: int, hi: int, rows: int, width: int, num_rows: int) -> None:
    if lo < 0 or hi > width:
        raise DSparkInputError(
            f"num_drafts: expected values in [0, {width}] (draft_ids has {width} columns), found [{lo}, {hi}]"
        )
    if rows != num_rows:
        raise DSparkInputError(f"target: expected sum(num_drafts + 1) = {rows} rows, found {num_rows}")


def _check_draft_ids(draft_ids: Tensor) -> None:
    if not isinstance(draft_ids, Tensor) or draft_ids.dim() != 2 or draft_ids.dtype.is_floating_point:
        found = f"{tuple(draft_ids.shape)} {draft_ids.dtype}" if isinstance(draft_ids, Tensor) else type(draft_ids).__name__
        raise DSparkInputError(f"draft_ids: expected a [B, N] integer tensor, found {found}")


def _row_index(m: Tensor, width: int) -> Tensor:
    """`[B, N + 1]` index of each (request, position) into the varlen target rows; positions past a request's last
    row repeat its last row."""
    starts = torch.cumsum(m + 1, 0) - (m + 1)
    cols = torch.arange(width + 1, device=m.device)
    return starts[:, None] + torch.minimum(cols[None, :], m[:, None])


def greedy_accept(target: Tensor, draft_ids: Tensor, num_drafts: Sequence[int] | Tensor) -> AcceptResult:
    """Temperature-0 verification: accept the longest prefix of drafts equal to the target argmax at each row, then
    emit the target argmax of the first mismatching row (correction) or of row m (bonus).

    target: `[R, V]` logits or probabilities (only the argmax is used; exact ties -> the lowest token id).
    """
    _check_draft_ids(draft_ids)
    batch, width = draft_ids.shape
    if target.dim() != 2:
        raise DSparkInputError(f"target: expected [rows, vocab], found {tuple(target.shape)}")
    m, index = _plan(num_drafts, batch, width, target.device, target.shape[0])
    # argmax (first maximum) of the varlen rows, then gathered: no [B, N + 1, V] copy
    return _greedy_best(target.argmax(-1)[index], draft_ids, m)


def _greedy_best(best: Tensor, draft_ids: Tensor, m: Tensor) -> AcceptResult:
    """Greedy acceptance from the target argmax `best [B, N + 1]` of every (request, position)."""
    width = draft_ids.shape[1]
    device = best.device
    cols = torch.arange(width, device=device)
    match = (draft_ids.to(device, torch.int64) == best[:, :width]) & (cols[None, :] < m[:, None])
    num_accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(1)
    # Accepted drafts equal the argmax, so the emitted tokens are simply best[:, :a + 1].
    keep = torch.arange(width + 1, device=device)[None, :] <= num_accepted[:, None]
    output = torch.where(keep, best, torch.full_like(best, -1))
    return AcceptResult(output_ids=output, num_accepted=num_accepted)


def verify_uniforms(
    num_drafts: Sequence[int] | Tensor,
    width: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    *,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The uniforms `[B, N + 1] float32` in [0, 1) consumed by `rejection_accept`: column j < N decides draft j,
    column N samples the correction / bonus token.

    generator: one torch.Generator for the whole batch (one `rand(B, N + 1)` call; depends on the batch layout), or
    one per request: request b then draws exactly num_drafts[b] + 1 values from its own generator (acceptance
    uniforms, then the sampling uniform), so its result does not depend on the other requests or on N.
    Generators must live on `device`.
    """
    m = torch.as_tensor(num_drafts, dtype=torch.int64)
    batch = m.numel()
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(batch, width + 1, generator=generator, device=device)
    gens = list(generator)
    if len(gens) != batch:
        raise DSparkInputError(f"generator: expected one generator per request ({batch}), found {len(gens)}")
    out = torch.zeros(batch, width + 1, device=device)
    for b, (g, count) in enumerate(zip(gens, m.tolist())):
        draws = torch.rand(count + 1, generator=g, device=device)
        out[b, :count] = draws[:count]
        out[b, width] = draws[count]
    return out


def rejection_accept(
    target_probs: Tensor,
    draft_ids: Tensor,
    draft_probs: Tensor,
    num_drafts: Sequence[int] | Tensor,
    *,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    uniforms: Tensor | None = None,
    draft_prob_penalty: float = 1.0,
) -> AcceptResult:
    """Exact speculative (rejection) sampling: the emitted tokens are distributed as if sampled from the target
    one by one (Leviathan et al. / Chen et al.).

    For each request and j = 1..m: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (tested as
    u_j * q_j(d_j) < p_j(d_j), so q_j(d_j) = 0 accepts iff p_j(d_j) > 0). At the first rejection emit a sample of
    the residual max(0, p_j - alpha * q_j) / Z (falling back to p_j if it is all zero); if all m drafts are accepted
    emit a sample of the bonus row p_{m+1}.

    target_probs: `[R, V] float` normalised target distributions (after temperature / top-k / top-p), varlen rows.
    draft_probs: `[B, N, V] float` the draft distributions q_j the drafts were sampled from.
    generator / uniforms: randomness, see `verify_uniforms`; `uniforms [B, N + 1]` (e.g. `verify_counter_uniforms`)
        takes precedence; then the only host syncs left are the input checks (num_drafts range,
        row count, draft id range).
    draft_prob_penalty: alpha in the residual. 1.0 is the exact textbook rule; DeepInfer uses exp(-5e-5) so that a
        rounding-level p ~= q does not leave an all-zero residual (a tiny, bounded bias) [I].
    """
    _check_draft_ids(draft_ids)
    batch, width = draft_ids.shape
    device = target_probs.device
    if target_probs.dim() != 2:
        raise DSparkInputError(f"target: expected [rows, vocab], found {tuple(target_probs.shape)}")
    m, index = _plan(num_drafts, batch, width, device, target_probs.shape[0])
    vocab = target_probs.shape[-1]
    if draft_probs.shape != (batch, width, vocab):
        raise DSparkInputError(
            f"draft_probs: expected shape {(batch, width, vocab)} ([B, N, V]), found {tuple(draft_probs.shape)}"
        )
    if not target_probs.dtype.is_floating_point or not draft_probs.dtype.is_floating_point:
        raise DSparkInputError(
            f"target_probs / draft_probs: expected float probabilities, found {target_probs.dtype} / {draft_probs.dtype}"
        )
    if uniforms is None:
        uniforms = verify_uniforms(m.cpu(), width, generator, device=device)
    elif uniforms.shape != (batch, width + 1):
        raise DSparkInputError(f"uniforms: expected shape {(batch, width + 1)}, found {tuple(uniforms.shape)}")

    return _rejection_rows(target_probs, index, draft_ids, draft_probs, m, uniforms, draft_prob_penalty)


def _rejection_rows(
    target_probs: Tensor | TargetLogits, index: Tensor, draft_ids: Tensor, draft_probs: Tensor, m: Tensor,
    uniforms: Tensor, alpha: float, check_ids: bool = True, accept_prob: bool = True,
) -> AcceptResult:
    """Core of `rejection_accept` on the varlen target rows `[R, V]` and their `[B, N + 1]` index (`_row_index`).
    Reads the vocabulary-wide rows only where it needs them: the draft's probability per (request, position) is a
    gather of one value, and one row per request is read whole (the correction / bonus row). A `[B, N + 1, V]` copy
    of the rows cost a pass over every position of every request, verified or not; with `accept_prob` it made the
    verify span of a temperature-1 round at 256 requests about 1.7 ms longer on the H200, whatever the policy
    verified (docs/perf.md, "DSpark in steady state").
    check_ids: range-check the verified draft ids (one device read; callers that drafted them from this vocabulary
    skip it). accept_prob: also the analytic acceptance probability of every verified position (`AcceptResult`; a
    pass over `[B, N, V]` of both distributions, for statistics only). target_probs: the rows' probabilities, or
    `TargetLogits` (probabilities computed where read)."""
    batch, width = draft_ids.shape
    logits = isinstance(target_probs, TargetLogits)
    rows_of = target_probs.logits if logits else target_probs
    device = rows_of.device
    vocab = rows_of.shape[-1]
    dtype = torch.promote_types(torch.promote_types(torch.float32 if logits else rows_of.dtype, draft_probs.dtype),
                                torch.float32)
    p = None if logits else target_probs.to(dtype)
    q = draft_probs.to(dtype)
    ids = draft_ids.to(device, torch.int64)
    index = index.to(device)
    cols = torch.arange(width, device=device)
    verified = cols[None, :] < m[:, None]  # [B, N]
    safe_ids = torch.where(verified, ids, torch.zeros_like(ids))
    if check_ids and bool(((safe_ids < 0) | (safe_ids >= vocab)).any()):
        raise DSparkInputError(f"draft_ids: expected ids in [0, {vocab}) at verified positions")
    # [B, N]
    p_d = target_probs.at(index[:, :width], safe_ids).to(dtype) if logits else p[index[:, :width], safe_ids]
    q_d = q.gather(-1, safe_ids[..., None]).squeeze(-1)
    accept = (uniforms[:, :width].to(dtype) * q_d < p_d) & verified
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(1)  # [B]

    rows = torch.arange(batch, device=device)
    final_rows = index[rows, num_accepted]
    rejected = num_accepted < m
    at = num_accepted.clamp(max=width - 1) if width > 0 else None
    if logits and dtype == torch.float32:  # the correction / bonus rows read where drawn: no [B, V] distribution
        final = residual_sample(target_probs.logits, final_rows, target_probs.temperature, target_probs.lse,
                                q if width > 0 else None, at, rejected, uniforms[:, width].to(dtype), alpha=alpha)
    else:
        p_final = target_probs.rows(final_rows).to(dtype) if logits else p[final_rows]  # [B, V]
        weights = p_final
        if width > 0:
            residual = torch.clamp(p_final - alpha * q[rows, at], min=0)
            empty = residual.sum(-1, keepdim=True) <= 0
            residual = torch.where(empty, p_final, residual)
            weights = torch.where(rejected[:, None], residual, p_final)
        final = inverse_cdf_sample(weights, uniforms[:, width].to(dtype))

    pos = torch.arange(width + 1, device=device)[None, :]
    padded_ids = torch.cat([ids, torch.full((batch, 1), -1, dtype=torch.int64, device=device)], 1)
    output = torch.where(pos < num_accepted[:, None], padded_ids, torch.full_like(padded_ids, -1))
    output = torch.where(pos == num_accepted[:, None], final[:, None], output)
    if not accept_prob:
        return AcceptResult(output_ids=output, num_accepted=num_accepted)
    p_all = target_probs.rows(index[:, :width]).to(dtype) if logits else p[index[:, :width]]
    prob = torch.where(verified, torch.minimum(p_all, q).sum(-1), torch.zeros_like(p_d))
    return AcceptResult(output_ids=output, num_accepted=num_accepted, accept_prob=prob.to(torch.float32))


def verify(
    target_probs: Tensor | TargetLogits,
    proposal: DraftProposal,
    num_drafts: Sequence[int] | Tensor,
    *,
    greedy: bool | Sequence[bool] | Tensor = False,
    generators: Sequence[torch.Generator] | None = None,
    uniforms: Tensor | None = None,
    draft_prob_penalty: float = 1.0,
    argmax: Tensor | None = None,
    check_ids: bool = True,
    accept_prob: bool = True,
    plan: tuple[Tensor, Tensor] | None = None,
) -> AcceptResult:
    """Verify a proposal for a batch that mixes greedy and sampled requests.

    target_probs: `[R, V]` varlen target rows (see module docstring): probabilities for sampled requests; for greedy
        requests only the argmax is used, so softmax(logits) at any temperature > 0 works. Or `TargetLogits`: the
        rows' logits, read where needed (greedy rows then take `argmax`, or the logits' argmax).
    proposal: the `DraftProposal` of this round; only its first num_drafts[b] drafts are verified. Its draft_probs
        are required when any request samples.
    num_drafts / greedy: `[B]` values, or True / False for the whole batch. Passed on the host (sequences or CPU
        tensors, as the engine does), the checks and the greedy / sampled split need no device sync.
    generators: one per request (requests draw randomness only when they sample, see `verify_uniforms`).
    uniforms: `[B, N + 1]` explicit uniforms (e.g. `verify_counter_uniforms`), taking precedence over
        generators; rows of greedy requests are ignored.
    argmax: `[R] int64` the argmax of each target row when the caller has it (the engine takes it from the raw
        logits together with the finiteness check); greedy requests then copy no vocabulary-wide rows.
    check_ids: range-check the verified draft ids of sampled requests (one device read).
    accept_prob: the result's `accept_prob` of sampled requests (False: None, and no pass over `[B, N, V]`).
    plan: (num_drafts, row index) already on the target's device, as `row_plan` builds them from the same host
        num_drafts (the caller copied them with its other inputs); num_drafts is still read for the checks.
    """
    draft_ids = proposal.draft_ids
    batch, width = draft_ids.shape
    rows_of = target_probs.logits if isinstance(target_probs, TargetLogits) else target_probs
    device = rows_of.device
    if rows_of.dim() != 2:
        raise DSparkInputError(f"target: expected [rows, vocab], found {tuple(rows_of.shape)}")
    m, index = _plan(num_drafts, batch, width, device, rows_of.shape[0], plan)  # [B], [B, N + 1]
    host_mask = torch.as_tensor(greedy, dtype=torch.bool)
    if host_mask.dim() > 1 or (host_mask.dim() == 1 and host_mask.shape[0] != batch):
        raise DSparkInputError(
            f"greedy: expected a bool or a [{batch}] bool tensor, found shape {tuple(host_mask.shape)}")
    host_mask = host_mask.expand(batch)
    if generators is not None and len(generators) != batch:
        raise DSparkInputError(f"generators: expected one per request ({batch}), found {len(generators)}")
    sampled_host = (~host_mask).nonzero().squeeze(-1)
    greedy_host = host_mask.nonzero().squeeze(-1)
    if argmax is not None and argmax.shape != (rows_of.shape[0],):
        raise DSparkInputError(f"argmax: expected [{rows_of.shape[0]}] (one per target row), found "
                               f"{tuple(argmax.shape)}")

    def greedy_result(rows: Tensor | None) -> AcceptResult:  # rows None: every request (no row gathers)
        idx = index if rows is None else index[rows]
        best = argmax[idx] if argmax is not None else rows_of[idx].argmax(-1)
        return _greedy_best(best, draft_ids if rows is None else draft_ids[rows], m if rows is None else m[rows])

    if sampled_host.numel() == 0:
        return greedy_result(None)
    if proposal.draft_probs is None:
        raise DSparkInputError("proposal.draft_probs: required when a request samples (greedy is False), found None")
    if uniforms is not None and uniforms.shape != (batch, width + 1):
        raise DSparkInputError(f"uniforms: expected shape {(batch, width + 1)}, found {tuple(uniforms.shape)}")
    if greedy_host.numel() == 0 and uniforms is not None:  # every request samples: no row gathers / scatters
        return _rejection_rows(target_probs, index, draft_ids, proposal.draft_probs, m, uniforms.to(device),
                               draft_prob_penalty, check_ids, accept_prob)
    sampled = sampled_host.to(device, non_blocking=True)
    output = torch.full((batch, width + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    probs = torch.zeros(batch, width, dtype=torch.float32, device=device) if accept_prob else None
    if greedy_host.numel():
        greedy_rows = greedy_host.to(device, non_blocking=True)
        g = greedy_result(greedy_rows)
        output[greedy_rows], num_accepted[greedy_rows] = g.output_ids, g.num_accepted
    if uniforms is not None:
        u = uniforms.to(device)[sampled]
    else:
        chosen = None if generators is None else [generators[i] for i in sampled_host.tolist()]
        u = verify_uniforms(m[sampled].cpu(), width, chosen, device=device)
    r = _rejection_rows(
        target_probs, index[sampled], draft_ids[sampled], proposal.draft_probs[sampled], m[sampled], u,
        draft_prob_penalty, check_ids, accept_prob,
    )
    output[sampled], num_accepted[sampled] = r.output_ids, r.num_accepted
    if probs is not None:
        assert r.accept_prob is not None
        probs[sampled] = r.accept_prob
    return AcceptResult(output_ids=output, num_accepted=num_accepted, accept_prob=probs)


def probs_from_logits(logits: Tensor, temperature: float | Tensor) -> Tensor:
    """Softmax of `logits [..., V]` at `temperature` (> 0; a float or a tensor whose shape is a prefix of
    logits.shape[:-1], e.g. `[B]` for `[B, N, V]`), in float32. Temperature-0 requests use `greedy_accept`."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if bool((t <= 0).any()):
        raise DSparkInputError(f"temperature: expected > 0 for sampling (use greedy_accept for 0), found {temperature!r}")
    if t.dim() > 0:
        t = t.reshape(*t.shape, *([1] * (logits.dim() - t.dim())))
    return torch.softmax(logits.to(torch.float32) / t, dim=-1)
