"""The seam between the engine and the DSpark algorithm: `DraftModel` (implemented by the engine, which owns the
draft transformer blocks and caches) and the `DraftProposal` bundle it returns. Imports torch only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError

__all__ = ["DraftModel", "DraftProposal"]


@dataclass(frozen=True, kw_only=True)
class DraftProposal:
    """One round of drafts for B requests, N = block size.

    draft_ids: `[B, N] int64`, d_1..d_N for positions p+1..p+N (p = the anchor's position).
    draft_probs: `[B, N, V] float32`, the distribution each d_j was sampled from (base logits + Markov correction,
        after the request's temperature / top-k / top-p). Needed by rejection sampling; None when every request is
        greedy (then only the ids matter).
    draft_logits: `[B, N, V] float32` raw corrected logits (optional; for logging / tests).
    confidence: `[B, N] float32` in [0, 1], the confidence head's c_j = P(d_j accepted | d_<j accepted)
        (optional; absent when the checkpoint has no confidence head). Survival a_j = cumprod(c)_j drives the
        verify-length scheduler.
    All tensors on one device.
    """

    draft_ids: Tensor
    draft_probs: Tensor | None = None
    draft_logits: Tensor | None = None
    confidence: Tensor | None = None

    def __post_init__(self) -> None:
        ids = self.draft_ids
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
            found = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
            raise DSparkInputError(f"DraftProposal.draft_ids: expected a [B, N] int64 tensor, found {found}")
        batch, width = ids.shape
        for name in ("draft_probs", "draft_logits"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 3 or t.shape[:2] != (batch, width) or not t.dtype.is_floating_point):
                raise DSparkInputError(
                    f"DraftProposal.{name}: expected a [{batch}, {width}, V] float tensor, found {tuple(t.shape)} {t.dtype}"
                )
        if (
            self.draft_probs is not None
            and self.draft_logits is not None
            and self.draft_probs.shape != self.draft_logits.shape
        ):
            raise DSparkInputError(
                f"DraftProposal: draft_probs {tuple(self.draft_probs.shape)} and draft_logits "
                f"{tuple(self.draft_logits.shape)} differ in shape"
            )
        c = self.confidence
        if c is not None and (c.shape != (batch, width) or not c.dtype.is_floating_point):
            raise DSparkInputError(
                f"DraftProposal.confidence: expected a [{batch}, {width}] float tensor, found {tuple(c.shape)} {c.dtype}"
            )
        for name in ("draft_probs", "draft_logits", "confidence"):
            t = getattr(self, name)
            if t is not None and t.device != ids.device:
                raise DSparkInputError(f"DraftProposal.{name}: on {t.device}, draft_ids on {ids.device}")

    @property
    def batch_size(self) -> int:
        return self.draft_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.draft_ids.shape[1]

    def survival(self) -> Tensor | None:
        """`[B, N] float32` a_j = prod_{k <= j} c_k (None without confidences)."""
        return None if self.confidence is None else torch.cumprod(self.confidence.to(torch.float32), dim=1)


@runtime_checkable
class DraftModel(Protocol):
    """What the engine implements so that the DSpark algorithm can ask for drafts.

    Context insertion (target features of accepted positions -> draft sliding-window KV) happens inside the
    engine's target forward (runtime.md §1.2 (a)) and is not part of this protocol; by the time `propose` is
    called the draft rings of every request hold its context up to position p - 1.
    """

    @property
    def block_size(self) -> int:
        """N, drafts per round (DSparkConfig.block_size)."""
        ...

    def propose(
        self,
        anchor_ids: Tensor,
        anchor_positions: Tensor,
        *,
        temperature: Tensor | None = None,
        generators: list[torch.Generator] | None = None,
    ) -> DraftProposal:
        """Draft N tokens for each of B requests.

        anchor_ids: `[B] int64`, the golden token g of each request (just sampled by the verifier, not yet run
            through the target) at position anchor_positions[b] = p.
        anchor_positions: `[B] int64` absolute positions p.
        temperature: `[B] float32` sampling temperature per request (0 = greedy drafting); None = all greedy.
        generators: one torch.Generator per request for draft sampling (None = greedy or engine-chosen RNG).
        Returns a DraftProposal with draft_ids `[B, N]` (positions p+1..p+N) and, for sampled requests,
        draft_probs `[B, N, V]`. Must not write any cache position >= p that the target reads later.
        """
        ...
