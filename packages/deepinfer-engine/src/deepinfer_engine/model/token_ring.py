"""The device token ring of Engram models (docs/async_scheduling.md): each slot's last input ids by position.

``ring [slots + 1, R] int64`` on the cache's device, row = position mod R, -1 = never written; R = max_ngram +
the cache slack: the max_ngram - 1 ids before a resume position stay intact after a rolled-back speculative tail
of up to slack + 1 tokens (the rollback the cache allows, ModelCache.check_resume). The last slot is the cache's
scratch slot.

`ring_step` takes the step's device tensors only (ids, positions, the token -> sequence map and per-sequence
ints), so the ids may be ones the host has not seen yet (asynchronous placeholders) and a CUDA graph can capture
them with its static buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ring_step"]


def ring_step(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_qlen: Tensor,
    seq_slot: Tensor, *, back: int, dump_slot: int,
) -> Tensor:
    """Each token's predecessors ``[T, back] int64``, then the step's ids written into the ring.

    Column s-1 is the id at position p-s of token t's sequence (p = positions[t]), -1 where p-s < 0 or the ring
    never got it. Positions inside the step come from ``token_ids`` (sequence-major rows: token t's predecessor s
    is row t-s), older ones from the ring row of the sequence's slot, read before this step's writes.

    The write puts each id at row position mod R of its slot. Only each sequence's last R tokens are kept
    (earlier ones would share rows with them); the others go to ``dump_slot`` (the scratch slot, read only by
    padding rows), so every write has a fixed shape and no two kept writes hit the same row.
    token_ids, positions, seq_of_token: [T] int64; seq_ctx (first new position), seq_qlen, seq_slot: [S] int64."""
    R = ring.shape[1]
    flat = ring.view(-1)
    s = torch.arange(1, back + 1, dtype=torch.int64, device=token_ids.device)  # [back]
    local = positions - seq_ctx[seq_of_token]  # [T] index of the token inside its sequence's step
    base = seq_slot[seq_of_token] * R  # [T] first ring cell of the token's slot
    q = positions[:, None] - s  # [T, back] predecessor positions
    rows = torch.arange(token_ids.shape[0], dtype=torch.int64, device=token_ids.device)[:, None] - s
    in_step = token_ids[rows.clamp_(min=0)]
    in_ring = flat[base[:, None] + q.remainder(R)]
    prev = torch.where(local[:, None] >= s, in_step, in_ring.masked_fill_(q < 0, -1))
    keep = local >= seq_qlen[seq_of_token] - R
    dst = torch.where(keep, base, dump_slot * R) + positions.remainder(R)
    flat.index_copy_(0, dst, token_ids)
    return prev
