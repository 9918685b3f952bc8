"""Bytes of every cache family of `ModelCache` (contracts §3) for the torch-free cache manager.

Computed from the per-layer cache specs (`core.kv_cache_spec.layer_cache_spec`), the same ones
`ModelCache.allocate` builds from (tests check both agree): slot families `swa_ring`, `compressor_state` (bytes per
running sequence) and paged families
`compressed_kv`, `indexer_keys` (bytes per token, already divided by each layer's ratio).
"""

from __future__ import annotations

import torch

from deepinfer_engine.core.kv_cache_spec import CacheFamily, layer_cache_specs
from deepinfer_engine.model.cache import DEFAULT_SLACK

__all__ = ["cache_families"]


def cache_families(
    args: object, page_size: int, dtype: torch.dtype, *, slack: int = DEFAULT_SLACK
) -> list[CacheFamily]:
    """CacheFamily list of the device memory of `ModelCache.allocate(args, page_size=page_size, dtype=dtype,
    slack=slack)`, from the same per-layer specs (the Engram token ring lives on the host: not counted)."""
    el = torch.empty((), dtype=dtype).element_size()
    specs = layer_cache_specs(args)
    ring = args.sliding_window + slack
    fams = [
        CacheFamily(
            name="swa_ring", kind="slot", num_layers=len(specs),
            bytes_per_slot=sum(ring * s.head_dim * el for s in specs),
        )
    ]  # fmt: skip
    rings = [r for s in specs for r in s.state_rings]
    if rings:
        fams.append(
            CacheFamily(
                name="compressor_state", kind="slot", num_layers=len(rings),
                bytes_per_slot=sum((r.rows + slack) * 2 * r.width * 4 for r in rings),  # fp32 (A, Z) rows
            )
        )  # fmt: skip
    owners = [s for s in specs if s.owns_entries]
    keyed = [s for s in owners if s.owns_index_keys]
    # Paged families: one row of `width` elements per `ratio` tokens in each of their layers.
    for name, layers, width in (("compressed_kv", owners, "kv_width"), ("indexer_keys", keyed, "index_width")):
        if layers:
            fams.append(
                CacheFamily(
                    name=name, kind="paged", num_layers=len(layers),
                    bytes_per_token=sum(getattr(s, width) * el / s.ratio for s in layers),
                )
            )  # fmt: skip
    return fams
