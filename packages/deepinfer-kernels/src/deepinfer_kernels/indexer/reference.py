"""Pure-torch reference of the V4.1 lightning indexer (docs/model.md §C.4): scores, causal top-k, candidates.

All functions work on ONE sequence: its T new queries against the N compressed entries that exist for it
(entry w of a ratio-r kv source covers tokens r*w .. r*w+r-1). Batched GPU kernels must match these
bit-for-bit in selection (same ties rule) and to fp32 rounding in scores.

Tie rule [I]: the spec does not say how equal scores are ordered; exact ties are common (ReLU makes many
head terms exactly 0), so we break them by the LOWER entry index (stable descending sort). This keeps the
selection independent of how a sequence is chunked into forwards.
"""

from __future__ import annotations

import torch
from torch import Tensor


def index_scores(q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
    """Lightning-indexer scores ``score[t, w] = Σ_h weights[t, h] · ReLU(q[t, h] · keys[w])``.

    q: ``[T, H, D]`` indexer queries (already RoPE'd), weights: ``[T, H]`` head weights (already scaled by
    ``D^-0.5 · H^-0.5`` by the caller), keys: ``[N, D]`` index keys of the kv source. Returns ``[T, N] float32``.
    """
    if q.dim() != 3 or weights.dim() != 2 or keys.dim() != 2:
        raise ValueError(
            f"index_scores: expected q [T,H,D], weights [T,H], keys [N,D]; found q {tuple(q.shape)}, "
            f"weights {tuple(weights.shape)}, keys {tuple(keys.shape)}"
        )
    if q.shape[:2] != weights.shape or q.shape[2] != keys.shape[1]:
        raise ValueError(
            f"index_scores: shape mismatch q {tuple(q.shape)}, weights {tuple(weights.shape)}, "
            f"keys {tuple(keys.shape)}"
        )
    logits = torch.einsum("thd,nd->thn", q.float(), keys.float())  # [T, H, N]
    return torch.einsum("thn,th->tn", torch.relu(logits), weights.float())


def index_scores_per_query(q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
    """`index_scores` of each query against its own keys only: q ``[T, H, D]``, weights ``[T, H]``, keys
    ``[T, N, D]`` -> ``[T, N] float32`` (a fixed-shape decode step: one query per sequence, N entry slots each)."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or keys.dim() != 3 or keys.shape[0] != q.shape[0] \
            or keys.shape[2] != q.shape[2]:
        raise ValueError(f"index_scores_per_query: q {tuple(q.shape)}, weights {tuple(weights.shape)}, keys "
                         f"{tuple(keys.shape)}; expected [T, H, D], [T, H], [T, N, D]")
    logits = torch.einsum("thd,tnd->thn", q.float(), keys.float())
    return torch.einsum("thn,th->tn", torch.relu(logits), weights.float())


def visible_counts(positions: Tensor, ratio: int) -> Tensor:
    """Number of compressed entries visible to each query: ``floor((t + 1) / ratio)``; ``[T] int64``."""
    if ratio < 1:
        raise ValueError(f"visible_counts: ratio must be >= 1, found {ratio}")
    return torch.div(positions.long() + 1, ratio, rounding_mode="floor")


def causal_mask(scores: Tensor, visible: Tensor) -> Tensor:
    """Set ``scores[t, w] = -inf`` for ``w >= visible[t]`` (entry not yet complete for query t)."""
    n = scores.shape[-1]
    w = torch.arange(n, device=scores.device)
    return scores.masked_fill(w[None, :] >= visible[:, None], float("-inf"))


def _stable_topk(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries per row, ties -> lower index first, -inf entries -> -1. ``[T, k]``."""
    t, n = values.shape
    out = torch.full((t, k), -1, dtype=torch.int64, device=values.device)
    kk = min(k, n)
    if kk == 0:
        return out
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :kk]
    top_vals = torch.gather(values, 1, order)
    order = order.masked_fill(top_vals == float("-inf"), -1)
    out[:, :kk] = order
    return out


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """Causal top-k: ``[T, k] int64`` entry ids, valid ids sorted ascending first, then -1 padding.

    ``scores`` must already be causally masked (-inf = not selectable). The number of valid ids per row is
    ``min(k, #finite scores)``, i.e. ``min(index_topk, visible)`` for a causally masked row.
    """
    if k < 1:
        raise ValueError(f"topk_indices: k must be >= 1, found {k}")
    sel = _stable_topk(scores, k)
    # Sort the valid ids ascending (as a set the selection is what matters; a canonical order makes
    # "Reuse layers see identical indices" and chunked-vs-full comparisons exact). -1 sorts last via a key.
    big = torch.iinfo(torch.int64).max
    key = sel.masked_fill(sel < 0, big)
    ordered = torch.sort(key, dim=-1).values
    return ordered.masked_fill(ordered == big, -1)


def candidate_blocks(
    scores: Tensor, visible: Tensor, block_size: int, topk_blocks: int
) -> tuple[Tensor, Tensor]:
    """Candidate publisher: choose up to ``topk_blocks`` blocks of ``block_size`` entries per query.

    scores: ``[T, N]`` causally masked publisher scores; visible: ``[T] int64`` visible entry counts.
    Block b = entries ``[b*block_size, (b+1)*block_size)``; block score = max of its entries' scores; the block
    holding the newest visible entry (``visible-1``) is pinned (+inf) so it is always kept; blocks with no
    visible entry are never chosen. Returns ``(block_ids [T, topk_blocks] int64 ascending, -1 padded,
    allowed [T, N] bool)`` where ``allowed[t, w]`` is true iff w is visible and its block was chosen (CB(t)).
    """
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(
            f"candidate_blocks: block_size and topk_blocks must be >= 1, found {block_size}, {topk_blocks}"
        )
    t, n = scores.shape
    nb = -(-n // block_size)
    padded = torch.full((t, nb * block_size), float("-inf"), dtype=torch.float32, device=scores.device)
    padded[:, :n] = scores.float()
    block_score = padded.view(t, nb, block_size).amax(dim=-1)  # [T, nb]
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")  # [T]; -1 .. when nothing visible
    # pin with a mask rather than nonzero() + scatter: no host sync (this runs once per layer on the GPU path)
    pinned = (torch.arange(nb, device=scores.device)[None, :] == newest[:, None]) & (visible > 0)[:, None]
    block_score = block_score.masked_fill(pinned, float("inf"))
    block_ids = (
        topk_indices(block_score, topk_blocks)
        if nb > 0
        else torch.full((t, topk_blocks), -1, dtype=torch.int64, device=scores.device)
    )
    chosen = torch.zeros((t, nb + 1), dtype=torch.bool, device=scores.device)
    # Scatter into column nb (a dump column) for the -1 padding, then drop it.
    chosen.scatter_(1, block_ids.masked_fill(block_ids < 0, nb), True)
    entry_block = torch.arange(n, device=scores.device) // block_size
    allowed = chosen[:, :nb][:, entry_block] & (
        torch.arange(n, device=scores.device)[None, :] < visible[:, None]
    )
    return block_ids, allowed


def store_rows(sel: Tensor, seq_of_token: Tensor, seq_offsets: Tensor, rows: Tensor) -> Tensor:
    """Per-sequence entry ids -> rows of the compressed store: ``out[t, j] = rows[seq_offsets[seq_of_token[t]] +
    sel[t, j]]``, -1 where ``sel`` is -1. sel ``[T, K] int64``, seq_of_token ``[T]``, seq_offsets ``[S]`` (each
    sequence's first entry in ``rows``), rows ``[E] int64`` -> ``[T, K] int64``."""
    if rows.numel() == 0:
        return torch.full_like(sel, -1)
    flat = (sel + seq_offsets[seq_of_token][:, None]).clamp(0, rows.numel() - 1)
    return torch.where(sel >= 0, rows[flat], torch.full_like(sel, -1))
