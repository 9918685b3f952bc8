"""The device token ring of Engram models (docs/engram_device_hashing.md): each slot's last input ids by position.

``ring [slots + 1, R] int64`` on the cache's device, row = position mod R, -1 = never written; R = max_ngram +
the cache slack: the max_ngram - 1 ids before a resume position stay intact after a rolled-back speculative tail
of up to slack + 1 tokens (the rollback the cache allows, ModelCache.check_resume). The last slot is the cache's
scratch slot.

Both functions take the step's device tensors only (ids, positions, the token -> sequence map and per-sequence
ints), so the ids may be ones the host has not seen yet (asynchronous placeholders) and a CUDA graph can capture
them with its static buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ring_predecessors", "ring_store"]


def ring_predecessors(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_slot: Tensor,
    back: int,
) -> Tensor:
    """``[T, back] int64``: column s-1 is the id at position p-s of token t's sequence (p = positions[t]), -1 where
    p-s < 0 or the ring never got it. Positions inside the step come from ``token_ids`` (sequence-major rows,
    token t's predecessor s at row t-s), older ones from the ring row of the sequence's slot. Read the ring
    BEFORE `ring_store` writes this step's ids."""
    R = ring.shape[1]
    s = torch.arange(1, back + 1, dtype=torch.int64, device=token_ids.device)[None, :]  # [1, back]
    local = (positions - seq_ctx[seq_of_token])[:, None]  # [T, 1] index of the token inside its sequence's step
    q = positions[:, None] - s  # [T, back] predecessor positions
    rows = torch.arange(token_ids.shape[0], dtype=torch.int64, device=token_ids.device)[:, None] - s
    in_step = token_ids[rows.clamp(min=0)]
    slot = seq_slot[seq_of_token][:, None]
    in_ring = ring.reshape(-1)[slot * R + q.remainder(R)]
    out = torch.where(local >= s, in_step, in_ring)
    return torch.where(q >= 0, out, torch.full_like(out, -1))


def ring_store(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_qlen: Tensor, seq_ctx: Tensor,
    seq_slot: Tensor, dump_slot: int,
) -> None:
    """Write the step's ids into their slots' rows at position mod R. Only each sequence's last R tokens are
    kept (earlier ones would share rows with them); the others go to ``dump_slot`` (the scratch slot, read only
    by padding rows), so every write has a fixed shape and no two kept writes hit the same row."""
    R = ring.shape[1]
    local = positions - seq_ctx[seq_of_token]
    keep = local >= seq_qlen[seq_of_token] - R
    slot = torch.where(keep, seq_slot[seq_of_token], torch.full_like(local, dump_slot))
    ring.view(-1).index_copy_(0, slot * R + positions.remainder(R), token_ids)
