"""`StageDrafter`: the model's DSpark draft stages (dspark.py) behind deepinfer-dspark's `DraftModel` protocol.

The engine owns the stages and their window rings; deepinfer-dspark owns everything after the parallel pass
(Markov sampling, confidence, verification budget, acceptance). One decode round, driven by the caller
(docs/dspark.md "Engine seam"): `propose(drafter, g, p, ...)` calls `draft_block`; the target verifies; the
target features of the accepted positions go back into the rings with `insert_context`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from deepinfer_dspark import DraftBlock, DraftHeads, DraftProposal
from torch import Tensor, nn

from deepinfer_engine.errors import InputError
from deepinfer_engine.model import dspark
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost

__all__ = ["StageDrafter"]


class StageDrafter:
    """`deepinfer_dspark.DraftModel` over `model.mtp` (the DSpark stages) and the cache rows of `block_tables`.

    block_tables: `[S, blocks] int32` of the S cache slots the drafter may serve; `slots` (`[B] int64`, default
    all S in order) names the slot of each request of the current round, row b of `draft_block`'s anchors.
    sts: the Confidence Head's STS temperature(s) (1.0 = uncalibrated; `DraftHeads.sts`).
    greedy_confidence: `[1, d + r]` a Confidence Head for temperature-0 requests (shipped beside the checkpoint,
        docs/dspark.md "Confidence heads"); None = the checkpoint's head serves every request.
    greedy_sts: STS temperature(s) of temperature-0 requests; None = `sts`.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: ModelCache,
        block_tables: Tensor,
        *,
        sts: float | tuple[float, ...] = 1.0,
        greedy_confidence: Tensor | None = None,
        greedy_sts: float | tuple[float, ...] | None = None,
    ) -> None:
        last = dspark.draft_stages(model)[-1]  # InputError when the model has no DSpark stages
        self.model, self.cache, self.block_tables = model, cache, block_tables
        self.slots = torch.arange(block_tables.shape[0], device=block_tables.device)
        self._last = last
        self.set_heads(sts=sts, greedy_confidence=greedy_confidence, greedy_sts=greedy_sts)
        # optional host copy of the round (slots, anchor ids, anchor positions) set by the caller with `slots`
        self.round_host: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
        # optional replay of the parallel pass (the engine's CUDA graphs, worker/cuda_graph.py): batch ->
        # dspark.DraftOutput of its rows, or None (then the pass runs eagerly); used when round_host is given
        self.block_runner: Callable[[ForwardBatch], dspark.DraftOutput | None] | None = None
        # optional replay of the pass AND the Markov sampling (one CUDA graph, `propose_block`): (batch, heads,
        # heads version, host temperatures or None, device seeds or None) -> DraftProposal of its rows, or None
        self.proposal_runner: Callable[..., DraftProposal | None] | None = None
        self.heads_version = 0  # bumped by set_heads: graphs that baked the heads in are keyed by it

    def _make_heads(self, sts: float | tuple[float, ...]) -> DraftHeads:
        last = self._last
        return DraftHeads(
            markov_embed=last.markov_head.w1, markov_head=last.markov_head.w2,
            confidence=last.confidence_head.proj.weight, sts=sts,
            greedy_confidence=self._greedy_confidence, greedy_sts=self._greedy_sts,
        )  # fmt: skip

    def set_heads(
        self,
        *,
        sts: float | tuple[float, ...] = 1.0,
        greedy_confidence: Tensor | None = None,
        greedy_sts: float | tuple[float, ...] | None = None,
    ) -> None:
        """Replace the confidence calibration (constructor arguments of the same names), e.g. a benchmark that
        compares the checkpoint's head alone with the shipped greedy head."""
        weight = self._last.confidence_head.proj.weight
        self._greedy_confidence = (
            None if greedy_confidence is None else greedy_confidence.to(weight.device, torch.float32).reshape(1, -1)
        )
        self._greedy_sts = greedy_sts
        self._heads = self._make_heads(sts)
        self.heads_version = getattr(self, "heads_version", -1) + 1

    @property
    def block_size(self) -> int:
        """N (the checkpoint's `dspark_block_size`)."""
        return int(self.model.args.dspark_block_size)

    @property
    def heads(self) -> DraftHeads:
        return self._heads

    def _round_batch(self, anchor_ids: Tensor, anchor_positions: Tensor) -> tuple[ForwardBatch, bool]:
        """The round's ForwardBatch of B blocks of N rows, and whether it carries the caller's host facts."""
        b, n = anchor_ids.shape[0], self.block_size
        if anchor_positions.shape != (b,) or self.slots.shape != (b,):
            raise InputError(
                f"StageDrafter.draft_block: found anchors {tuple(anchor_ids.shape)}, positions "
                f"{tuple(anchor_positions.shape)}, slots {tuple(self.slots.shape)}; expected all [B] "
                "(set drafter.slots to the cache slots of this round's requests)"
            )
        offsets = torch.arange(n, device=anchor_positions.device)
        ids = dspark.draft_block_ids(anchor_ids, n, self.model.args.dspark_noise_token_id)
        tables = self.block_tables[self.slots]
        host = None
        if self.round_host is not None:  # the caller's host copy: no device read-back before the forward
            slots, anchors, positions = self.round_host
            if len(slots) != b:
                raise InputError(f"StageDrafter.round_host: found {len(slots)} requests, expected {b}")
            block = np.full((b, n), self.model.args.dspark_noise_token_id, dtype=np.int64)
            block[:, 0] = anchors
            host = StepHost(ctx_lens=tuple(int(p) for p in positions), input_ids=block.reshape(-1),
                            block_tables=np.full(tuple(tables.shape), -1, dtype=np.int32))
        else:
            slots = tuple(self.slots.tolist())
        batch = ForwardBatch(
            input_ids=ids, positions=(anchor_positions[:, None] + offsets[None, :]).reshape(-1),
            query_lens=(n,) * b, slots=tuple(int(s) for s in slots), block_tables=tables,
            logits_indices=torch.zeros(1, dtype=torch.int64, device=anchor_ids.device), host=host,
        )  # fmt: skip
        return batch, host is not None

    def draft_block(self, anchor_ids: Tensor, anchor_positions: Tensor) -> DraftBlock:
        """anchor_ids / anchor_positions `[B] int64` (request b in cache slot `slots[b]`) -> base logits
        `[B, N, V] float32` and pre-norm hidden `[B, N, d]`; the rings are read, never written."""
        b, n = anchor_ids.shape[0], self.block_size
        batch, has_host = self._round_batch(anchor_ids, anchor_positions)
        out = self.block_runner(batch) if self.block_runner is not None and has_host else None
        if out is None:
            out = dspark.draft_block(self.model, batch, self.cache)
        return DraftBlock(base_logits=out.base_logits.view(b, n, -1), hidden=out.hidden.view(b, n, -1))

    def propose_block(self, anchor_ids: Tensor, anchor_positions: Tensor, *, temperature: Tensor | None = None,
                      seeds: Tensor | None = None) -> DraftProposal | None:  # fmt: skip
        """The pass and the Markov sampling as one replay (`proposal_runner`), exactly `sample_block(draft_block(
        ...))`'s proposal; None (the caller takes the two steps) without a runner or the caller's host facts, or
        when the runner declines the round. temperature: the host `[B]` float32 the caller checked."""
        if self.proposal_runner is None or self.round_host is None:
            return None
        batch, _ = self._round_batch(anchor_ids, anchor_positions)
        return self.proposal_runner(batch, self._heads, self.heads_version, temperature, seeds)

    def insert_context(self, batch: ForwardBatch, features: dict[int, Tensor]) -> Tensor:
        """Write the draft rings for the accepted positions of `batch` from the target's captured features
        (`forward_features(capture=model.args.dspark_target_layer_ids)`, rows of `batch`). Returns m `[T, d]`."""
        tids = tuple(self.model.args.dspark_target_layer_ids)
        return dspark.insert_context(self.model, batch, self.cache, dspark.target_features(features, tids))
