"""Block proposal: the sequential Markov sampling loop over one parallel draft pass, and per-position confidence.

The engine's `DraftModel.draft_block` runs the draft stages once over [anchor, noise, ...] (parallel, not
autoregressive) and returns the base logits U_i and the pre-norm hidden h_i of the N block positions. This module
turns them into drafts (docs/dspark.md "Proposal"):

    prev = anchor y_p
    for i in 0 .. N-1:
        e_i      = W1[prev]                      markov embed [r]
        logits_i = U_i + W2 @ e_i                low-rank bigram correction [V]
        d_i      = argmax(logits_i)                          (temperature 0)
                 | inverse-CDF(softmax(logits_i / T), u_i)   (u_i = counter uniform (seed, p + 1 + i, DRAW_DRAFT))
        c_i      = sigmoid(w . [h_i ; e_i] / T_sts[i])       P(d_i accepted | d_<i accepted)
                   (w, T_sts: the greedy head / STS set for temperature-0 requests when the heads have one)
        prev     = d_i
"""

from __future__ import annotations

import torch
from deepinfer_kernels.sampling import softmax_sample
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError
from deepinfer_dspark.protocol import DraftBlock, DraftHeads, DraftModel, DraftProposal
from deepinfer_dspark.rng import DRAW_DRAFT, counter_uniforms

__all__ = ["block_confidence", "check_sampling", "confidence", "markov_bias", "propose", "sample_block", "sample_core",
           "sts_divisors"]


def markov_bias(heads: DraftHeads, prev: Tensor) -> tuple[Tensor, Tensor]:
    """prev `[B] int64` -> (markov embed e `[B, r]`, logit bias W2 @ e `[B, V] float32`)."""
    e = heads.markov_embed[prev]
    return e, e.float() @ heads.markov_head.float().T


def confidence(heads: DraftHeads, hidden: Tensor, e: Tensor, position: int, greedy: Tensor | None = None) -> Tensor | None:
    """`[B] float32` c = sigmoid(w . [h ; e] / T_sts[position]); None without a confidence head.

    hidden `[B, d]` is the PRE-norm head input of the block position, e `[B, r]` the markov embed of the token
    before the drafted one. greedy `[B] bool`: rows decoded at temperature 0, scored with the greedy head and STS
    set when the heads have them (`DraftHeads.greedy_confidence` / `greedy_sts`); None = all rows sampled."""
    if heads.confidence is None:
        return None
    x = torch.cat([hidden.float(), e.float()], dim=-1)
    c = torch.sigmoid((x @ heads.confidence.float().reshape(-1)) / heads.sts_temperature(position))
    if greedy is None or not heads.has_greedy_head:
        return c
    w = heads.confidence if heads.greedy_confidence is None else heads.greedy_confidence
    cg = torch.sigmoid((x @ w.float().reshape(-1)) / heads.sts_temperature(position, greedy=True))
    return torch.where(greedy.to(c.device), cg, c)


def sts_divisors(heads: DraftHeads, width: int, greedy_set: bool, device: torch.device) -> float | Tensor:
    """The STS temperatures of block positions 0..width-1 (the greedy set or not): one float when they are all
    equal, else a `[width] float32` tensor on `device` (made here, once; a CUDA graph takes it as a constant)."""
    temps = [heads.sts_temperature(i, greedy=greedy_set) for i in range(width)]
    if len(set(temps)) == 1:  # one temperature: a scalar, no host-built tensor to copy over
        return temps[0]
    return torch.tensor(temps, dtype=torch.float32).to(device, non_blocking=True)


