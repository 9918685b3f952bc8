"""Matrix-product FLOPs of one V4.1 prompt's prefill, with and without decoder truncation (docs/prefill_truncation.md).

`prefill_flops(args, prompt_len, keep=None)` counts 2·m·n·k for every matrix product the backbone runs on one
prompt of `prompt_len` tokens prefilled in one forward (the first token's logits only), by kind:
- `linear`:    every projection (attention q / kv / output LoRA, compressor, indexer, Engram value/keys, MoE
               gate, the k routed experts and the shared expert of each token, the head);
- `mhc`:       the hyper-connection mixes (a [n·d -> (2+n)·n] product per sub-layer) and the stream collapses /
               expansions (pre: n·d, post: n·n·d per row);
- `attention`: q·k and p·v over each query's window and its selected compressed entries (window + index_topk
               slots per query on a CSA2 layer: fixed-width, as a sparse kernel computes them);
- `index`:     indexer scores q·k over the kv source's entries (and the per-head weighting): `causal=True` counts
               only the entries each query may see, `causal=False` every entry of the prompt for every query
               (what the torch reference computes before masking).
With `keep`, the layers from the first ratio-1 layer on (the decoder) run on min(prompt_len, keep) rows; the
boundary layer's compressor and index keys, and the attention input they need, still run on every row.
Element-wise work (norms, RoPE, softmax, Sinkhorn, routing) is not counted. Pure Python over ModelArgs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.args import ModelArgs

__all__ = ["PrefillFlops", "prefill_flops", "prefill_flops_table"]


@dataclass(frozen=True, kw_only=True)
class PrefillFlops:
    """FLOPs by kind (see the module doc) and the share of them spent in the decoder layers."""

    linear: int
    mhc: int
    attention: int
    index: int
    decoder: int  # the part of the total spent in layers from the first ratio-1 layer on

    @property
    def total(self) -> int:
        return self.linear + self.mhc + self.attention + self.index

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _visible_sum(rows_first: int, rows: int, ratio: int) -> int:
    """Σ over positions t = rows_first .. rows_first + rows - 1 of the entries t sees: floor((t + 1) / ratio)."""
    def upto(m: int) -> int:  # Σ_{u=1..m} floor(u / r)
        q, rem = divmod(m, ratio)
        return ratio * q * (q - 1) // 2 + q * (rem + 1)

    return upto(rows_first + rows) - upto(rows_first)


def prefill_flops(args: ModelArgs, prompt_len: int, keep: int | None = None, *, causal: bool = True) -> PrefillFlops:
    """Matrix-product FLOPs of prefilling one prompt (module doc); keep=None: no truncation."""
    if args.arch != "v41":
        raise ConfigError(f"prefill_flops: found arch {args.arch!r}, expected 'v41' (the CSA2 layer topology)")
    if prompt_len < 1 or (keep is not None and keep < 1):
        raise ConfigError(f"prefill_flops: found prompt_len={prompt_len}, keep={keep}; expected both >= 1")
    P = prompt_len
    d, n = args.hidden_size, args.hc_mult
    H, Dh, Rq, G, Ro = args.num_attention_heads, args.head_dim, args.q_lora_rank, args.o_groups, args.o_lora_rank
    HI, Di, W = args.index_n_heads, args.index_head_dim, args.sliding_window
    mix = (2 + n) * n
    plans = [p for p in args.layer_plans if not p.is_draft]
    boundary = next((p.layer_id for p in plans if p.ratio == 1), None)
    if keep is not None and boundary is None:
        raise ConfigError("prefill_flops: keep given but the model has no ratio-1 layer (no decoder to truncate)")
    kept = P if keep is None else min(P, keep)
    lin = mhc = att = idx = dec = 0
    for p in plans:
        in_decoder = boundary is not None and p.layer_id >= boundary
        T = kept if in_decoder else P
        first = P - T  # position of the layer's first row
        l_lin = l_mhc = l_att = l_idx = 0
        # mHC: two mixes, two pre-collapses (layer 0's attention input is stream 0), two post-expansions
        l_mhc += 2 * (2 * T * n * d * mix) + 2 * (2 * T * n * n * d)
        l_mhc += (1 if p.layer_id == 0 else 2) * 2 * T * n * d
        lookups = args.engram_n_heads * (args.engram_max_ngram_size - 1)
        if p.has_engram:
            l_lin += 2 * T * lookups * args.engram_head_dim * (n + 1) * d
        # attention projections and output LoRA
        l_lin += 2 * T * (d * Rq + Rq * H * Dh + d * Dh + H * Dh * Ro + G * Ro * d)
        slots = W + (args.index_topk if p.kind == "csa2" else 0)
        l_att += 2 * (2 * T * H * Dh * slots)
        if p.has_compressor:
            rows = P  # the compressed KV and index keys of every row (also the truncation boundary)
            if in_decoder and T < P:  # the boundary's attention input for every row, before it runs on T rows
                l_mhc += 2 * P * n * d
                if p.has_engram:
                    l_lin += 2 * P * lookups * args.engram_head_dim * (n + 1) * d
            l_lin += 2 * rows * d * Dh * (2 if p.ratio == 2 else 1)
            l_lin += 2 * (P // p.ratio) * Dh * Di  # index keys of the new entries
        if p.has_indexer_q:
            entries = P // p.ratio
            l_lin += 2 * T * (Rq * HI * Di + d * HI)
            scored = _visible_sum(first, T, p.ratio) if causal else T * entries
            l_idx += 2 * scored * HI * Di + 2 * scored * HI
        # MoE: gate, the k routed experts and the shared expert(s) of each row (SwiGLU: three products)
        inter = args.moe_intermediate_size
        l_lin += 2 * T * d * p.n_routed_experts
        l_lin += T * p.num_experts_per_tok * 3 * 2 * d * inter + T * 3 * 2 * d * inter * args.n_shared_experts
        lin, mhc, att, idx = lin + l_lin, mhc + l_mhc, att + l_att, idx + l_idx
        if in_decoder:
            dec += l_lin + l_mhc + l_att + l_idx
    # the first token's logits: collapse of the last row and the head
    mhc += 2 * n * d
    lin += 2 * d * args.vocab_size
    return PrefillFlops(linear=lin, mhc=mhc, attention=att, index=idx, decoder=dec)


def prefill_flops_table(args: ModelArgs, lengths: list[int], keep: int = 140) -> list[dict[str, float]]:
    """Per prompt length: total FLOPs without and with truncation, the saving and the decoder's share."""
    out = []
    for P in lengths:
        full, cut = prefill_flops(args, P), prefill_flops(args, P, keep)
        out.append({
            "prompt_len": P, "full": full.total, "compact": cut.total, "saved": full.total - cut.total,
            "saved_frac": (full.total - cut.total) / full.total, "decoder_frac_full": full.decoder / full.total,
        })  # fmt: skip
    return out
