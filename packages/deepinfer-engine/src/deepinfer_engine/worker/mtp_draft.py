"""V4's MTP block as a one-token draft model (`speculative_method="mtp"`, the baseline DSpark is compared with).

The MTP block predicts the token after next from the target's final streams R_t (before the head collapse) and the
next token's embedding, at the next token's position (docs/model.md §A.9): the entry for position s reads
(R_{s-1}, x_s) and its own sliding-window ring of earlier entries. So, unlike DSpark, its draft comes AFTER a target
forward: once a step has decided which of its positions are part of each sequence and which token comes next,
`after_step` runs the block over those positions (rows = the target's streams of positions s - 1, tokens = the
sequence's tokens at s, the last one the token just emitted) and keeps the logits of the last row as the request's
pending draft for the next step. The next step's `draft_block` hands them to deepinfer-dspark's proposal
(sampling with the request's temperature and the counter-based draft uniforms), exactly as a parallel drafter's
block of N = 1 positions. Rejected positions are never run through the block, so its ring holds only accepted
entries; a request whose last step produced no pending draft (errors, a preemption) decodes plainly once.

The block's state at a resume position P (what a prefix-cache state block or a forked slot carries) is its
ring of entries before P plus the target's final streams of position P - 1 (`ModelCache.last_stream`, kept per
slot after every step); entry P itself depends on the token at P, which a request resuming there may not
share, so a chunk that starts where this drafter did not just write computes entry P first from those streams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from deepinfer_dspark import DraftBlock, DraftHeads
from torch import Tensor

from deepinfer_engine.core.sched_output import ScheduledChunk
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost

__all__ = ["MTPDrafter"]


class MTPDrafter:
    """`deepinfer_dspark.DraftModel` over V4's MTP block `mtp.0` (block size 1, no Markov / Confidence Head)."""

    def __init__(self, model: Any, cache: Any) -> None:
        self.model, self.cache = model, cache
        vocab = int(model.args.vocab_size)
        zeros = torch.zeros(vocab, 1, dtype=torch.float32, device=model.embed.weight.device)
        self._heads = DraftHeads(markov_embed=zeros, markov_head=zeros)  # no sequential correction
        self._pending: dict[int, tuple[int, Tensor]] = {}  # slot -> (anchor position, draft logits [V] f32)
        # slot -> (request, end of the entries this drafter wrote for it): entry `end - 1` is the resume position's
        self._written: dict[int, tuple[str, int]] = {}
        self.slots: Tensor | None = None
        self.round_host: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
        # optional replay of the block's pass (the engine's CUDA graphs, worker/cuda_graph.py): (batch, hidden
        # rows) -> logits of batch.logits_indices, or None (then it runs eagerly)
        self.block_runner: Callable[[ForwardBatch, Tensor], Tensor | None] | None = None

    block_size = 1

    @property
    def heads(self) -> DraftHeads:
        return self._heads

    def can_draft(self, slot: int, position: int) -> bool:
        """Whether the request in `slot` has a pending draft for the anchor at `position`."""
        got = self._pending.get(slot)
        return got is not None and got[0] == position

    def draft_block(self, anchor_ids: Tensor, anchor_positions: Tensor) -> DraftBlock:
        slots = self.round_host[0]
        logits = torch.stack([self._pending[int(s)][1] for s in slots])[:, None, :]  # [B, 1, V]
        return DraftBlock(base_logits=logits, hidden=logits.new_zeros(logits.shape[0], 1, 1))

    def after_step(self, chunks: Sequence[ScheduledChunk], keep: Mapping[str, int], next_ids: Mapping[str, Sequence[int]],
                   hidden: Tensor) -> None:
        """Run the MTP block over every position this step added to a sequence and keep each request's draft.

        keep[req]: rows of the chunk now part of the sequence (positions c .. c + k - 1); next_ids[req]: the
        sequence's tokens at positions c + 1 .. c + k (the last one the token this step emitted or the next
        prompt token); hidden: the target's final streams [T, n, d] of the step's rows.
        """
        rows, pos, ids, lens, slots, starts, last = [], [], [], [], [], [], []
        ends, req_ids = [], []  # the last kept row of each chunk (its streams are the slot's last_stream)
        captured: list[tuple[int, int]] = []  # (dest state slot, row of position - 1) of the step's captures
        self.cache.allocate_last_stream(tuple(hidden.shape[1:]), hidden.dtype)
        armed = self.cache.draft_captures
        num_rows, extra = int(hidden.shape[0]), False
        row, t = 0, 0
        for c in chunks:
            k = keep.get(c.req_id, 0)
            nxt = next_ids.get(c.req_id)
            if k > 0 and nxt is not None and len(nxt) == k:
                p = c.start_position
                # entry p (a resume position: a restored state block, a fork, a replay) from the slot's streams
                first = 0 < p and self._written.get(c.slot) != (c.req_id, p + 1) \
                    and p > self.cache.window_floor[c.slot]
                if first:
                    extra = True
                    rows.append(np.asarray([num_rows + c.slot], dtype=np.int64))
                rows.append(np.arange(row, row + k, dtype=np.int64))
                pos.append(np.arange(p + 1 - first, p + 1 + k, dtype=np.int64))
                ids.extend(([c.token_ids[0]] if first else []) + list(nxt))
                lens.append(k + first)
                slots.append(c.slot)
                starts.append(p + 1 - first)
                t += k + first
                last.append(t - 1)
                ends.append(row + k - 1)
                req_ids.append(c.req_id)
                captured.extend((dest, row + q - 1 - p) for q, dest in armed.get(c.slot, ()) if p < q < p + k)
            row += c.num_tokens
        for s in slots:
            self._pending.pop(s, None)
        if not lens:
            return
        device = hidden.device
        stream = self.cache.last_stream
        src = torch.cat([hidden, stream]) if extra else hidden
        dst_rows = slots + [d for d, _ in captured]
        src_rows = ends + [r for _, r in captured]
        ids_np = np.asarray(ids, dtype=np.int64)
        rows_np, pos_np = np.concatenate(rows), np.concatenate(pos)
        packed = torch.from_numpy(np.concatenate([rows_np, pos_np, ids_np, np.asarray(last, dtype=np.int64)]))
        sel, positions, input_ids, li = packed.to(device).split([t, t, t, len(last)])
        tables = np.full((len(lens), 1), -1, dtype=np.int32)
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, query_lens=tuple(lens), slots=tuple(slots),
            block_tables=torch.from_numpy(tables).to(device), logits_indices=li,
            host=StepHost(ctx_lens=tuple(starts), input_ids=ids_np, block_tables=tables),
        )  # fmt: skip
        rows = src.index_select(0, sel)
        logits = self.block_runner(batch, rows) if self.block_runner is not None and not armed else None
        if logits is None:
            logits = self.model.forward_mtp(batch, self.cache, rows, 0)
        logits = logits.float()
        # the slots' (and captured state blocks') streams of their resume position - 1, after the block read them
        at = torch.from_numpy(np.asarray(dst_rows + src_rows, dtype=np.int64)).to(device)
        stream.index_copy_(0, at[: len(dst_rows)], hidden.index_select(0, at[len(dst_rows):]))
        for i, (s, start, n, rid) in enumerate(zip(slots, starts, lens, req_ids)):
            self._pending[s] = (start + n - 1, logits[i])
            self._written[s] = (rid, start + n)