def block_confidence(heads: DraftHeads, hidden: Tensor, e: Tensor, greedy: Tensor | bool | None = None, *,
                     divisors: dict[bool, float | Tensor] | None = None) -> Tensor | None:  # fmt: skip
    """`[B, N] float32` `confidence` of every block position at once; None without a confidence head.

    hidden `[B, N, d]` pre-norm head inputs, e `[B, N, r]` the markov embed of the token before each drafted one,
    greedy as in `confidence` (`[B] bool`), or True when every row is greedy. Position i is divided by its own
    STS temperature. divisors: `sts_divisors` of the sets by greedy flag (made here when None)."""
    if heads.confidence is None:
        return None
    width = hidden.shape[1]
    x = torch.cat([hidden.float(), e.float()], dim=-1)

    def scored(w: Tensor, greedy_set: bool) -> Tensor:
        d = divisors[greedy_set] if divisors is not None else sts_divisors(heads, width, greedy_set, x.device)
        return torch.sigmoid((x @ w.float().reshape(-1)) / d)

    if greedy is None or greedy is False or not heads.has_greedy_head:
        return scored(heads.confidence, False)
    w = heads.confidence if heads.greedy_confidence is None else heads.greedy_confidence
    if greedy is True:
        return scored(w, True)
    c = scored(heads.confidence, False)
    return torch.where(greedy.to(c.device)[:, None], scored(w, True), c)


def check_sampling(batch: int, temperature: Tensor | None, seeds: Tensor | None) -> tuple[bool, bool]:
    """(any_sampled, all_sampled) of a round of `batch` requests; DSparkInputError on a bad temperature / seeds.
    temperature: `[B] float32` (0 = greedy) or None (all greedy), read where the caller keeps it (a host tensor
    costs no device sync)."""
    given = torch.zeros(batch) if temperature is None else temperature.to(torch.float32)
    if given.shape != (batch,) or bool((given < 0).any()):
        raise DSparkInputError(f"temperature: expected [{batch}] values >= 0, found {temperature!r}")
    any_sampled = bool((given > 0).any())
    if any_sampled and seeds is None:
        raise DSparkInputError("seeds: required when a request samples (temperature > 0), found None")
    return any_sampled, any_sampled and bool((given > 0).all())


def sample_block(
    block: DraftBlock,
    heads: DraftHeads,
    anchor_ids: Tensor,
    anchor_positions: Tensor,
    *,
    temperature: Tensor | None = None,
    seeds: Tensor | None = None,
    keep_logits: bool = False,
) -> DraftProposal:
    """Sequential Markov sampling of one block per request (module docstring).

    block: base_logits `[B, N, V] float32`, hidden `[B, N, d]` from `DraftModel.draft_block`.
    anchor_ids / anchor_positions: `[B] int64` the golden token y_p and its position p.
    temperature: `[B] float32`, 0 = greedy (argmax) for that request; None = all greedy. On the host it is read
        without a device sync.
    seeds: `[B] int64` per-request seeds of the counter-based uniforms (required when any temperature > 0).
    Returns a DraftProposal with draft_ids `[B, N]`, draft_probs `[B, N, V]` (None when every request is greedy;
    one-hot rows for greedy requests in a mixed batch), confidence `[B, N]` (None without a confidence head).
    """
    base = block.base_logits
    batch, _, vocab = base.shape
    if anchor_ids.shape != (batch,) or anchor_positions.shape != (batch,):
        raise DSparkInputError(
            f"anchor_ids / anchor_positions: expected shape ({batch},), found {tuple(anchor_ids.shape)} / "
            f"{tuple(anchor_positions.shape)}"
        )
    if heads.markov_head.shape[0] != vocab:
        raise DSparkInputError(f"heads.markov_head: expected [{vocab}, r] rows = vocab, found {tuple(heads.markov_head.shape)}")
    any_sampled, all_sampled = check_sampling(batch, temperature, seeds)
    device = base.device
    # the greedy / sampled split was read on the host; the temperatures are copied to the device once, without
    # blocking
    temp = temperature.to(torch.float32).to(device, non_blocking=True) if any_sampled else None
    return sample_core(block, heads, anchor_ids.to(device, torch.int64), anchor_positions.to(device, torch.int64),
                       temp=temp, seeds=seeds.to(device) if any_sampled else None, all_sampled=all_sampled,
                       keep_logits=keep_logits)


