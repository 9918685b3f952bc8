"""V4.1 CSA2: shared compressed KV, indexer keys/queries, candidate filter, Full/Reuse/Reindex (docs/model.md §C.3-C.4).

Who does what in one forward (layers run in order, so a source always runs before its users):
- kv-source layers (``plan.has_compressor``) turn their new tokens into compressed entries ``C_w`` and index keys
  ``KI_w`` and write them into their paged caches (entry w = tokens ``ratio*w .. ratio*w+ratio-1``; an entry
  exists once its last token was processed, so ratio-1 sources see their own current entry).
- index-source layers (``plan.has_indexer_q``) score the visible entries of their kv source and pick the top-k;
  the candidate publisher also publishes CB(t); consumers (index sources after the publisher) drop scores
  outside CB(t) first. The selection is stored in ``Csa2ForwardState`` for the Reuse layers that follow.
- every CSA2 layer (Full / Reuse / Reindex) then gets ``[T, index_topk, head_dim]`` compressed KV rows of its
  kv source with a validity mask; its own window KV and the sink softmax are the attention module's job.

Ratio-2 sources keep the raw ``(A, Z)`` rows of their last tokens in the cache's per-slot ring
``"main"`` state ring (row = position mod ring), so a chunk that starts at an odd position pools
with the saved row of the previous token, and a rejected speculative tail is simply overwritten next time.
The published state lives in ``ForwardContext`` (``compressed[l]``, ``topk[l]``, ``candidates[l]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from deepinfer_kernels.compressor import pool_at_rows
from deepinfer_kernels.indexer import (
    candidate_blocks,
    causal_mask,
    index_scores,
    topk_indices,
)
from deepinfer_kernels.linear import linear_f32_out
from deepinfer_kernels.norm_rope import rms_norm  # fp32 math, input dtype out
from torch import Tensor, nn

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.forward_batch import CompressedSelection, CompressedView, ForwardContext
from deepinfer_engine.model.kv_numerics import KVNumerics
from deepinfer_engine.model.linear import Linear, split_counters

_NO_ROUNDING = KVNumerics()

RopeFn = Callable[[Tensor, Tensor], Tensor]
"""``rope(x [T, ..., D], positions [T] int64) -> x`` rotating the trailing rope dims (compress θ + YaRN)."""


def pool_ratio2(a: Tensor, z: Tensor) -> Tensor:
    """Ratio-2 pooling: per-channel softmax over the 2 tokens of each group (docs/model.md §C.3, no ape, no overlap).

    a, z: ``[G, 2, D] float32`` (token 2w then 2w+1 of group w). Returns ``[G, D] float32``
    ``Σ_s softmax_s(z[:, s, c]) · a[:, s, c]``.
    """
    if a.shape != z.shape or a.dim() != 3 or a.shape[1] != 2:
        raise ValueError(f"pool_ratio2: expected a, z [G, 2, D], found {tuple(a.shape)} and {tuple(z.shape)}")
    return (torch.softmax(z.float(), dim=1) * a.float()).sum(dim=1)


def compress_chunk(
    a: Tensor, z: Tensor | None, start: int, ratio: int, prev_a: Tensor | None, prev_z: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Compressed latents (pre-norm) completed by a chunk of consecutive tokens ``start .. start+L-1``.

    a, z: ``[L, D] float32`` projections of the chunk (z is None for ratio 1). For ratio 2 and an odd
    ``start`` the group's first token is the previous token, whose rows ``prev_a/prev_z [D]`` must be given.
    Returns ``(entry_ids [n] int64, pooled [n, D] float32)`` for every entry whose last token is in the chunk.
    """
    length = a.shape[0]
    if ratio == 1:
        return torch.arange(start, start + length, dtype=torch.int64, device=a.device), a.float()
    if ratio != 2:
        raise ModelConfigError(f"compress_ratios: CSA2 supports ratios 1 and 2, found {ratio}")
    if z is None:
        raise ValueError("compress_chunk: ratio 2 needs the gate projection z")
    if start % 2 == 1:
        if prev_a is None or prev_z is None:
            raise ValueError(f"compress_chunk: chunk starts at odd position {start}; previous row needed")
        a = torch.cat([prev_a[None].float(), a.float()], 0)
        z = torch.cat([prev_z[None].float(), z.float()], 0)
        first = start - 1
    else:
        first = start
    groups, d = a.shape[0] // 2, a.shape[1]
    pooled = pool_ratio2(a[: 2 * groups].reshape(groups, 2, d), z[: 2 * groups].reshape(groups, 2, d))
    w0 = first // 2
    return torch.arange(w0, w0 + groups, dtype=torch.int64, device=a.device), pooled


