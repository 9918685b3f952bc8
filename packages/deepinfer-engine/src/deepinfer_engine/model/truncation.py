"""Decoder truncation in prefill, `compact` mode (docs/prefill_truncation.md).

V4.1 splits its layers at the first ratio-1 layer (the last kv source): layers before it (the encoder) feed the
compressed KV and index keys every later token reads; layers from it on (the decoder) leave nothing behind but
their sliding-window K/V. During prefill the decoder therefore only has to run on the last KEEP positions of each
request's known tokens: their window rows are what later tokens read, the last one gives the first token's
logits, and the DSpark target layers (decoder layers) give the draft context of those positions.

What one forward does at the boundary layer (`TruncationPlan.enter`):
- the boundary layer's compressor and index keys run over EVERY row (the decoder's compressed KV must be
  complete); its attention input is computed for all rows for that purpose only;
- the mHC streams, the delayed-mHC `pre`, captured features, Engram rows and image mask are gathered to the kept
  rows, and a new ForwardContext is built over a sub-batch of those rows (sequences without kept rows are left
  out); its compressed view of the boundary layer is read back from the cache through the sub-batch's plans;
- decoder windows get a per-sequence floor (the first kept position): positions below it were never written
  into the decoder rings and are masked, whichever chunk the step is.

Which rows are kept comes from `ForwardBatch.known_lens` (per sequence, the request's known tokens: prompt plus
tokens generated so far): rows at positions >= known_len - KEEP are kept. A sequence whose known_len is 0, or a
batch without known_lens, keeps every row (decode, prompt logprobs). The boundary layer must be the last kv source
so that no decoder layer owns compressed state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.model.cache import upload
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext, StepHost

__all__ = [
    "MAX_BACKTRACK",
    "PREFILL_TRUNCATION_MODES",
    "DecoderSplit",
    "TruncationPlan",
    "decoder_split",
    "exact_keep",
    "plan_truncation",
]

PREFILL_TRUNCATION_MODES = ("off", "compact")
# Positions a speculative verify step may roll back below the prompt end; KEEP must cover window + this so the
# decoder rings hold every row a resumed step reads (DeepSeek's engine checks the same bound).
MAX_BACKTRACK = 6


@dataclass(frozen=True, kw_only=True)
class DecoderSplit:
    """The model's encoder/decoder split and the kept-row count (derived once, at model build).

    boundary: first decoder layer (first ratio-1 layer, the last kv source); num_decoder_layers: backbone layers
    from it on; keep: rows per request the decoder runs on in prefill; window: sliding window;
    borrowed_topk / borrowed_candidates: layers before the boundary whose per-row top-k / candidate blocks a
    decoder layer reads (gathered to the kept rows at the boundary).
    """

    boundary: int
    num_decoder_layers: int
    keep: int
    window: int
    borrowed_topk: tuple[int, ...] = ()
    borrowed_candidates: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        """Whether `keep` reaches the exactness bound (docs/prefill_truncation.md §2)."""
        return self.keep >= exact_keep(self.window, self.num_decoder_layers)


def exact_keep(window: int, num_decoder_layers: int) -> int:
    """Smallest KEEP for which compact prefill equals full prefill when every decoder layer projects its window
    K/V from its own hidden (docs/prefill_truncation.md §2): each decoder layer leaves the first window - 1 kept
    rows of its input inexact for the next, so the last row stays exact while KEEP >= layers x (window - 1) + 1
    (below window x (layers + 1), the round figure usually quoted)."""
    return num_decoder_layers * (window - 1) + 1


def decoder_split(args: object, keep: int) -> DecoderSplit:
    """The split of a V4.1 model for `keep` kept rows; ConfigError when the model has none or keep is too small."""
    plans = [p for p in args.layer_plans if not p.is_draft]
    first = next((p.layer_id for p in plans if p.ratio == 1), None)
    sources = tuple(getattr(args, "kv_source_layer_ids", ()) or ())
    if args.arch != "v41" or first is None or not sources or first != max(sources):
        raise ConfigError(
            f"prefill_truncation='compact': found arch {args.arch!r} with first ratio-1 layer {first} and kv "
            f"sources {list(sources)}, expected a V4.1 encoder/decoder split (the first ratio-1 layer is the last "
            "kv source). Fix: prefill_truncation='off' for this model"
        )
    window = int(args.sliding_window)
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < window + MAX_BACKTRACK:
        raise ConfigError(
            f"prefill_truncation_keep: found {keep!r}, expected an integer >= sliding window {window} + "
            f"{MAX_BACKTRACK} (speculative rollback) = {window + MAX_BACKTRACK}. Fix: prefill_truncation_keep="
            f"{max(140, window + MAX_BACKTRACK)}"
        )
    decoder = [p for p in plans if p.layer_id >= first]
    topk = sorted({p.index_source for p in decoder if p.index_source is not None and p.index_source < first})
    cand = sorted({args.candidate_source_layer_id for p in decoder if p.consumes_candidates
                   and args.candidate_source_layer_id is not None and args.candidate_source_layer_id < first})
    return DecoderSplit(boundary=first, num_decoder_layers=len(decoder), keep=keep, window=window,
                        borrowed_topk=tuple(topk), borrowed_candidates=tuple(cand))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TruncationPlan:
    """The kept rows of one forward.

    rows:  [T'] int64 rows of the step's batch the decoder runs on (None: all of them)
    batch: the sub-batch of those rows (sequences with no kept row left out; logits_indices remapped)
    host:  the sub-batch's host facts
    floor: per sub-batch sequence, its first kept position (decoder windows never read below it)
    """

    split: DecoderSplit
    rows: Tensor | None
    batch: ForwardBatch
    host: StepHost
    floor: tuple[int, ...]

    def enter(
        self, block: torch.nn.Module, r: Tensor, pre: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor | None, ForwardContext]:
        """At the boundary layer `block`: write its compressed KV and index keys for every row of `ctx`, then
        return (r, pre) of the kept rows and the decoder's ForwardContext."""
        from deepinfer_engine.model import csa2

        attn = block.attn
        csa2.csa2_update_source(
            plan=attn._csa2_plan, compressor=attn.compressor, indexer=attn.indexer,
            x=block.attn_input(r, ctx, pre), ctx=ctx, rope=attn.rope_fn(ctx), numerics=attn.numerics,
        )  # fmt: skip
        rows = self.rows

        def take(t: Tensor | None) -> Tensor | None:
            return t if t is None or rows is None else t.index_select(0, rows)

        sub = ForwardContext.build(
            self.batch, ctx.cache, host=self.host, capture_layers=ctx.capture_layers,
            engram_rows=take(ctx.engram_rows), image_mask=take(ctx.image_mask),
        )  # fmt: skip
        # the deeper of the kept rows' floor and a prefix replay's floor (build read it from the cache)
        sub.window_floor = self.floor if sub.window_floor is None else tuple(map(max, self.floor, sub.window_floor))
        sub.features = {lid: take(f) for lid, f in ctx.features.items()}
        for lid in self.split.borrowed_topk:
            if lid in ctx.topk:
                sub.topk[lid] = take(ctx.topk[lid])
        for lid in self.split.borrowed_candidates:
            if lid in ctx.candidates:
                sub.candidates[lid] = take(ctx.candidates[lid])
        lid, ratio = self.split.boundary, attn._csa2_plan.ratio
        sub.compressed[lid] = csa2.source_view(lid, ratio, sub)  # the whole compressed KV, via the sub plans
        r, pre = take(r), take(pre)
        if not self.batch.num_seqs:  # the decoder runs no row: captured decoder features are empty, not missing
            sub.features.update({c: r.new_zeros(0, r.shape[-1]) for c in ctx.capture_layers if c >= lid})
        return r, pre, sub


def plan_truncation(split: DecoderSplit | None, batch: ForwardBatch, host: StepHost) -> TruncationPlan | None:
    """The kept rows of `batch`, or None when the decoder runs on every row without a window floor.

    A sequence keeps its rows at positions >= known_len - keep. The plan is also needed when nothing of this
    step is dropped but a decoder window would reach below a sequence's first kept position (the final chunk of
    a prompt whose earlier chunk was truncated).
    """
    if split is None or batch.known_lens is None:
        return None
    known = batch.known_lens
    if len(known) != batch.num_seqs:
        raise InputError(
            f"ForwardBatch.known_lens: found {len(known)} values, expected one per sequence ({batch.num_seqs})"
        )
    ctx = np.asarray(host.ctx_lens, dtype=np.int64)
    qlen = np.asarray(batch.query_lens, dtype=np.int64)
    start = np.maximum(np.asarray(known, dtype=np.int64) - split.keep, 0)  # first kept position
    lo = np.clip(start, ctx, ctx + qlen)  # first kept position inside this step's rows
    kept = ctx + qlen - lo
    reaches_floor = (start > 0) & (ctx - (split.window - 1) < start)
    if not reaches_floor.any():
        return None  # every row kept and no window reaches below a floor (decode, short prompts)
    batch_of = np.nonzero(kept > 0)[0]
    firsts = np.cumsum(qlen) - qlen
    all_rows = bool((kept == qlen).all())
    row_idx = np.concatenate([np.arange(firsts[i] + lo[i] - ctx[i], firsts[i] + qlen[i]) for i in batch_of]) \
        if batch_of.size else np.zeros(0, dtype=np.int64)  # fmt: skip
    T = batch.num_tokens
    device = batch.input_ids.device
    if batch.host is None or device.type == "cpu":  # a host check where it costs no device read
        li = batch.logits_indices.cpu().numpy()
        dropped = np.setdiff1d(li, row_idx)
        if dropped.size:
            raise InputError(
                f"logits_indices: found row {int(dropped[0])}, which prefill truncation drops (position below "
                "known_len - prefill_truncation_keep), expected only kept rows. Fix: known_lens=None (or 0 for "
                "that sequence) when every row's logits are needed"
            )
    rows, sub_batch, sub_host = None, batch, host
    if not all_rows:
        rows = upload(row_idx.astype(np.int64), device)
        where = torch.full((T,), row_idx.shape[0], dtype=torch.int64, device=device)
        where[rows] = torch.arange(row_idx.shape[0], dtype=torch.int64, device=device)
        sub_host = StepHost(
            ctx_lens=tuple(int(lo[i]) for i in batch_of), input_ids=host.input_ids[row_idx],
            block_tables=host.block_tables[batch_of],
        )  # fmt: skip
        sel = upload(batch_of.astype(np.int64), device)
        # a dropped row asked for by the runner indexes past the kept rows: an index error, never a wrong row
        sub_batch = ForwardBatch(
            input_ids=batch.input_ids.index_select(0, rows), positions=batch.positions.index_select(0, rows),
            query_lens=tuple(int(kept[i]) for i in batch_of), slots=tuple(batch.slots[i] for i in batch_of),
            block_tables=batch.block_tables.index_select(0, sel), logits_indices=where[batch.logits_indices],
            host=sub_host,
        )  # fmt: skip
    floor = tuple(int(start[i]) for i in batch_of)
    return TruncationPlan(split=split, rows=rows, batch=sub_batch, host=sub_host, floor=floor)
