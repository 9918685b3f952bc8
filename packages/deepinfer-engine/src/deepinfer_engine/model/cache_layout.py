"""Bytes of every cache family of `ModelCache` (contracts §3) for the torch-free cache manager.

Computed from the config alone, with the same per-layer rules as `ModelCache.allocate` (tests check both agree):
slot families `swa_ring`, `compressor_state`, `engram_history` (bytes per running sequence) and paged families
`compressed_kv`, `indexer_keys` (bytes per token, already divided by each layer's ratio).
"""

from __future__ import annotations

import torch

from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.model.cache import DEFAULT_SLACK, _has_index_keys, comp_state_spec

__all__ = ["cache_families"]


def cache_families(
    args: object, page_size: int, dtype: torch.dtype, *, slack: int = DEFAULT_SLACK
) -> list[CacheFamily]:
    """CacheFamily list for `ModelCache.allocate(args, page_size=page_size, dtype=dtype, slack=slack)`."""
    el = torch.empty((), dtype=dtype).element_size()
    plans = args.layer_plans
    ring = args.sliding_window + slack
    fams = [
        CacheFamily(name="swa_ring", kind="slot", num_layers=len(plans), bytes_per_slot=len(plans) * ring * args.head_dim * el)
    ]
    n_state, state_bytes = 0, 0
    for p in plans:
        for _, width, rows in comp_state_spec(args, p):
            n_state += 1
            state_bytes += (rows + slack) * 2 * width * 4  # fp32 (A, Z) rows
    if n_state:
        fams.append(CacheFamily(name="compressor_state", kind="slot", num_layers=n_state, bytes_per_slot=state_bytes))
    if getattr(args, "engram_layer_ids", None):
        fams.append(
            CacheFamily(
                name="engram_history", kind="slot", num_layers=1,
                bytes_per_slot=(args.engram_max_ngram_size - 1 + slack) * 8,
            )
        )  # fmt: skip
    srcs = [p for p in plans if p.has_compressor]
    idx = [p for p in srcs if _has_index_keys(args, p)]
    # Paged families: one row of `width` elements per `ratio` tokens in each of their layers.
    for name, layers, width in (("compressed_kv", srcs, args.head_dim), ("indexer_keys", idx, args.index_head_dim)):
        if layers:
            fams.append(
                CacheFamily(
                    name=name, kind="paged", num_layers=len(layers),
                    bytes_per_token=sum(width * el / p.ratio for p in layers),
                )
            )  # fmt: skip
    return fams