class Csa2Compressor(nn.Module):
    """``attn.compressor.{wkv, wgate (ratio 2 only), norm}`` of a kv-source layer (docs/model.md §C.3)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)
    pdl = False  # programmatic dependent launch where the kernel supports it (Transformer.set_pdl; docs/pdl.md)

    def __init__(self, *, dim: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ModelConfigError(f"compress_ratios: CSA2 kv source needs ratio 1 or 2, found {ratio}")
        self.ratio = ratio
        self.eps = eps
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.wgate = nn.Linear(dim, head_dim, bias=False) if ratio == 2 else None
        self.norm = _Norm(head_dim)

    def same_input_dense(self) -> tuple[tuple[nn.Linear, nn.Linear], ...]:
        """wkv and wgate read the same input: one weight buffer once fused (linear_pair.fuse_dense_pair)."""
        return ((self.wkv, self.wgate),) if self.wgate is not None else ()

    def project_stacked(self, x: Tensor) -> Tensor:
        """Ratio 2: ``x [L, d]`` -> ``[L, 2, Dh] float32`` = stack(A, Z) (the state ring's row layout). One GEMM
        launch and no stack when wkv / wgate share one buffer: the joint output [L, 2 * Dh] is that layout."""
        from deepinfer_engine.model.linear_pair import dense_joint_weight

        joint = dense_joint_weight(self.wkv, self.wgate) if self.wgate is not None else None
        if joint is None:
            a, z = self.project(x)
            return torch.stack([a, z], dim=1)
        y = linear_f32_out(x, joint, backend=self.kernel_backend, counters=split_counters(self, x.device))
        return y.view(x.shape[0], 2, -1)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x [L, d]`` -> ``A [L, Dh] float32``, ``Z [L, Dh] float32 | None`` (fp32 math like the reference)."""
        # fp32 results without an fp32 copy of the weights each step (fp32 accumulation over their dtype)
        cnt = split_counters(self, x.device)
        a = linear_f32_out(x, self.wkv.weight, backend=self.kernel_backend, counters=cnt)
        z = (linear_f32_out(x, self.wgate.weight, backend=self.kernel_backend, counters=cnt)
             if self.wgate is not None else None)
        return a, z


class Csa2Indexer(nn.Module):
    """``attn.indexer.{wk, k_norm}`` (kv sources) and ``attn.indexer.{wq_b, weights_proj}`` (index sources)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)
    pdl = False  # programmatic dependent launch where the kernel supports it (Transformer.set_pdl; docs/pdl.md)

    def __init__(
        self,
        *,
        dim: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_head_dim: int,
        has_k: bool,
        has_q: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.n_heads = n_heads
        self.index_head_dim = index_head_dim
        self.wk = nn.Linear(head_dim, index_head_dim, bias=False) if has_k else None
        self.k_norm = _Norm(index_head_dim) if has_k else None
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim, torch.float32) if has_q else None
        self.weights_proj = nn.Linear(dim, n_heads, bias=False) if has_q else None

    def keys(self, latent: Tensor, positions: Tensor, rope: RopeFn) -> Tensor:
        """Index keys from the PRE-RoPE normed latent: ``RoPE(RMSNorm(wk latent; k_norm))`` ``[n, Di]``."""
        if self.wk is None or self.k_norm is None:
            raise ModelConfigError(
                "kv_source_layer_ids: index keys requested from a layer without attn.indexer.wk"
            )
        k = rms_norm(latent @ self.wk.weight.to(latent.dtype).T, self.k_norm.weight, self.eps,
                     backend=self.kernel_backend, pdl=self.pdl)
        return rope(k, positions)

    @property
    def weight_scale(self) -> float:
        """The scale of the head weights, ``Di^-0.5 · H^-0.5`` (applied by `index_scores(w_scale=)`, in its kernel)."""
        return self.index_head_dim**-0.5 * self.n_heads**-0.5

    def queries(self, qr: Tensor, x: Tensor, positions: Tensor, rope: RopeFn) -> tuple[Tensor, Tensor]:
        """``qI [T, H, Di]`` (RoPE at the query position) and head weights ``wI [T, H] float32`` BEFORE their scale
        (`weight_scale`: the score kernel multiplies, one launch less)."""
        if self.wq_b is None or self.weights_proj is None:
            raise ModelConfigError(
                "index_source_layer_ids: queries requested from a layer without attn.indexer.wq_b"
            )
        t = qr.shape[0]
        q = self.wq_b(qr).to(qr.dtype).view(t, self.n_heads, self.index_head_dim)
        q = rope(q, positions)
        w = linear_f32_out(x, self.weights_proj.weight, backend=self.kernel_backend,
                           counters=split_counters(self, x.device))  # fmt: skip
        return q, w


class _Norm(nn.Module):
    """A bare ``weight`` holder so checkpoint names read ``...norm.weight``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


@dataclass(frozen=True, kw_only=True)
class Csa2Plan:
    """The CSA2 facts of one layer (taken from ``LayerPlan`` + ``ModelArgs``)."""

    layer_id: int
    ratio: int
    kv_source: int
    index_source: int
    has_compressor: bool
    has_indexer_k: bool
    has_indexer_q: bool
    publishes_candidates: bool
    consumes_candidates: bool
    candidate_source: int | None
    index_topk: int
    candidate_block_size: int
    candidate_topk_blocks: int
    eps: float

    def __post_init__(self) -> None:
        if self.ratio not in (1, 2):
            raise ModelConfigError(f"compress_ratios[{self.layer_id}]: found {self.ratio}, expected 1 or 2")
        if self.has_compressor != (self.kv_source == self.layer_id):
            raise ModelConfigError(
                f"kv_source_layer_ids: layer {self.layer_id} has_compressor={self.has_compressor} but its kv "
                f"source is {self.kv_source}"
            )
        if self.has_indexer_q != (self.index_source == self.layer_id):
            raise ModelConfigError(
                f"index_source_layer_ids: layer {self.layer_id} has_indexer_q={self.has_indexer_q} but its "
                f"index source is {self.index_source}"
            )
        if self.publishes_candidates and (self.candidate_block_size < 1 or self.candidate_topk_blocks < 1):
            raise ModelConfigError(
                f"candidate_block_size / candidate_topk_blocks: found {self.candidate_block_size} / "
                f"{self.candidate_topk_blocks}, expected >= 1 on the candidate source layer {self.layer_id}"
            )
        if self.consumes_candidates and self.candidate_source is None:
            raise ModelConfigError(
                f"candidate_source_layer_id: layer {self.layer_id} consumes candidates, found None"
            )

    @staticmethod
    def from_layer_plan(plan: object, args: object) -> Csa2Plan:
        """Build from ``LayerPlan`` and ``ModelArgs`` (duck-typed: this module does not import args.py)."""
        return Csa2Plan(
            layer_id=plan.layer_id,
            ratio=plan.ratio,
            kv_source=plan.kv_source,
            index_source=plan.index_source,
            has_compressor=plan.has_compressor,
            has_indexer_k=plan.has_indexer_k,
            has_indexer_q=plan.has_indexer_q,
            publishes_candidates=plan.publishes_candidates,
            consumes_candidates=plan.consumes_candidates,
            candidate_source=args.candidate_source_layer_id,
            index_topk=args.index_topk,
            candidate_block_size=args.candidate_block_size,
            candidate_topk_blocks=args.candidate_topk_blocks,
            eps=args.rms_norm_eps,
        )


def csa2_update_source(
    *,
    plan: Csa2Plan,
    compressor: Csa2Compressor,
    indexer: Csa2Indexer,
    x: Tensor,
    ctx: ForwardContext,
    rope: RopeFn,
    numerics: KVNumerics = _NO_ROUNDING,
) -> CompressedView:
    """kv-source layer: compress the new tokens, write ``C_w`` / ``KI_w`` / the ratio-2 ring, publish the view.

    x: ``[T, d]`` the layer's attention input (after attn_norm), sequence-major like the batch.
    Publishes ``ctx.compressed[layer_id]``: every sequence's entries ``0 .. floor((ctx+n)/ratio)-1``.
    """
    r, lid = plan.ratio, plan.layer_id
    cache = ctx.cache
    if r == 2 and not cache.has_state(lid, "main"):
        raise ModelConfigError(f"layer {lid}: ratio-2 kv source without a compressor state ring in the cache")
    paged = ctx.paged_plan(r)
    if r == 2:
        # rows of positions [p0 - back, p0 + n): back = 1 when a chunk starts inside a group; this step's rows
        # are stored in the ring for the next chunk
        ring_plan = ctx.ring_plan(
            cache.state_rows(lid, "main"), tuple(c % 2 for c in ctx.ctx_lens), write=True, max_back=1
        )
        az = compressor.project_stacked(x)  # [T, 2, Dh] f32: A, Z
        both = cache.state_pool(lid, "main", ring_plan, az, backend=compressor.kernel_backend)  # [H + T, 2, Dh]
    else:
        a_all, _ = compressor.project(x)  # [T, Dh] f32
    if paged.num_new:
        if r == 1:
            pooled = a_all  # entry w = position w: every new token completes one entry, in batch order
            # a write floor (prefix replay) skipped some, or a ragged step's Q entry rows per sequence: their rows
            ragged = ctx.static is not None and ctx.static.ragged
            if paged.num_new != x.shape[0] or ragged:
                st = ctx.seq_t
                rows = paged.new_w - st.ctx[paged.new_seq] + st.start[paged.new_seq]
                # a ragged step's entries past a sequence's rows may point past the step's: computed and dropped
                pooled = a_all.index_select(0, rows.clamp(0, x.shape[0] - 1) if ragged else rows)
        else:
            # pool_ratio2 over each new entry's two token rows [M, 2] of the pool, cast to x's dtype: one launch
            pooled = pool_at_rows(both, ctx.entry_rows(ring_plan, paged), x.dtype, backend=compressor.kernel_backend)
        # [I] V4 casts the pooled value to the model dtype before the norm; we do the same for V4.1.
        latent = rms_norm(pooled.to(x.dtype), compressor.norm.weight, plan.eps,
                          backend=compressor.kernel_backend, pdl=compressor.pdl)  # pre-RoPE latent
        entry_pos = ctx.entry_positions(paged)  # RoPE at the group's first token
        # index keys come from the unrounded pre-RoPE latent; each cache stores its own record format
        kb = compressor.kernel_backend
        cache.write_entries(lid, paged, numerics.compressed_kv(rope(latent, entry_pos), backend=kb), backend=kb)
        cache.write_index_keys(lid, paged, numerics.index_operand(indexer.keys(latent, entry_pos, rope), backend=kb),
                               backend=kb)
    view = source_view(lid, r, ctx, backend=compressor.kernel_backend)
    ctx.compressed[lid] = view
    return view


def source_view(layer_id: int, ratio: int, ctx: ForwardContext, *, backend: str = "auto") -> CompressedView:
    """The compressed entries and index keys of kv source `layer_id` for every sequence of `ctx`, as they stand
    in the cache (each sequence's entries ``0 .. floor((ctx+n)/ratio)-1``)."""
    cache = ctx.cache
    paged = ctx.paged_plan(ratio)
    store, rows = cache.entry_source(layer_id, paged)
    return CompressedView(
        store=store,
        rows=rows,
        index_keys=cache.read_index_keys(layer_id, paged, backend=backend),
        seq_offsets=paged.offsets,
        seq_counts=paged.counts,
        ratio=ratio,
        kv_format=cache.entry_format(),
    )


# Batched scoring scores every query against every sequence's entries ([T, E] cells, of which only
# sum_i n_i * count_i are used); it is chosen while that is small in absolute terms (decode: few queries, the
# per-sequence loop costs more in Python than the wasted cells) or wastes at most 2x. Thresholds measured on the
# tiny CPU model (docs/perf.md), not tuned for real widths.
_BATCHED_SCORE_CELLS = 1 << 16


def padded_scores(
    q: Tensor, w: Tensor, view: CompressedView, ctx: ForwardContext, *, w_scale: float = 1.0, backend: str = "auto"
) -> Tensor:
    """[T, max count] float32 index scores of each query against its own sequence's entries (padding: 0); head
    weights w times w_scale (`index_scores`)."""
    t = q.shape[0]
    cmax = max(view.seq_counts, default=0)
    keys = view.index_keys
    e = keys.shape[0]
    if cmax == 0:
        return torch.zeros((t, 0), dtype=torch.float32, device=q.device)
    if ctx.num_seqs == 1:
        return index_scores(q, w, keys, w_scale=w_scale, backend=backend)
    if ctx.static is not None:  # fixed-shape step: cmax entry slots per sequence
        s = ctx.num_seqs
        per_seq = keys.view(s, cmax, -1)
        if ctx.static.ragged:  # rows laid out back to back: each query scores its own sequence's keys
            per_seq = per_seq.index_select(0, ctx.seq_of_token)
        elif t != s:  # verify steps of Q rows per sequence
            per_seq = per_seq.repeat_interleave(t // s, dim=0)
        return index_scores(q, w, per_seq, w_scale=w_scale, backend=backend)
    offs = ctx.paged_plan(view.ratio).offsets_t[ctx.seq_of_token]
    col = (offs[:, None] + torch.arange(cmax, device=q.device)[None, :]).clamp(max=e - 1)
    useful = sum(n * c for n, c in zip(ctx.query_lens, view.seq_counts))
    if t * e <= max(_BATCHED_SCORE_CELLS, 2 * useful):
        return index_scores(q, w, keys, w_scale=w_scale, backend=backend).gather(1, col)
    out = torch.zeros((t, cmax), dtype=torch.float32, device=q.device)
    for i in range(ctx.num_seqs):
        rows = ctx.seq_rows(i)
        off, count = view.seq_offsets[i], view.seq_counts[i]
        out[rows, :count] = index_scores(q[rows], w[rows], keys[off : off + count], w_scale=w_scale, backend=backend)
    return out


def _entry_mask_from_blocks(blocks: Tensor, count: int, block_size: int) -> Tensor:
    """``[L, NB] bool`` chosen blocks -> ``[L, count] bool`` allowed entries."""
    ent_block = torch.arange(count, device=blocks.device) // block_size
    return blocks[:, ent_block]


def csa2_select(
    *,
    plan: Csa2Plan,
    indexer: Csa2Indexer | None,
    x: Tensor,
    qr: Tensor,
    ctx: ForwardContext,
    rope: RopeFn,
    numerics: KVNumerics = _NO_ROUNDING,
    backend: str = "auto",
) -> CompressedSelection:
    """Compressed entries each query attends to (besides its window), for a Full / Reuse / Reindex layer.

    x: ``[T, d]`` attention input (after attn_norm), qr: ``[T, q_lora_rank]`` normed q latent. The kv source
    must have run ``csa2_update_source`` in this forward. Returns ``CompressedSelection(kv = the source's store,
    indices [T, index_topk] store rows, -1 = none)``. Index sources publish ``ctx.topk[layer_id]`` (per-sequence
    entry ids w); the candidate publisher also publishes ``ctx.candidates[layer_id] [T, num_blocks] bool``.
    Reuse layers (no indexer-Q) take the top-k of their index source unchanged. backend: the model's kernel
    backend for the indexer ops.
    """
    lid, r, k = plan.layer_id, plan.ratio, plan.index_topk
    view = ctx.compressed.get(plan.kv_source)
    if view is None:
        raise ModelConfigError(
            f"kv_source_layer_ids: layer {lid} reads the compressed cache of layer {plan.kv_source}, "
            "which did not run in this forward"
        )
    if not plan.has_indexer_q:
        sel = ctx.topk.get(plan.index_source)
        if sel is None:
            raise ModelConfigError(
                f"index_source_layer_ids: layer {lid} reuses the top-k of layer {plan.index_source}, "
                "which did not run in this forward"
            )
    else:
        if indexer is None or indexer.wq_b is None:
            raise ModelConfigError(f"layer {lid}: index source without attn.indexer.wq_b")
        q_all, w_all = indexer.queries(qr, x, ctx.batch.positions, rope)
        q_all = numerics.index_operand(q_all, backend=backend)
        t = x.shape[0]
        # [T, cmax] over the query's own sequence's entries
        scores = padded_scores(q_all, w_all, view, ctx, w_scale=indexer.weight_scale, backend=backend)
        scores = numerics.index_scores(scores)
        vis = ctx.visible_counts(r)
        # entries past a sequence's count are padding; vis <= count, so the causal mask removes them too (folded
        # into the top-k when no candidate step reads the masked scores)
        if plan.publishes_candidates or plan.consumes_candidates:
            scores = causal_mask(scores, vis)
        cmax = scores.shape[1]
        if plan.publishes_candidates:
            ids, _ = candidate_blocks(scores, vis, plan.candidate_block_size, plan.candidate_topk_blocks)
            nb = -(-cmax // plan.candidate_block_size)
            blk = torch.zeros((t, nb + 1), dtype=torch.bool, device=x.device)
            blk.scatter_(1, ids.masked_fill(ids < 0, nb), True)
            ctx.candidates[lid] = blk[:, :nb]
        if plan.consumes_candidates:
            blocks = ctx.candidates.get(plan.candidate_source)
            if blocks is None or plan.candidate_source != plan.kv_source:
                raise ModelConfigError(
                    f"candidate_source_layer_id: consumer {lid} (kv source {plan.kv_source}) needs the "
                    f"candidates of layer {plan.candidate_source} over the same kv source in this forward"
                )
            allowed = _entry_mask_from_blocks(blocks, cmax, plan.candidate_block_size)
            scores = scores.masked_fill(~allowed, float("-inf"))
        masked = plan.publishes_candidates or plan.consumes_candidates
        sel = topk_indices(scores, k, None if masked else vis, backend=backend)
        ctx.topk[lid] = sel
    # per-sequence entry ids -> rows of the source's store (read in place by the attention kernel)
    offs = ctx.paged_plan(view.ratio).offsets_t
    return CompressedSelection(kv=view.store, indices=view.store_rows(sel, ctx.seq_of_token, offs, backend=backend),
                               kv_format=view.kv_format)  # fmt: skip
