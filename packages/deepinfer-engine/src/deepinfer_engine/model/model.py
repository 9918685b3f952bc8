"""The DeepSeek-V4 / V4.1 text model (architecture.md §A.1-§A.9, §C.1-§C.2), module by module as the reference.

Parameter names equal the official checkpoint names (`embed.weight`, `layers.{l}.attn.wq_a.weight`, `mtp.{k}.…`).
V4: mHC with the learned hc_head, SWA / CSA / HCA, hash-routed MoE in the first `num_hash_layers`, MTP block.
V4.1: delayed mHC (pre from the previous sub-layer, no hc_head), CSA2 (csa2.py), Engram (engram.py), DSpark
stages (dspark.py). Runs on CPU through the torch references of deepinfer-kernels.

Shapes: T tokens of the step (flattened varlen), n = hc_mult streams, d hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from deepinfer_kernels.linear import linear_f32_out
from torch import Tensor, nn

from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.attention import Attention, RMSNorm
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.mhc import (
    add_hc_head_params,
    add_hc_mix_params,
    apply_hc_head,
    apply_hc_mix,
    hc_post,
    hc_pre,
)
from deepinfer_engine.model.moe import MoE

__all__ = ["Block", "MTPBlock", "ModelOutput", "Transformer"]


class Block(nn.Module):
    """One layer `layers.{l}.` (or a draft layer `mtp.{k}.`): [Engram] → attention sub-layer → MoE sub-layer.

    forward(R, ctx, pre_prev) -> (R', pre_ffn). V4 collapses each sub-layer input with its own `pre`; V4.1
    (delayed mHC) with the `pre` of the previous sub-layer (`pre_prev`; None = layer 0 → stream 0).
    """

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
            from deepinfer_engine.model import engram  # V4.1 (M-41)

            self.engram_col = engram.engram_layer_index(tuple(args.engram_layer_ids), plan.layer_id)
            self.engram = engram.Engram(
                dim=d, hc_mult=args.hc_mult, num_embeddings=args.engram_num_embeddings[self.engram_col],
                head_dim=args.engram_head_dim, num_lookups=args.engram_num_ngram_heads, eps=args.rms_norm_eps,
            ).to(dtype)  # fmt: skip

    def forward(
        self, r: Tensor, ctx: ForwardContext, pre_prev: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """r [T, n, d] -> (r' [T, n, d], pre of the FFN mixes [T, n] f32)."""
        if self.engram is not None:
            if ctx.engram_rows is None:
                raise ModelConfigError(
                    f"layer {self.layer_id} has Engram but the forward has no Engram row ids "
                    "(set Transformer.engram_hasher, e.g. via load_model or set_engram_token_map)"
                )
            r = self.engram(r, ctx.engram_rows[:, self.engram_col], ctx.image_mask)
        pre_a, post_a, comb_a = apply_hc_mix(self, "hc_attn", r, self.args)
        if not self.delayed:
            x = hc_pre(r, pre_a)
        elif pre_prev is None:
            x = r[:, 0]  # delayed mHC starts from stream 0 (= the embedding)
        else:
            x = hc_pre(r, pre_prev)
        r = hc_post(self.attn(self.attn_norm(x), ctx), r, post_a, comb_a)
        pre_f, post_f, comb_f = apply_hc_mix(self, "hc_ffn", r, self.args)
        x = hc_pre(r, pre_a if self.delayed else pre_f)
        r = hc_post(self.ffn(self.ffn_norm(x), ctx.batch.input_ids), r, post_f, comb_f)
        return r, pre_f


class MTPBlock(Block):
    """V4-Flash MTP block `mtp.{k}.` (§A.9): e_proj/h_proj/enorm/hnorm/norm + own hc_head around a ratio-0 Block."""

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


@dataclass(kw_only=True)
class ModelOutput:
    """logits [N, V] f32 (rows batch.logits_indices); hidden: final streams [T, n, d] before the head collapse;
    pre_last: V4.1 pre of the last FFN mixes [T, n] (None for V4); features: captured [T, d] per layer id."""

    logits: Tensor
    hidden: Tensor
    pre_last: Tensor | None
    features: dict[int, Tensor] = field(default_factory=dict)


class Transformer(nn.Module):
    """`embed` → layers → head collapse (V4 hc_head / V4.1 last pre-mix) → `norm` → `head` (fp32 logits).

    quantized: hold every tensor the checkpoint stores quantized in that format (FP8 / FP4 + scales, decoded in
    the GEMMs; what load_model builds); False: dense weights in `dtype` (random-init tests). quantize_activations
    (with quantized): FP8 Linears quantize their inputs to e4m3 per 1 x block channels (deployed numerics).
    """

    def __init__(
        self,
        args: object,
        dtype: torch.dtype = torch.float32,
        *,
        with_draft: bool = True,
        quantized: bool = False,
        quantize_activations: bool = False,
    ) -> None:
        super().__init__()
        if quantize_activations and not quantized:
            raise ModelConfigError("quantize_activations needs quantized=True (FP8 weights in memory)")
        self.args = args
        self.with_draft = with_draft
        self.dtype = dtype
        d, V = args.hidden_size, args.vocab_size
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(V, d, dtype=dtype))
        backbone = [p for p in args.layer_plans if not p.is_draft]
        self.layers = nn.ModuleList(Block(args, p, dtype) for p in backbone)
        self.norm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.head = Linear(d, V, dtype)
        if args.has_hc_head:
            add_hc_head_params(self, args)
        # Engram row ids depend only on token ids: one host-side hasher per model (needs the token map).
        self.engram_hasher: object | None = None
        drafts = [p for p in args.layer_plans if p.is_draft]
        self.mtp: nn.ModuleList | None = None
        if drafts and with_draft:
            if args.has_dspark:
                from deepinfer_engine.model import dspark  # DSpark stages (M-41)

                self.mtp = dspark.build_stages(args, dtype)
            else:
                self.mtp = nn.ModuleList(MTPBlock(args, p, dtype) for p in drafts)
        self.quantized = quantized
        if quantized:
            from deepinfer_engine.model.weight_formats import apply_checkpoint_formats

            apply_checkpoint_formats(self, args, quantize_activations=quantize_activations)

    def set_engram_token_map(self, token_map: object) -> None:
        """Install the Engram hasher from a compressed token map (numpy int64 [vocab], engram_hash)."""
        from deepinfer_engine.model.engram_hash import EngramHasher

        self.engram_hasher = EngramHasher.from_args(self.args, token_map)

    # ---------------------------------------------------------------------------------------------- checks
    def check_inputs(
        self, batch: ForwardBatch, cache: ModelCache, *, backbone: bool = True
    ) -> tuple[int, ...]:
        """Typed errors for bad input before any matmul (contracts §3: InputError; CapacityError for a backbone
        step that rolls back further than the cache slack). Returns the sequences' first positions (ctx_lens).

        All device-side facts (id / position / logits-index ranges, consecutive positions, first positions) are
        reduced on the device and read back in ONE host transfer.
        """
        a = self.args
        ids, pos, li = batch.input_ids, batch.positions, batch.logits_indices
        if any(s < 0 or s >= cache.num_slots for s in batch.slots):
            raise InputError(f"slots: found {batch.slots}, expected each in [0, {cache.num_slots})")
        t = ids.numel()
        starts, s = [], 0
        for n in batch.query_lens:
            starts.append(s)
            s += n
        parts: list[Tensor] = []
        if t:
            parts += [ids.min(), ids.max(), pos.min(), pos.max()]
            # first row j (>= 1, not a sequence start) whose position is not its predecessor's + 1; t if none
            ok = torch.ones(t, dtype=torch.bool, device=pos.device)
            ok[1:] = pos[1:] - pos[:-1] == 1
            ok[torch.tensor(starts, dtype=torch.int64, device=pos.device)] = True
            rows = torch.arange(t, device=pos.device)
            parts.append(torch.where(ok, torch.full_like(rows, t), rows).min())
            parts.append(pos[torch.tensor(starts, dtype=torch.int64, device=pos.device)])
        if li.numel():
            parts += [li.min(), li.max()]
        vals = torch.cat([p.reshape(-1) for p in parts]).tolist() if parts else []  # the one host sync
        ctx_lens: tuple[int, ...] = ()
        if t:
            lo, hi, pmin, pmax, bad_row = vals[:5]
            ctx_lens = tuple(int(v) for v in vals[5 : 5 + len(starts)])
            if lo < 0 or hi >= a.vocab_size:
                bad = lo if lo < 0 else hi
                raise InputError(
                    f"input_ids: found token id {bad}, expected 0 <= id < vocab_size={a.vocab_size}"
                )
            if pmin < 0 or pmax >= a.max_position_embeddings:
                bad = pmin if pmin < 0 else pmax
                raise InputError(
                    f"positions: found {bad}, expected 0 <= position < max_position_embeddings="
                    f"{a.max_position_embeddings}"
                )
            if bad_row < t:
                i = max(j for j, st in enumerate(starts) if st <= bad_row)
                p = pos[starts[i] : starts[i] + batch.query_lens[i]]
                raise InputError(
                    f"positions of sequence {i}: found {p.tolist()[:8]}..., expected consecutive"
                )
        if backbone:  # draft steps (MTP) run at positions of their own; they do not move the mark
            for slot, c in zip(batch.slots, ctx_lens):
                cache.check_resume(slot, c)
        if li.numel():
            lmin, lmax = vals[-2:]
            if lmin < 0 or lmax >= batch.num_tokens:
                raise InputError(f"logits_indices: found {lmin}..{lmax}, expected in [0, {batch.num_tokens})")
        return ctx_lens

    def _token_history(self, ctx: ForwardContext) -> Tensor | None:
        """[T, max_ngram] ids at positions p-max_ngram+1..p (-1 before 0), and store this step's ids in the ring."""
        ring = ctx.cache.token_ring
        if ring is None:
            return None
        k = self.args.engram_max_ngram_size
        plan = ctx.ring_plan(ring.shape[1], (k - 1,) * ctx.num_seqs, write=True)
        pool = plan.gather(ring, ctx.batch.input_ids)  # [H + T] ids
        idx = ctx.window_rows(plan, k, noncausal=False)  # [T, k]: positions p-k+1 .. p, -1 before 0
        return torch.where(idx >= 0, pool[idx.clamp(min=0)], torch.full_like(idx, -1))

    # ---------------------------------------------------------------------------------------------- forward
    @torch.no_grad()  # inference-only model: no autograd graph, whatever the caller's grad mode
    def forward_features(
        self, batch: ForwardBatch, cache: ModelCache, *, capture: tuple[int, ...] = ()
    ) -> ModelOutput:
        ctx_lens = self.check_inputs(batch, cache)
        ctx = ForwardContext.build(batch, cache, ctx_lens=ctx_lens, capture_layers=tuple(capture))
        ctx.token_history = self._token_history(ctx)
        a = self.args
        if a.engram_layer_ids and self.engram_hasher is not None:
            from deepinfer_engine.model import engram

            ctx.engram_rows = engram.engram_row_ids(
                self.engram_hasher, batch.input_ids, batch.query_lens, ctx.token_history
            )
            ctx.image_mask = engram.image_positions(batch.input_ids, a.image_token_id)
        e = self.embed.weight[batch.input_ids]  # [T, d]
        r = e[:, None, :].expand(-1, a.hc_mult, -1).contiguous()  # [T, n, d]
        pre: Tensor | None = None
        for layer in self.layers:
            lid = layer.layer_id
            if a.arch == "v41" and lid in ctx.capture_layers:
                ctx.features[lid] = r.float().mean(dim=1).to(r.dtype)
            r, pre = layer(r, ctx, pre)
            if a.arch == "v4" and lid in ctx.capture_layers:
                ctx.features[lid] = r.float().mean(dim=1).to(r.dtype)
        for i, slot in enumerate(batch.slots):
            cache.high_water[slot] = ctx.end_len(i)
        rows = r[batch.logits_indices]
        if a.has_hc_head:
            h = apply_hc_head(self, rows, a)
            pre_last = None
        else:
            pre_last = pre
            h = hc_pre(rows, pre[batch.logits_indices])
        # fp32 logits (§A.1) without widening the [V, d] head weight: fp32 accumulation over its stored dtype
        logits = linear_f32_out(self.norm(h), self.head.weight)
        return ModelOutput(logits=logits, hidden=r, pre_last=pre_last, features=dict(ctx.features))

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        """[N, V] float32 logits of the rows batch.logits_indices (contracts §3)."""
        return self.forward_features(batch, cache).logits

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, cache: ModelCache, hidden: Tensor, k: int = 0) -> Tensor:
        """V4 MTP block k: batch carries the NEXT tokens (id t+1) at the chosen positions; hidden [T, n, d] the
        backbone streams of the same rows. Returns [N, V] f32 logits (predicting t+2)."""
        if self.mtp is None or self.args.has_dspark:
            raise InputError(
                "forward_mtp: this model has no V4 MTP block (num_nextn_predict_layers == 0 or DSpark)"
            )
        ctx_lens = self.check_inputs(batch, cache, backbone=False)
        ctx = ForwardContext.build(batch, cache, ctx_lens=ctx_lens)
        blk: MTPBlock = self.mtp[k]
        h, _ = blk.forward_mtp(hidden, self.embed.weight[batch.input_ids], ctx)
        return linear_f32_out(h[batch.logits_indices], self.head.weight)
