"""Pure-torch sampling reference: penalties, min-p / top-k / top-p masking, counter-based seeded sampling.

Everything is batched over rows (one row = one sequence's next-token distribution) and runs on whatever device
the inputs live on; nothing here reads a tensor value back to the host, so a step costs no per-request syncs.

Randomness is counter-based: the uniform noise of row i is a pure function of (seed_i, offset_i, vocab index),
so a request's sampled tokens depend only on its own seed and output position — never on which other requests
share the batch, on chunking, or on preemption.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31 so that (x < 2**32) * c stays below 2**63: exact in int64 on every backend.
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer avalanche hash of 32-bit values held in int64 (lowbias32-style); returns values in [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    x = x ^ (x >> 16)
    return x


def counter_uniform(seeds: torch.Tensor, offsets: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Uniform noise in the open interval (0, 1), a pure function of (seed, offset, column).

    seeds: [N] int64 (any 64-bit value); offsets: [N] int64 (e.g. the output position being sampled);
    returns [N, num_cols] float32. Values are k/2**24 + 2**-25, never 0 or 1, so -log(u) is finite and > 0
    (the top value 1 - 2**-25 is not a float32 and would round to 1.0: it is clamped to 1 - 2**-24; at 1.0 the
    exponential race divided by -log(1) = 0 and picked masked tokens through NaN).
    """
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    row_key = _mix32(lo ^ _mix32(hi + _GOLDEN))
    row_key = _mix32(row_key ^ _mix32(offsets & _M32))
    row_key2 = _mix32(row_key + _C2)
    cols = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)
    h = _mix32(row_key[:, None] + cols[None, :] * _GOLDEN)
    h = _mix32(h ^ row_key2[:, None])
    return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp(max=1.0 - 2.0**-24)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrence counts per vocabulary id.

    token_ids: [N, L] int64, -1 = padding; returns [N, vocab_size] int32.
    """
    n = token_ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    idx = torch.where(token_ids < 0, vocab_size, token_ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """OpenAI / vLLM-style penalties; returns new logits [N, V] float32.

    logits: [N, V] float32; prompt_ids / output_ids: [N, L] int64 padded with -1;
    repetition_penalty [N] (1 = off): tokens seen in prompt or output get logit/r if > 0 else logit*r;
    presence_penalty [N] (0 = off): minus p once per token present in the output;
    frequency_penalty [N] (0 = off): minus f times the token's output count.
    """
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab)
    seen = (token_counts(prompt_ids, vocab) > 0) | (out_counts > 0)
    rep = repetition_penalty.to(logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalty.to(logits.dtype)[:, None] * out_counts.to(logits.dtype)
    logits = logits - presence_penalty.to(logits.dtype)[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def mask_logits(
    logits: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside the min-p, top-k and top-p sets to -inf (applied in that order, as vLLM does).

    logits: [N, V] float32 (already temperature-scaled); top_k: [N] int64 (<= 0 or >= V = off);
    top_p: [N] float32 in (0, 1] (1 = off); min_p: [N] float32 in [0, 1] (0 = off).
    min-p keeps tokens with prob >= min_p * max prob; top-p keeps the smallest prefix (by descending prob, ties
    by index order of the sort) whose mass reaches top_p, computed after min-p/top-k renormalisation.
    The most likely token is always kept. Returns [N, V] float32.
    """
    n, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).to(torch.int64)[:, None]
    drop = ranks >= k
    # min-p in log space: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    log_min_p = torch.log(min_p.to(torch.float32).clamp_min(0.0))[:, None]
    drop |= sorted_logits < sorted_logits[:, :1] + log_min_p
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(kept, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.to(torch.float32)[:, None]
    drop[:, 0] = False
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, kept)


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    apply_masks: bool = True,
) -> torch.Tensor:
    """Sample one token per row without host syncs.

    logits: [N, V] float32 (penalties already applied); temperature: [N] float32, 0 = greedy (argmax);
    top_k/top_p/min_p as in `mask_logits`; seeds/offsets: [N] int64 keys of the counter-based noise.
    Sampling is an exponential race: argmax_i p_i / E_i with E_i = -log(u_i) ~ Exp(1), which draws i with
    probability p_i (equivalent to Gumbel-max on log p). Returns [N] int64 token ids.
    apply_masks=False skips the (sorting) min-p/top-k/top-p step; the caller knows from the host-side
    parameters that no row uses them.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = logits / temp[:, None]
    if apply_masks:
        scaled = mask_logits(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = torch.softmax(scaled, dim=-1)
    expo = -torch.log(counter_uniform(seeds, offsets, logits.shape[1]))
    sampled = (probs / expo).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def logprobs_topk(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Log-probabilities of the raw model distribution.

    logits: [N, V] float32; token_ids: [N] int64 (the sampled/selected token per row); k >= 0.
    Returns (selected_logprob [N] float32, top_ids [N, k] int64, top_logprobs [N, k] float32,
    selected_rank [N] int64 = 1 + number of tokens with a strictly larger logprob).
    """
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = logp.gather(1, token_ids[:, None].to(torch.int64))
    rank = (logp > chosen).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = logp.topk(k, dim=-1)
    else:
        top_vals = logp.new_empty(logp.shape[0], 0)
        top_ids = torch.empty(logp.shape[0], 0, dtype=torch.int64, device=logp.device)
    return chosen[:, 0], top_ids, top_vals, rank


