"""`LayerPlan`: what one layer contains and which caches it reads, derived once from `ModelArgs`.

The one place the model, the cache layout and the checkpoint inventory read layer kinds from (docs/model.md
docs/model.md §A.5-§A.7 for V4, docs/model.md §C.3-§C.4 for V4.1). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from deepinfer_engine.model.args import ModelArgs

__all__ = ["LayerKind", "LayerMode", "LayerPlan", "build_layer_plans"]

LayerKind = Literal["swa", "csa", "hca", "csa2"]
LayerMode = Literal["swa", "full", "reuse", "reindex"]


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """What one layer (backbone or MTP/DSpark draft layer) contains and which caches it reads.

    kind: V4 ``swa`` (ratio 0) / ``csa`` (ratio 4: overlapping compressor + own indexer) / ``hca`` (other
    ratio > 0: compressor, no indexer); V4.1 ``swa`` / ``csa2`` (ratio 1 or 2).
    mode: ``swa``; ``full`` (own compressed cache; V4.1: kv source with its own indexer); ``reuse`` (V4.1: reads
    the compressed cache of ``kv_source`` and the top-k of ``index_source``); ``reindex`` (V4.1: own indexer-Q
    over the keys of ``kv_source``).
    """

    layer_id: int
    ratio: int
    kind: LayerKind
    mode: LayerMode
    kv_source: int | None  # layer whose compressed KV cache this layer attends to (None: SWA only)
    index_source: int | None  # layer whose top-k selection this layer uses (None: no indexer / dense HCA)
    has_compressor: bool  # owns attn.compressor.* (writes a compressed cache)
    has_indexer_k: bool  # produces indexer keys (V4: attn.indexer.compressor.*, V4.1: attn.indexer.wk/k_norm)
    has_indexer_q: bool  # owns attn.indexer.wq_b / weights_proj (runs a top-k)
    publishes_candidates: bool  # V4.1 candidate source: publishes top candidate blocks
    consumes_candidates: bool  # V4.1 index source after the candidate source: top-k restricted to them
    rope_theta: float
    use_yarn: bool
    is_hash_layer: bool  # V4: experts routed by ffn.gate.tid2eid[token id]
    has_engram: bool
    is_draft: bool  # MTP (V4) / DSpark stage; checkpoint prefix mtp.{layer_id - num_hidden_layers}.
    # derived, for the inventory and the model:
    prefix: str = ""  # checkpoint name prefix, "layers.{l}." or "mtp.{k}."
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0



def build_layer_plans(a: ModelArgs) -> tuple[LayerPlan, ...]:
    L = a.num_hidden_layers
    plans: list[LayerPlan] = []
    yarn = a.rope_scaling is not None
    for l, ratio in enumerate(a.compress_ratios):
        is_draft = l >= L
        common: dict[str, Any] = dict(
            layer_id=l,
            ratio=ratio,
            is_hash_layer=(not is_draft) and l < a.num_hash_layers,
            has_engram=l in a.engram_layer_ids,
            is_draft=is_draft,
            prefix=f"mtp.{l - L}." if is_draft else f"layers.{l}.",
            n_routed_experts=a.dspark_n_experts if (is_draft and a.has_dspark) else a.n_routed_experts,
            num_experts_per_tok=a.dspark_top_k if (is_draft and a.has_dspark) else a.num_experts_per_tok,
        )
        if ratio == 0:
            plans.append(
                LayerPlan(
                    kind="swa", mode="swa", kv_source=None, index_source=None, has_compressor=False,
                    has_indexer_k=False, has_indexer_q=False, publishes_candidates=False,
                    consumes_candidates=False, rope_theta=a.rope_theta, use_yarn=False, **common,
                )
            )  # fmt: skip
            continue
        if a.arch == "v4":
            csa = ratio == 4
            plans.append(
                LayerPlan(
                    kind="csa" if csa else "hca", mode="full", kv_source=l, index_source=l if csa else None,
                    has_compressor=True, has_indexer_k=csa, has_indexer_q=csa, publishes_candidates=False,
                    consumes_candidates=False, rope_theta=a.compress_rope_theta, use_yarn=yarn, **common,
                )
            )  # fmt: skip
            continue
        kv_src = max(s for s in a.kv_source_layer_ids if s <= l)
        idx_src = max(s for s in a.index_source_layer_ids if s <= l)
        is_kv = l == kv_src
        is_idx = l == idx_src
        mode: LayerMode = "full" if is_kv else ("reindex" if is_idx else "reuse")
        cand = a.candidate_source_layer_id
        plans.append(
            LayerPlan(
                kind="csa2", mode=mode, kv_source=kv_src, index_source=idx_src, has_compressor=is_kv,
                has_indexer_k=is_kv, has_indexer_q=is_idx, publishes_candidates=cand is not None and l == cand,
                consumes_candidates=cand is not None and is_idx and l > cand,
                rope_theta=a.compress_rope_theta, use_yarn=yarn, **common,
            )
        )  # fmt: skip
    return tuple(plans)
