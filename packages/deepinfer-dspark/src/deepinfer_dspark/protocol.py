"""The seam between the engine and the DSpark algorithm: `DraftModel` (implemented by the engine, which owns the
draft transformer stages and caches), the `DraftBlock` its parallel pass returns, the `DraftHeads` weights, and the
`DraftProposal` bundle that `propose` makes of them. Imports torch only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError

__all__ = ["DraftBlock", "DraftHeads", "DraftModel", "DraftProposal"]


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


@dataclass(frozen=True, kw_only=True)
class DraftBlock:
    """Output of one parallel pass of the draft stages over B blocks of N positions.

    base_logits: `[B, N, V] float32` head(RMSNorm(h)) of each block position, WITHOUT the Markov correction.
    hidden: `[B, N, d]` the pre-norm head input h (the confidence head reads it).
    Position i of request b predicts token p_b + 1 + i.
    """

    base_logits: Tensor
    hidden: Tensor

    def __post_init__(self) -> None:
        u, h = self.base_logits, self.hidden
        if not isinstance(u, Tensor) or u.dim() != 3 or not u.dtype.is_floating_point:
            found = f"{tuple(u.shape)} {u.dtype}" if isinstance(u, Tensor) else type(u).__name__
            raise DSparkInputError(f"DraftBlock.base_logits: expected a [B, N, V] float tensor, found {found}")
        if not isinstance(h, Tensor) or h.dim() != 3 or h.shape[:2] != u.shape[:2]:
            found = tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__
            raise DSparkInputError(f"DraftBlock.hidden: expected [{u.shape[0]}, {u.shape[1]}, d], found {found}")


@dataclass(frozen=True, kw_only=True)
class DraftHeads:
    """The weights of the sequential heads (checkpoint names in docs/dspark.md).

    markov_embed: `[V, r]` W1, the previous token's markov embedding (V4.1 `markov_head.embed.weight`).
    markov_head: `[V, r]` W2, rank -> vocab bias (V4.1 `markov_head.head.weight`).
    confidence: `[1, d + r]` or `[d + r]` Confidence Head weight (no bias), None when the checkpoint has none.
    sts: per-position temperature of the confidence logit (post-hoc STS calibration): one float for every
        position or one per block position; 1.0 = uncalibrated.
    greedy_confidence: `[1, d + r]` or `[d + r]` a second head for requests decoded at temperature 0 (greedy
        acceptance is argmax agreement, not the sampling acceptance sum_v min(p, q) that `confidence` estimates);
        None = greedy requests use `confidence`. Requires `confidence`.
    greedy_sts: the STS temperature(s) of greedy requests (whichever head serves them); None = `sts`.
    """

    markov_embed: Tensor
    markov_head: Tensor
    confidence: Tensor | None = None
    sts: float | tuple[float, ...] = 1.0
    greedy_confidence: Tensor | None = None
    greedy_sts: float | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        w1, w2 = self.markov_embed, self.markov_head
        if w1.dim() != 2 or w2.dim() != 2 or w1.shape != w2.shape:
            raise DSparkInputError(
                f"DraftHeads: markov_embed / markov_head must both be [V, r], found {tuple(w1.shape)} / "
                f"{tuple(w2.shape)}"
            )
        for name in ("confidence", "greedy_confidence"):
            c = getattr(self, name)
            if c is not None and (c.dim() not in (1, 2) or (c.dim() == 2 and c.shape[0] != 1) or c.numel() <= w1.shape[1]):
                raise DSparkInputError(
                    f"DraftHeads.{name}: expected [1, d + r] or [d + r] with r = {w1.shape[1]}, found {tuple(c.shape)}"
                )
        g = self.greedy_confidence
        if g is not None and (self.confidence is None or g.numel() != self.confidence.numel()):
            found = None if self.confidence is None else tuple(self.confidence.shape)
            raise DSparkInputError(
                f"DraftHeads.greedy_confidence: expected beside a confidence head of the same size {tuple(g.shape)}, "
                f"found confidence {found}"
            )
        for name in ("sts", "greedy_sts"):
            value = getattr(self, name)
            if value is None and name == "greedy_sts":
                continue
            temps = value if isinstance(value, tuple) else (value,)
            if not temps or any(not isinstance(t, (int, float)) or not t > 0 for t in temps):
                raise DSparkInputError(f"DraftHeads.{name}: expected temperatures > 0, found {value!r}")

    @property
    def has_greedy_head(self) -> bool:
        """Whether greedy requests are scored differently from sampled ones (own head or own STS set)."""
        return self.greedy_confidence is not None or self.greedy_sts is not None

    def sts_temperature(self, position: int, *, greedy: bool = False) -> float:
        sts = self.greedy_sts if greedy and self.greedy_sts is not None else self.sts
        if isinstance(sts, tuple):
            return float(sts[min(position, len(sts) - 1)])
        return float(sts)


@runtime_checkable
class DraftModel(Protocol):
    """What the engine implements so that the DSpark algorithm can draft (`propose.propose`).

    The engine owns the draft transformer stages and their caches; this package owns everything after the
    parallel pass (Markov sampling, confidence, scheduling, verification, statistics).

    Context insertion (target features of accepted positions -> draft sliding-window KV) happens around the
    engine's target forward (docs/dspark.md "Engine seam") and is not part of this protocol; by the time
    `draft_block` is called the draft rings of every request hold its context up to position p - 1.
    """

    @property
    def block_size(self) -> int:
        """N, drafts per round (DSparkConfig.block_size)."""
        ...

    @property
    def heads(self) -> DraftHeads:
        """The Markov head and Confidence Head weights (read on every `propose`; cheap to return)."""
        ...

    def draft_block(self, anchor_ids: Tensor, anchor_positions: Tensor) -> DraftBlock:
        """One parallel pass over the blocks [anchor_ids[b], noise x (N-1)] at positions p_b .. p_b + N - 1.

        anchor_ids: `[B] int64`, the golden token g of each request (just sampled by the verifier, not yet run
            through the target) at position anchor_positions[b] = p.
        anchor_positions: `[B] int64` absolute positions p.
        Must not write any cache row that the target reads later (the block's own KV stays local).
        """
        ...

    # Optional: `propose_block(anchor_ids, anchor_positions, *, temperature=None, seeds=None) -> DraftProposal |
    # None`, the parallel pass and `sample_block` in one go (the engine replays both as one CUDA graph). It must
    # give exactly `sample_block(draft_block(...), heads, ...)`'s proposal, or None to decline the round;
    # `propose` checks temperature / seeds before calling it. Not a protocol member: most drafters lack it.