@torch.no_grad()  # sampling is never differentiated, and `probs_out` is written by an out= op
def sample_core(block: DraftBlock, heads: DraftHeads, prev: Tensor, pos: Tensor, *, temp: Tensor | None,
                seeds: Tensor | None, all_sampled: bool = False, keep_logits: bool = False,
                divisors: dict[bool, float | Tensor] | None = None, probs_out: Tensor | None = None
                ) -> DraftProposal:  # fmt: skip
    """`sample_block` after its checks: device work only, no host read, so a CUDA graph can capture it.

    prev / pos: `[B] int64` anchor ids and positions on the device. temp: `[B] float32` on the device (0 = greedy
    row), or None when every row is greedy; seeds `[B] int64` on the device (with temp). all_sampled: every temp
    is > 0, so every row is scored by the sampled confidence head without a per-row choice; False gives the same
    values for such a batch, which is what a graph captured for any sampled batch uses. The draw itself
    (`deepinfer_kernels.sampling.softmax_sample`) writes one-hot rows for greedy rows of a mixed batch.
    divisors: `sts_divisors` by greedy flag (made per call when None). probs_out: a contiguous `[B, N, V] float32`
    tensor that takes the draft probabilities (CUDA graphs of several batch sizes share one); without a sampled row
    it is not written."""
    base, hidden = block.base_logits, block.hidden
    batch, width, vocab = base.shape
    device = base.device
    # the loop is sequential (each draft conditions the next bias): eagerly one launch per op (a graph replays the
    # whole of it at once), so everything that does not depend on the previous draft is done once per block
    w2t = heads.markov_head.float().T
    any_sampled = temp is not None
    draft_probs = None
    u = None
    if any_sampled:
        offsets = torch.arange(1, width + 1, device=device)
        u = counter_uniforms(seeds, pos[:, None] + offsets[None, :], DRAW_DRAFT)  # [B, N]
        draft_probs = probs_out if probs_out is not None else torch.empty(batch, width, vocab, device=device)
    ids, embeds, logits_out = [], [], []
    for i in range(width):
        e = heads.markov_embed[prev]
        # = base + markov_bias(heads, prev), written where the draw leaves this position's distribution
        logits = torch.addmm(base[:, i].float(), e.float(), w2t,
                             out=draft_probs[:, i] if draft_probs is not None else None)
        if keep_logits:
            logits_out.append(logits.clone())
        # one draw per row: the inverse CDF of softmax(logits / T), or the argmax of a greedy row; the
        # distribution (one-hot on greedy rows) overwrites the logits in place
        tok, _ = softmax_sample(logits, temp, None if u is None else u[:, i].contiguous(),
                                probs_out=logits if any_sampled else None)
        embeds.append(e)
        ids.append(tok)
        prev = tok
    # greedy requests read the greedy head / STS set (when the heads have one)
    greedy_rows = None if all_sampled else (~(temp > 0) if any_sampled else True)
    return DraftProposal(
        draft_ids=torch.stack(ids, 1),
        draft_probs=draft_probs,
        draft_logits=torch.stack(logits_out, 1) if keep_logits else None,
        confidence=block_confidence(heads, hidden, torch.stack(embeds, 1), greedy=greedy_rows, divisors=divisors),
    )


def propose(
    model: DraftModel,
    anchor_ids: Tensor,
    anchor_positions: Tensor,
    *,
    temperature: Tensor | None = None,
    seeds: Tensor | None = None,
) -> DraftProposal:
    """One round of drafts for B requests: the model's parallel pass, then `sample_block`. A model with a
    `propose_block` (the pass and the sampling as one CUDA graph replay) gives the same proposal through it; it
    may decline a round (None), which then takes the two steps."""
    fused = getattr(model, "propose_block", None)
    if fused is not None:
        check_sampling(anchor_ids.shape[0], temperature, seeds)
        prop = fused(anchor_ids, anchor_positions, temperature=temperature, seeds=seeds)
        if prop is not None:
            return prop
    block = model.draft_block(anchor_ids, anchor_positions)
    if block.base_logits.shape[:2] != (anchor_ids.shape[0], model.block_size):
        raise DSparkInputError(
            f"draft_block: expected base_logits [{anchor_ids.shape[0]}, {model.block_size}, V], found "
            f"{tuple(block.base_logits.shape)}"
        )
    return sample_block(block, model.heads, anchor_ids, anchor_positions, temperature=temperature, seeds=seeds)