def greedy_argmax(logits: torch.Tensor, *, invalid: int | None = None) -> torch.Tensor:
    """Greedy token ids [N] int64 of logits [N, V]: torch.argmax over the last dim (ties: the lowest index; a
    NaN counts as the largest value, the first NaN wins). invalid: the id returned for rows whose max is not
    finite (a NaN, +Inf, or every entry -Inf); None keeps the argmax of every row."""
    ids = logits.argmax(dim=-1)
    if invalid is None:
        return ids
    return torch.where(torch.isfinite(logits.amax(dim=-1)), ids, torch.full_like(ids, invalid))


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One id per row of unnormalised non-negative `weights [N, V] float`: the first id whose cumulative weight
    exceeds u * total (`uniforms [N]` in [0, 1)). Zero-weight ids are never chosen; a row whose weights are all
    zero gives V - 1. Returns [N] int64."""
    cdf = torch.cumsum(weights, dim=-1)
    x = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp(max=weights.shape[-1] - 1)


def softmax_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    *,
    probs_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw from softmax(logits / temperature), row by row.

    logits: [N, V] float32 (finite); temperature: [N] float32, 0 = greedy row (takes the argmax), None = every row
    greedy; uniforms: [N] float32 in [0, 1) (with temperature). probs_out: [N, V] float32 (may be `logits`
    itself) written with each row's distribution: softmax(logits / T) for sampled rows, one-hot at the argmax for
    greedy rows; not written when temperature is None. Returns (tokens [N] int64, argmax [N] int64; ties: the
    lowest index)."""
    best = logits.argmax(dim=-1)
    if temperature is None:
        return best, best
    sampled = temperature > 0
    safe = torch.where(sampled, temperature, torch.ones_like(temperature)).to(torch.float32)
    probs = torch.softmax(logits.to(torch.float32) / safe[:, None], dim=-1)
    tokens = torch.where(sampled, inverse_cdf_sample(probs, uniforms), best)
    if probs_out is not None:
        onehot = torch.zeros_like(probs).scatter_(1, best[:, None], 1.0)
        probs_out.copy_(torch.where(sampled[:, None], probs, onehot))
    return tokens, best


def logsumexp_rows(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log sum_v exp(logits[r, v] / temperature[r]) per row: logits [R, V] float, temperature [R] float32 > 0 ->
    [R] float32. With it, p[r, v] = exp(logits[r, v] / T[r] - lse[r]) is read where needed, without writing the
    distribution of every row."""
    return torch.logsumexp(logits.to(torch.float32) / temperature.to(torch.float32)[:, None], dim=-1)


def residual_sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    draft_probs: torch.Tensor | None,
    positions: torch.Tensor | None,
    rejected: torch.Tensor,
    uniforms: torch.Tensor,
    alpha: float = 1.0,
) -> torch.Tensor:
    """The correction / bonus draw of speculative rejection sampling, one per request b: p = softmax(logits[rows[b]]
    / temperature[rows[b]]); where `rejected[b]`, the residual max(0, p - alpha * draft_probs[b, positions[b]])
    (p itself when the residual is all zero), else p; then `inverse_cdf_sample` with uniforms[b]. `lse` is not read
    here (the Triton kernel reads p as exp(l / T - lse)); draft_probs None: p for every request. Returns [B] int64."""
    p = torch.softmax(logits[rows].to(torch.float32) / temperature[rows].to(torch.float32)[:, None], dim=-1)
    if draft_probs is None:
        return inverse_cdf_sample(p, uniforms.to(torch.float32))
    q = draft_probs[torch.arange(rows.shape[0], device=rows.device), positions].to(torch.float32)
    residual = torch.clamp(p - alpha * q, min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) <= 0, p, residual)
    return inverse_cdf_sample(torch.where(rejected[:, None], residual, p), uniforms.to(torch.float32))
