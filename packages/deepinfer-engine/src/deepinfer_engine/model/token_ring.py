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

from deepinfer_kernels.engram import ring_step as _ring_step
from torch import Tensor

__all__ = ["ring_step"]


def ring_step(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_qlen: Tensor,
    seq_slot: Tensor, *, back: int, dump_slot: int, backend: str = "auto",
) -> Tensor:
    """Each token's predecessors ``[T, back] int64``, then the step's ids written into the ring.

    Column s-1 is the id at position p-s of token t's sequence (p = positions[t]), -1 where p-s < 0 or the ring
    never got it. Positions inside the step come from ``token_ids`` (sequence-major rows: token t's predecessor s
    is row t-s), older ones from the ring row of the sequence's slot, read before this step's writes.

    The write puts each id at row position mod R of its slot. Only each sequence's last R tokens are kept
    (earlier ones would share rows with them); the others go to ``dump_slot`` (the scratch slot, read only by
    padding rows), so every write has a fixed shape and no two kept writes hit the same row.
    token_ids, positions, seq_of_token: [T] int64; seq_ctx (first new position), seq_qlen, seq_slot: [S] int64.
    backend: the kernel backend (deepinfer_kernels.engram.ring_step: two Triton launches on CUDA)."""
    return _ring_step(ring, token_ids, positions, seq_of_token, seq_ctx, seq_qlen, seq_slot, back=back,
                      dump_slot=dump_slot, backend=backend)  # fmt: skip
