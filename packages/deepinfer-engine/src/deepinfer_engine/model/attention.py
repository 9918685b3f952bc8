"""Attention of every layer kind (docs/model.md §A.4-§A.7, docs/model.md §C.3): q LoRA path, window K=V ring, one sink softmax
over window ∪ selected compressed entries, inverse RoPE, grouped low-rank output; the V4 CSA/HCA compressors and
the V4 lightning indexer. V4.1 CSA2 compressed paths come from `csa2.py` through `_compressed()`.

Shapes: T tokens of the step, H heads, Dh head dim, G o_groups, Ro o_lora_rank. Einsum letters: t token,
g group, r o_lora row, i group input (H/G * Dh).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from deepinfer_kernels.compressor import compress_pool
from deepinfer_kernels.indexer import topk_indices
from deepinfer_kernels.norm_rope import (
    apply_rope,
    apply_rope_at,
    rms_norm,
    rope_at_uses_kernel,
    rope_cos_sin,
    rope_freqs,
)
from deepinfer_kernels.sparse_attn import sparse_attn
from torch import Tensor, nn

from deepinfer_engine.model.cache import PagedPlan
from deepinfer_engine.model.forward_batch import CompressedSelection, CompressedView, ForwardContext
from deepinfer_engine.model.kv_numerics import KVNumerics
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.linear_pair import linear_pair
from deepinfer_engine.model.overlap import join, run_beside

__all__ = ["Attention", "Compressor", "Indexer", "Linear", "RMSNorm", "Rope"]


class RMSNorm(nn.Module):
    """Weighted RMSNorm, fp32 math, result in the input dtype (§2)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)
    pdl = False  # programmatic dependent launch where the kernel supports it (Transformer.set_pdl; docs/pdl.md)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.kernel_backend, pdl=self.pdl)


