"""Transformer layers: `Block` (one backbone layer `layers.{l}.`, or the ratio-0 core of a draft stage) and the
V4 `MTPBlock` (docs/model.md §A.9). Their own module so the model (model.py) and the DSpark stages (dspark.py)
both build on them without importing each other.

Shapes: T tokens of the step (flattened varlen), n = hc_mult streams, d hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.attention import Attention, RMSNorm
from deepinfer_engine.model.forward_batch import ForwardContext
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.mhc import (
    add_hc_head_params,
    add_hc_mix_params,
    apply_hc_head,
    apply_hc_mix,
    hc_post,
    hc_post_pre,
    hc_pre,
)
from deepinfer_engine.model.moe import MoE
from deepinfer_engine.model.overlap import SideStreams, join, run_beside

__all__ = ["Block", "MTPBlock"]


class Block(nn.Module):
    """One layer `layers.{l}.` (or a draft layer `mtp.{k}.`): [Engram] → attention sub-layer → MoE sub-layer.

    forward(R, ctx, pre_prev) -> (R', pre_ffn). V4 collapses each sub-layer input with its own `pre`; V4.1
    (delayed mHC) with the `pre` of the previous sub-layer (`pre_prev`; None = layer 0 → stream 0).
    """

    kernel_backend = "auto"  # replaced by the model-wide backend resolved at build (Transformer)

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        self.layer_id = plan.layer_id
        self.delayed = args.uses_delayed_mhc
        d = args.hidden_size
        self.attn = Attention(args, plan, dtype)
        self.ffn = MoE(args, plan, dtype)
        self.attn_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        add_hc_mix_params(self, "hc_attn", args)
        add_hc_mix_params(self, "hc_ffn", args)
        self.engram: nn.Module | None = None
        if plan.has_engram:
            from deepinfer_engine.model import engram  # V4.1

            self.engram_col = engram.engram_layer_index(tuple(args.engram_layer_ids), plan.layer_id)
            self.engram = engram.Engram(
                dim=d, hc_mult=args.hc_mult, num_embeddings=args.engram_num_embeddings[self.engram_col],
                head_dim=args.engram_head_dim, num_lookups=args.engram_num_ngram_heads, eps=args.rms_norm_eps,
            ).to(dtype)  # fmt: skip

    def forward(
        self, r: Tensor, ctx: ForwardContext, pre_prev: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """r [T, n, d] -> (r' [T, n, d], pre of the FFN mixes [T, n] f32)."""
        r, pre_f, _ = self.forward_chained(r, ctx, pre_prev)
        return r, pre_f

    def forward_chained(
        self, r: Tensor, ctx: ForwardContext, pre_prev: Tensor | None = None, *, collapsed: Tensor | None = None,
        collapse_next: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """forward, chained through the V4.1 collapses (delayed mHC: the next sub-layer's pre is known when a
        sub-layer's output is combined, so one pass writes R' and collapses it).

        collapsed: this layer's attention input before attn_norm, hc_pre(r, pre_prev), as the previous layer's
        collapse_next returned it (ignored where this layer has Engram: it changes r first). collapse_next:
        also return hc_pre(r', pre_f) [T, d], the next layer's (or the head's) collapse; None when not delayed.
        """
        r = self._engram(r, ctx)
        streams = ctx.side_streams
        if self.delayed and streams is not None:
            # delayed mHC: a sub-layer's input is collapsed with the previous sub-layer's pre, so its own mixes
            # are needed only when its output is combined; they run beside the sub-layer (overlap.py)
            return self._forward_delayed_beside(r, ctx, pre_prev, collapsed, collapse_next, streams)
        pre_a, post_a, comb_a = apply_hc_mix(self, "hc_attn", r, self.args)
        if collapsed is not None and self.delayed and self.engram is None:
            x = collapsed
        else:
            x = self._collapse(r, pre_a, pre_prev)
        y = self.attn(self.attn_norm(x), ctx)
        if self.delayed:  # the FFN collapses with pre_a, known already: one pass writes R' and reads it back
            r, x = hc_post_pre(y, r, post_a, comb_a, pre_a, backend=self.kernel_backend)
            pre_f, post_f, comb_f = apply_hc_mix(self, "hc_ffn", r, self.args)
        else:
            r = hc_post(y, r, post_a, comb_a, backend=self.kernel_backend)
            pre_f, post_f, comb_f = apply_hc_mix(self, "hc_ffn", r, self.args)
            x = hc_pre(r, pre_f, backend=self.kernel_backend)
        side = None if streams is None else streams.shared_expert
        y = self.ffn(self.ffn_norm(x), ctx.batch.input_ids, ctx.image_mask, side=side)
        if collapse_next and self.delayed:
            r, x_next = hc_post_pre(y, r, post_f, comb_f, pre_f, backend=self.kernel_backend)
            return r, pre_f, x_next
        return hc_post(y, r, post_f, comb_f, backend=self.kernel_backend), pre_f, None

    def _forward_delayed_beside(
        self, r: Tensor, ctx: ForwardContext, pre_prev: Tensor | None, collapsed: Tensor | None,
        collapse_next: bool, streams: SideStreams,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """forward_chained of a delayed-mHC layer (after Engram) with each sub-layer's mixes on the mix stream
        beside it: the same ops on the same inputs as the one-stream path."""
        mix_a = run_beside(streams.mix, apply_hc_mix, self, "hc_attn", r, self.args)
        x = collapsed if collapsed is not None and self.engram is None else self._collapse(r, None, pre_prev)
        y = self.attn(self.attn_norm(x), ctx)
        pre_a, post_a, comb_a = join(mix_a)
        r, x = hc_post_pre(y, r, post_a, comb_a, pre_a, backend=self.kernel_backend)
        mix_f = run_beside(streams.mix, apply_hc_mix, self, "hc_ffn", r, self.args)
        y = self.ffn(self.ffn_norm(x), ctx.batch.input_ids, ctx.image_mask, side=streams.shared_expert)
        pre_f, post_f, comb_f = join(mix_f)
        if collapse_next:
            r, x_next = hc_post_pre(y, r, post_f, comb_f, pre_f, backend=self.kernel_backend)
            return r, pre_f, x_next
        return hc_post(y, r, post_f, comb_f, backend=self.kernel_backend), pre_f, None

    def attn_input(self, r: Tensor, ctx: ForwardContext, pre_prev: Tensor | None = None) -> Tensor:
        """[T, d] the attention sub-layer's input (after attn_norm) for streams r [T, n, d], as forward computes
        it (prefill truncation runs the boundary layer's compressor on every row from it)."""
        r = self._engram(r, ctx)
        pre_a = None if self.delayed else apply_hc_mix(self, "hc_attn", r, self.args)[0]
        return self.attn_norm(self._collapse(r, pre_a, pre_prev))

    def prefetch_engram(self, ctx: ForwardContext, stream: torch.cuda.Stream) -> None:
        """Start this layer's Engram key/value projection on `stream` (it reads token ids only: the model calls this
        while the previous layer runs); the layer's forward joins it."""
        ctx.engram_kv[self.layer_id] = run_beside(stream, self.engram.project, self._engram_rows(ctx))

    def _engram_rows(self, ctx: ForwardContext) -> Tensor:
        if ctx.engram_rows is None:
            raise ModelConfigError(
                f"layer {self.layer_id} has Engram but the forward has no Engram row ids "
                "(set Transformer.engram_hasher, e.g. via load_model or set_engram_token_map)"
            )
        return ctx.engram_rows[:, self.engram_col]

    def _engram(self, r: Tensor, ctx: ForwardContext) -> Tensor:
        if self.engram is None:
            return r
        ahead = ctx.engram_kv.pop(self.layer_id, None)
        kv = self.engram.project(self._engram_rows(ctx)) if ahead is None else join(ahead)
        return self.engram.inject(r, kv, ctx.image_mask)

    def _collapse(self, r: Tensor, pre_a: Tensor | None, pre_prev: Tensor | None) -> Tensor:
        """The attention input before its norm: V4 collapses with its own pre, V4.1 (delayed) with the previous
        sub-layer's (layer 0: stream 0 = the embedding)."""
        if not self.delayed:
            return hc_pre(r, pre_a, backend=self.kernel_backend)
        if pre_prev is None:
            return r[:, 0]
        return hc_pre(r, pre_prev, backend=self.kernel_backend)


class MTPBlock(Block):
    """V4-Flash MTP block `mtp.{k}.` (docs/model.md §A.9): e_proj/h_proj/enorm/hnorm/norm + own hc_head around a ratio-0 Block."""

    def __init__(self, args: object, plan: object, dtype: torch.dtype) -> None:
        super().__init__(args, plan, dtype)
        d = args.hidden_size
        self.e_proj = Linear(d, d, dtype)
        self.h_proj = Linear(d, d, dtype)
        self.enorm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.norm = RMSNorm(d, args.rms_norm_eps, dtype)
        add_hc_head_params(self, args)

    @torch.no_grad()
    def forward_mtp(self, r_t: Tensor, e: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """r_t [T, n, d] backbone streams at t (before hc_head), e [T, d] = embed[token t+1].

        Returns (normed head input [T, d], the block's output streams [T, n, d])."""
        x = self.h_proj(self.hnorm(r_t)) + self.e_proj(self.enorm(e))[:, None, :]
        x, _ = Block.forward(self, x, ctx)
        return self.norm(apply_hc_head(self, x, self.args)), x
