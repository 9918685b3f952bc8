"""Bytes of every cache family of `ModelCache` (contracts §3) for the torch-free cache manager.

Computed from the per-layer cache specs (`core.kv_cache_spec.layer_cache_spec`), the same ones
`ModelCache.allocate` builds from (tests check both agree): slot families `swa_ring`, `compressor_state` (bytes per
running sequence) and paged families
`compressed_kv`, `indexer_keys` (bytes per token, already divided by each layer's ratio).
"""

from __future__ import annotations

import torch

from deepinfer_engine.core.kv_cache_spec import CacheFamily, layer_cache_specs, record_bytes
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.cache import DEFAULT_SLACK, KV_CACHE_DTYPES

# record formats of kv_cache_dtype="auto" per family, by core.kv_cache_spec.record_bytes name
_AUTO_RECORDS = {"window": "mxfp8", "entries": "nvfp4", "index_keys": "mxfp4"}

__all__ = ["cache_families"]


def cache_families(
    args: object, page_size: int, dtype: torch.dtype, *, slack: int = DEFAULT_SLACK, kv_cache_dtype: str = "bfloat16"
) -> list[CacheFamily]:
    """CacheFamily list of the device memory of `ModelCache.allocate(args, page_size=page_size, dtype=dtype,
    slack=slack, kv_cache_dtype=...)`, from the same per-layer specs (the Engram token ring lives on the host: not
    counted). With "auto" the window, entry and index-key rows are sized from their record formats."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype: found {kv_cache_dtype!r}, expected one of {', '.join(KV_CACHE_DTYPES)}")
    el = torch.empty((), dtype=dtype).element_size()

    def row(family: str, width: int) -> int:
        if kv_cache_dtype == "auto":
            return record_bytes(_AUTO_RECORDS[family], width)
        return width * el

    specs = layer_cache_specs(args)
    ring = args.sliding_window + slack
    fams = [
        CacheFamily(
            name="swa_ring", kind="slot", num_layers=len(specs),
            bytes_per_slot=sum(ring * row("window", s.head_dim) for s in specs),
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
    for name, layers, family, width in (
        ("compressed_kv", owners, "entries", "kv_width"), ("indexer_keys", keyed, "index_keys", "index_width"),
    ):  # fmt: skip
        if layers:
            fams.append(
                CacheFamily(
                    name=name, kind="paged", num_layers=len(layers),
                    bytes_per_token=sum(row(family, getattr(s, width)) / s.ratio for s in layers),
                )
            )  # fmt: skip
    return fams