class Rope:
    """RoPE of one layer kind: θ = rope_theta plain (ratio 0) or compress_rope_theta + YaRN (ratio > 0).

    Callable as `rope(x [T, ..., D], positions [T] int64, inverse=False)`, rotating the trailing rope dims.
    `tables`: a per-forward dict (ForwardContext.rope_cache) that keeps the cos/sin of each positions tensor, so
    the layers of one kind compute them once per forward instead of once per call (same values). Where the Triton
    kernel runs (`rope_at_uses_kernel`) it computes the angles itself and no table is made.
    """

    def __init__(self, args: object, theta: float, use_yarn: bool) -> None:
        # computed on CPU even when the model is built under a meta/GPU device context (load_model): moved to the
        # positions' device on first use
        with torch.device("cpu"):
            self.freqs = self._freqs(args, theta, use_yarn)
        self.key = (float(theta), bool(use_yarn and args.rope_scaling is not None))  # equal keys: equal freqs

    @staticmethod
    def _freqs(args: object, theta: float, use_yarn: bool) -> Tensor:
        rs = args.rope_scaling
        if use_yarn and rs is not None:
            return rope_freqs(
                args.qk_rope_head_dim,
                theta,
                yarn_factor=rs.factor,
                original_max_pos=rs.original_max_position_embeddings,
                beta_fast=rs.beta_fast,
                beta_slow=rs.beta_slow,
            )
        return rope_freqs(args.qk_rope_head_dim, theta)

    def cos_sin(self, positions: Tensor, tables: dict | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin [T, P] fp32 at `positions`; looked up in / stored into `tables` when given."""
        key = (self.key, id(positions))
        hit = tables.get(key) if tables is not None else None
        if hit is not None and hit[0] is positions:  # identity: an id may be reused by a later tensor
            return hit[1], hit[2]
        if self.freqs.device != positions.device:  # move once (Rope is no nn.Module), not a copy per call
            self.freqs = self.freqs.to(positions.device)
        cos, sin = rope_cos_sin(positions, self.freqs)
        if tables is not None:
            tables[key] = (positions, cos, sin)
        return cos, sin

    def __call__(
        self, x: Tensor, positions: Tensor, inverse: bool = False, *, norm: tuple[Tensor | None, float] | None = None,
        tables: dict | None = None, backend: str = "auto", pdl: bool = False,
    ) -> Tensor:
        """norm (weight | None, eps): RMSNorm over x's last dim first (`rms_norm`), in the rope kernel when it runs.
        pdl: launch the kernels as programmatic dependent launches where they can (docs/pdl.md; same results)."""
        if self.freqs.device != positions.device:
            self.freqs = self.freqs.to(positions.device)
        if rope_at_uses_kernel(x, positions, self.freqs, norm=norm, backend=backend):  # angles in the kernel
            return apply_rope_at(x, positions, self.freqs, inverse=inverse, norm=norm, backend=backend, pdl=pdl)
        if norm is not None:
            x = rms_norm(x, norm[0], norm[1], backend=backend, pdl=pdl)
        cos, sin = self.cos_sin(positions, tables)
        return apply_rope(x, cos, sin, inverse=inverse, backend=backend, pdl=pdl)


class Compressor(nn.Module):
    """V4 compressor `attn.compressor.*` (or `attn.indexer.compressor.*`): gated per-channel softmax pooling.

    overlap=True (CSA, ratio 4): wkv/wgate are [2*width, d]; entry w pools the first halves of window w-1 with the
    second halves of window w. overlap=False (HCA): [width, d], entry w pools window w only. `ape [ratio, 2w|w]`.
    """

    def __init__(self, args: object, *, ratio: int, width: int, overlap: bool, dtype: torch.dtype) -> None:
        super().__init__()
        d = args.hidden_size
        out = (2 if overlap else 1) * width
        self.ratio, self.width, self.overlap = ratio, width, overlap
        # the reference converts compressor projections to fp32 and runs them in fp32 (docs/model.md §A.10)
        self.wkv = Linear(d, out, torch.float32)
        self.wgate = Linear(d, out, torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, out, dtype=torch.float32))
        self.norm = RMSNorm(width, args.rms_norm_eps, dtype)

    def update(
        self, x: Tensor, ctx: ForwardContext, layer_id: int, state: str, rope: Rope, out_dtype: torch.dtype,
        entry_fn: Callable[[Tensor], Tensor] | None = None,
    ) -> PagedPlan:
        """Write the entries completed by this step into the cache; returns the paged plan that addresses every
        sequence's entries.

        x: [T, d] attention input; state: "main" (the layer's compressed KV) or "indexer" (its index keys).
        entry_fn: applied to the rotated entries before they are stored (deployed record rounding, kv_numerics).
        All sequences at once: the history rows of the state ring and the new entries' pages come from the
        forward's plans (ForwardContext.ring_plan / paged_plan).
        """
        cache = ctx.cache
        r, wd = self.ratio, self.width
        pos = ctx.batch.positions
        a = self.wkv(x.float())
        z = self.wgate(x.float()) + self.ape[pos % r]
        backs = tuple(c % r + (r if self.overlap else 0) for c in ctx.ctx_lens)
        ring = ctx.ring_plan(cache.state_rows(layer_id, state), backs, write=True,
                             max_back=r - 1 + (r if self.overlap else 0))
        hist = cache.state_pool(layer_id, state, ring, torch.stack([a, z], dim=1),
                                backend=getattr(self, "kernel_backend", "auto"))  # [H + T, 2, C]
        paged = ctx.paged_plan(r)
        if paged.num_new:
            ws, seq = paged.new_w, paged.new_seq[:, None].expand(-1, r)
            cur_pos = ws[:, None] * r + torch.arange(r, device=x.device)[None, :]  # [M, r] positions
            cur = ring.pool_rows(seq, cur_pos, ctx.seq_t)
            if self.overlap:
                a_cur, z_cur = hist[cur, 0, wd:], hist[cur, 1, wd:]
                has_prev = (ws > 0)[:, None, None]
                # entry 0 has no previous window: any in-pool row (clamped position) with gate -inf
                prev = ring.pool_rows(seq, (cur_pos - r).clamp(min=0), ctx.seq_t)
                a_prev = hist[prev, 0, :wd]
                z_prev = torch.where(has_prev, hist[prev, 1, :wd], float("-inf"))
                pooled = compress_pool(torch.cat([a_prev, a_cur], 1), torch.cat([z_prev, z_cur], 1))
            else:
                pooled = compress_pool(hist[cur, 0], hist[cur, 1])
            latent = self.norm(pooled.to(out_dtype))  # the reference casts the pooled sum before the norm
            entries = rope(latent, ws * r)
            write = cache.write_entries if state == "main" else cache.write_index_keys
            write(layer_id, paged, entry_fn(entries) if entry_fn is not None else entries)
        return paged


class Indexer(nn.Module):
    """V4 lightning indexer `attn.indexer.*`: own overlapping compressor for keys, wq_b queries, head weights."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

    def __init__(self, args: object, *, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(args.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(args, ratio=ratio, width=self.head_dim, overlap=True, dtype=dtype)

    def select(self, x: Tensor, qr: Tensor, ctx: ForwardContext, view: CompressedView, rope: Rope) -> Tensor:
        """[T, topk] int64 per-sequence entry ids (ascending, -1 padded): causal top-min(k, visible)."""
        from deepinfer_engine.model.csa2 import padded_scores

        t = x.shape[0]
        pos = ctx.batch.positions
        q = rope(self.wq_b(qr).view(t, self.n_heads, self.head_dim), pos)
        w = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        # padded entries (past a sequence's count) are beyond every query's visible count: masked here
        scores = padded_scores(q, w, view, ctx, backend=self.kernel_backend)
        return topk_indices(scores, self.topk, ctx.visible_counts(view.ratio), backend=self.kernel_backend)


class Attention(nn.Module):
    """`layers.{l}.attn.*` / `mtp.{k}.attn.*` of any layer kind (plan.kind: swa | csa | hca | csa2)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)
    pdl = False  # programmatic dependent launch of this layer's rope kernels (Transformer.set_pdl; docs/pdl.md)

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__()
        d, H, Dh = args.hidden_size, args.num_attention_heads, args.head_dim
        G, Ro, Rq = args.o_groups, args.o_lora_rank, args.q_lora_rank
        self.layer_id, self.kind, self.ratio = plan.layer_id, plan.kind, plan.ratio
        self.n_heads, self.head_dim, self.n_groups, self.o_rank = H, Dh, G, Ro
        self.eps = args.rms_norm_eps
        self.q_head_norm = args.arch == "v4"
        self.window = args.sliding_window
        self.wq_a = Linear(d, Rq, dtype)
        self.q_norm = RMSNorm(Rq, self.eps, dtype)
        self.wq_b = Linear(Rq, H * Dh, dtype)
        self.wkv = Linear(d, Dh, dtype)
        self.kv_norm = RMSNorm(Dh, self.eps, dtype)
        self.wo_a = Linear(H * Dh // G, G * Ro, dtype)
        self.wo_b = Linear(G * Ro, d, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.rope = Rope(args, plan.rope_theta, plan.use_yarn)
        # deployed KV record rounding (kv_cache_dtype "auto"); Transformer.set_deployed_numerics sets it
        self.numerics = KVNumerics()
        self.compressor: nn.Module | None = None
        self.indexer: nn.Module | None = None
        self._csa2_plan = None
        if plan.kind in ("csa", "hca"):
            self.compressor = Compressor(args, ratio=plan.ratio, width=Dh, overlap=plan.kind == "csa", dtype=dtype)
            if plan.kind == "csa":
                self.indexer = Indexer(args, ratio=plan.ratio, dtype=dtype)
        elif plan.kind == "csa2":
            from deepinfer_engine.model import csa2  # V4.1 pieces; imported only when used

            self._csa2_plan = csa2.Csa2Plan.from_layer_plan(plan, args)
            if plan.has_compressor:
                self.compressor = csa2.Csa2Compressor(dim=d, head_dim=Dh, ratio=plan.ratio, eps=self.eps)
            if plan.has_indexer_k or plan.has_indexer_q:
                self.indexer = csa2.Csa2Indexer(
                    dim=d, q_lora_rank=Rq, head_dim=Dh, n_heads=args.index_n_heads,
                    index_head_dim=args.index_head_dim, has_k=plan.has_indexer_k, has_q=plan.has_indexer_q,
                    eps=self.eps,
                )  # fmt: skip
            # csa2 modules are created in fp32 (nn defaults); cast to the model dtype, keeping fp32 where the
            # reference computes in fp32 is csa2's own business (it upcasts inside).
            for m in (self.compressor, self.indexer):
                if m is not None:
                    m.to(dtype)

    # ---------------------------------------------------------------------------------------------- pieces
    def rope_fn(self, ctx: ForwardContext | None = None) -> Callable[..., Tensor]:
        """This layer's rope with the model's kernel backend and PDL switch, sharing cos/sin tables through
        ctx.rope_cache."""
        return partial(self.rope, tables=None if ctx is None else ctx.rope_cache, backend=self.kernel_backend,
                       pdl=self.pdl)

    def same_input_linears(self) -> tuple[tuple[Linear, Linear], ...]:
        """The Linears that read the same input: wq_a and wkv (one GEMM once fused, linear_pair.py)."""
        return ((self.wq_a, self.wkv),)

    def project_q(
        self, x: Tensor, positions: Tensor, rope: Callable[..., Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """q [T, H, Dh] (rotated) and the normed latent qr [T, Rq] (also the indexer's input)."""
        return self._q_from_latent(self.wq_a(x), positions, rope)

    def _q_from_latent(
        self, xq: Tensor, positions: Tensor, rope: Callable[..., Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """project_q after wq_a: xq = wq_a(x) [T, Rq] (rows may be strided)."""
        qr = self.q_norm(xq)
        return self._q_from_normed(qr, positions, rope), qr

    def _q_from_normed(self, qr: Tensor, positions: Tensor, rope: Callable[..., Tensor] | None = None) -> Tensor:
        """q [T, H, Dh] (rotated) of the normed latent qr [T, Rq]."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        return (rope or self.rope_fn())(q, positions, norm=(None, self.eps) if self.q_head_norm else None)

    def project_kv(self, x: Tensor, positions: Tensor, rope: Callable[..., Tensor] | None = None) -> Tensor:
        """Window K=V entries [T, Dh] at the given positions (rotated). DSpark context KV uses this too."""
        return self._kv_from_projection(self.wkv(x), positions, rope)

    def _kv_from_projection(
        self, xkv: Tensor, positions: Tensor, rope: Callable[..., Tensor] | None = None
    ) -> Tensor:
        """project_kv after wkv: xkv = wkv(x) [T, Dh] (rows may be strided)."""
        kv = (rope or self.rope_fn())(xkv, positions, norm=(self.kv_norm.weight, self.kv_norm.eps))
        return self.numerics.window_kv(kv, backend=self.kernel_backend)

    def write_window(self, kv: Tensor, ctx: ForwardContext) -> None:
        """Store kv [T, Dh] of the batch's tokens into this layer's ring without attending (DSpark context)."""
        cache = ctx.cache
        plan = ctx.ring_plan(cache.window_rows(self.layer_id), (0,) * ctx.num_seqs, write=True, max_back=0)
        cache.window_pool(self.layer_id, plan, kv, backend=self.kernel_backend)

    def _window(self, kv: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """Window pool [Sw, Dh] (all sequences) and per-query indices [T, K] into it (-1 = none).

        Causal: positions p-W+1..p, this step's rows are written into the ring after the history is read.
        DSpark draft (block_noncausal): [max(0, c-W), c) + the whole block, nothing written.
        """
        cache = ctx.cache
        W = self.window
        nc = ctx.block_noncausal
        back = W if nc else W - 1
        plan = ctx.ring_plan(cache.window_rows(self.layer_id), (back,) * ctx.num_seqs, write=not nc, max_back=back)
        pool = cache.window_pool(self.layer_id, plan, kv, write=not nc, backend=self.kernel_backend)
        return pool, ctx.window_rows(plan, W, noncausal=nc)

    def _compressed(
        self, x: Tensor, qr: Tensor, ctx: ForwardContext, rope: Callable[..., Tensor] | None = None
    ) -> CompressedSelection | None:
        """The compressed entries each query attends to besides its window (None for SWA layers).

        THE plug-in point for V4.1: kind "csa2" delegates to csa2.csa2_update_source (kv sources) and
        csa2.csa2_select (every CSA2 layer), which read/publish ctx.compressed / ctx.topk / ctx.candidates.
        """
        if self.kind == "swa":
            return None
        rope = rope or self.rope_fn(ctx)
        if self.kind == "csa2":
            from deepinfer_engine.model import csa2

            plan = self._csa2_plan
            # a source already published in this forward (prefill truncation wrote it for every row) is kept
            if plan.has_compressor and plan.layer_id not in ctx.compressed:
                csa2.csa2_update_source(
                    plan=plan, compressor=self.compressor, indexer=self.indexer, x=x, ctx=ctx, rope=rope,
                    numerics=self.numerics,
                )
            return csa2.csa2_select(
                plan=plan, indexer=self.indexer, x=x, qr=qr, ctx=ctx, rope=rope, numerics=self.numerics,
                backend=self.kernel_backend,
            )
        cache = ctx.cache
        lid, r = self.layer_id, self.ratio
        paged = self.compressor.update(x, ctx, lid, "main", rope, x.dtype, entry_fn=self.numerics.compressed_kv)
        counts = paged.counts
        keys = None
        if self.kind == "csa":
            self.indexer.compressor.update(x, ctx, lid, "indexer", rope, x.dtype)
            keys = cache.read_index_keys(lid, paged, backend=self.kernel_backend)
        store, rows = cache.entry_source(lid, paged)
        view = CompressedView(
            store=store, rows=rows, index_keys=keys, seq_offsets=paged.offsets, seq_counts=counts, ratio=r,
            kv_format=cache.entry_format(),
        )
        if self.kind == "hca":  # dense over all visible entries
            k = max(counts) if counts else 0
            w = torch.arange(k, device=x.device)[None, :].expand(x.shape[0], k)
            sel = torch.where(w < ctx.visible_counts(r)[:, None], w, torch.full_like(w, -1))
        else:  # csa: lightning indexer top-k
            sel = self.indexer.select(x, qr, ctx, view, rope)
            ctx.topk[lid] = sel
        ctx.compressed[lid] = view
        rows = view.store_rows(sel, ctx.seq_of_token, paged.offsets_t, backend=self.kernel_backend)
        return CompressedSelection(kv=view.store, indices=rows, kv_format=view.kv_format)

    # ---------------------------------------------------------------------------------------------- forward
    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        """x [T, d] = attn_norm(collapsed streams) -> [T, d]."""
        pos = ctx.batch.positions
        t = x.shape[0]
        rope = self.rope_fn(ctx)
        xq, xkv = linear_pair(x, self.wq_a, self.wkv)  # one GEMM launch when the pair is fused
        side = None if ctx.side_streams is None else ctx.side_streams.query
        if side is None:
            q, qr = self._q_from_latent(xq, pos, rope)
            kv = self._kv_from_projection(xkv, pos, rope)
        else:
            # the query's wq_b (the largest attention weight) beside the KV path and the compressed selection;
            # the window KV is roped first, so whatever rope state it sets up exists before the fork
            qr = self.q_norm(xq)
            kv = self._kv_from_projection(xkv, pos, rope)
            q_side = run_beside(side, self._q_from_normed, qr, pos, rope)
        pool, idx = self._window(kv, ctx)
        sel = self._compressed(x, qr, ctx, rope)
        if side is not None:
            q = join(q_side)
        kv2 = idx2 = fmt2 = None
        fmt = ctx.cache.window_format()
        if sel is not None and sel.indices.shape[1] > 0:
            # window pool + the compressed cache read in place through store rows (one softmax over both);
            # records are decoded in the kernel's gather; a plain cache kept in another dtype than the
            # activations is cast (a copy: only tests mix dtypes)
            kv2, idx2, fmt2 = sel.kv, sel.indices, sel.kv_format
            if fmt2 is None and kv2.dtype != q.dtype:
                kv2 = kv2.to(q.dtype)
        o = sparse_attn(q, pool, idx, self.attn_sink, self.head_dim**-0.5, kv2=kv2, indices2=idx2, kv_format=fmt,
                        kv2_format=fmt2, backend=self.kernel_backend)  # [T, H, Dh]
        o = rope(o, pos, inverse=True)  # de-rotate at the query position (V carries rotated rope dims)
        o = o.reshape(t, self.n_groups, -1)
        z = self.wo_a.grouped(o, self.n_groups)
        return self.wo_b(z.reshape(t, -1))
