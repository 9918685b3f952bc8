"""What one cache family costs; shared by the model (which derives it) and the torch-free cache manager.

Also the per-token record-size rules of the compressed (paged) caches, so that the bytes per token of a real
config can be checked against the design figures (docs/runtime.md §6.2, docs/caches.md §7) without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class CacheFamily:
    """One kind of cached state.

    `kind == "paged"`: grows with the sequence; `bytes_per_token` is summed over all layers that own it and
    already divided by the compression ratio. `kind == "slot"`: fixed size per running sequence
    (`bytes_per_slot`, summed over layers).
    """

    name: str
    kind: Literal["paged", "slot"]
    num_layers: int
    bytes_per_token: float = 0.0
    bytes_per_slot: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("paged", "slot"):
            raise ValueError(f"CacheFamily {self.name!r}: kind must be 'paged' or 'slot', got {self.kind!r}")
        if self.bytes_per_token < 0 or self.bytes_per_slot < 0:
            raise ValueError(f"CacheFamily {self.name!r}: sizes must be >= 0")


RecordFormat = Literal["bf16", "fp32", "fp8_ds", "mxfp8", "nvfp4", "mxfp4", "fp8_f32scale"]


def record_bytes(fmt: RecordFormat, dim: int, *, rope_dim: int = 0) -> int:
    """Bytes of one cached vector of `dim` values in a storage format.

    bf16/fp32: plain. mxfp8: e4m3 values + one UE8M0 scale per 32 (512 -> 528). nvfp4: e2m1 nibbles + one e4m3
    scale per 16 (512 -> 288). mxfp4: nibbles + one UE8M0 per 32 (128 -> 68). fp8_f32scale: e4m3 + one fp32
    scale (128 -> 132). fp8_ds (V4 production main KV, vLLM layout): fp8 nope part + one UE8M0 scale per 64
    nope dims padded to 8 bytes + bf16 rope part (512 with rope 64 -> 448 + 8 + 128 = 584).
    Record sizes are quoted from the design docs ([V] there, vLLM layouts), not measured here.
    """
    if fmt == "bf16":
        return 2 * dim
    if fmt == "fp32":
        return 4 * dim
    if fmt == "mxfp8":
        return dim + math.ceil(dim / 32)
    if fmt == "nvfp4":
        return math.ceil(dim / 2) + math.ceil(dim / 16)
    if fmt == "mxfp4":
        return math.ceil(dim / 2) + math.ceil(dim / 32)
    if fmt == "fp8_f32scale":
        return dim + 4
    if fmt == "fp8_ds":
        nope = dim - rope_dim
        return nope + 8 * math.ceil(math.ceil(nope / 64) / 8) + 2 * rope_dim
    raise ValueError(f"record format: unknown {fmt!r}, expected one of bf16, fp32, fp8_ds, mxfp8, nvfp4, mxfp4, "
                     "fp8_f32scale")


@dataclass(frozen=True, kw_only=True)
class StateRing:
    """A per-slot ring of raw compressor rows (A, Z) of one layer: `rows` positions of `width` fp32 pairs."""

    name: str  # "main" | "indexer"
    width: int
    rows: int  # positions before the current one that pooling may read (the ring adds the cache slack)


@dataclass(frozen=True, kw_only=True)
class LayerCacheSpec:
    """Which cached state one layer owns (THE derivation; the model cache, the byte accounting and the
    compressed-owner list are all built from it).

    Every layer owns a window K=V ring (`head_dim` wide). A compressor owner (`ratio > 0`) also owns paged
    compressed entries (`kv_width` wide, one per `ratio` tokens), optionally paged index keys (`index_width`,
    0 = none), and the raw compressor state rings its pooling needs across chunk boundaries.
    """

    layer_id: int
    head_dim: int
    ratio: int = 0  # 0: no paged entries
    kv_width: int = 0
    index_width: int = 0
    state_rings: tuple[StateRing, ...] = ()

    @property
    def owns_entries(self) -> bool:
        return self.ratio > 0

    @property
    def owns_index_keys(self) -> bool:
        return self.ratio > 0 and self.index_width > 0


def layer_cache_spec(args: object, plan: object) -> LayerCacheSpec:
    """The cache spec of one layer from its LayerPlan (duck-typed: core imports no model code).

    Compressed entries: layers with `has_compressor`. Index keys: compressor owners that produce indexer keys
    (V4 CSA: its indexer compressor; V4.1: kv sources). State rings: ratio >= 2 compressors keep the raw
    (A, Z) rows of the open window (`ratio` positions); the V4 overlapping CSA compressor (ratio 4) also the
    previous window (2 * ratio rows of twice the width), and so does its indexer compressor. V4.1 ratio-1
    sources pool nothing across positions.
    """
    lid, ratio = int(plan.layer_id), int(plan.ratio)
    hd = int(args.head_dim)
    if not plan.has_compressor or ratio <= 0:
        return LayerCacheSpec(layer_id=lid, head_dim=hd)
    index_width = int(args.index_head_dim) if plan.has_indexer_k else 0
    rings: list[StateRing] = []
    if ratio > 1:
        mult = 2 if (args.arch == "v4" and ratio == 4) else 1
        rings.append(StateRing(name="main", width=mult * hd, rows=mult * ratio))
        if args.arch == "v4" and plan.has_indexer_k:
            rings.append(StateRing(name="indexer", width=mult * int(args.index_head_dim), rows=mult * ratio))
    return LayerCacheSpec(
        layer_id=lid, head_dim=hd, ratio=ratio, kv_width=hd, index_width=index_width, state_rings=tuple(rings)
    )


def layer_cache_specs(args: object) -> list[LayerCacheSpec]:
    """Specs of every layer of `args.layer_plans` (backbone and draft layers), in layer order."""
    return [layer_cache_spec(args, p) for p in args.layer_plans]


@dataclass(frozen=True, kw_only=True)
class CompressedOwner:
    """A layer that owns compressed (paged) KV: one main entry (and optionally one index key) per `ratio` tokens."""

    layer_id: int
    ratio: int
    has_index_keys: bool


def compressed_owners(
    compress_ratios: Sequence[int],
    num_hidden_layers: int,
    kv_source_layer_ids: Sequence[int] | None = None,
) -> list[CompressedOwner]:
    """Layers owning paged compressed KV, from the config fields.

    V4.1 (`kv_source_layer_ids` given): only the kv sources own main KV and index keys (CSA2 reuse).
    V4 (no sources): every backbone layer with ratio > 0 owns main KV; ratio-4 (CSA) layers also own index
    keys, other ratios (HCA) do not. Entries past `num_hidden_layers` (MTP / DSpark, ratio 0) own nothing.
    """
    if kv_source_layer_ids:
        return [
            CompressedOwner(layer_id=l, ratio=int(compress_ratios[l]), has_index_keys=True)
            for l in kv_source_layer_ids
        ]
    return [
        CompressedOwner(layer_id=l, ratio=int(r), has_index_keys=int(r) == 4)
        for l, r in enumerate(compress_ratios[:num_hidden_layers])
        if int(r) > 0
    ]


def owners_from_specs(specs: Sequence[LayerCacheSpec]) -> list[CompressedOwner]:
    """The compressed owners of a model whose layer specs are known (the same list `compressed_owners` derives
    from bare config fields; tests hold the two equal on every preset)."""
    return [
        CompressedOwner(layer_id=s.layer_id, ratio=s.ratio, has_index_keys=s.owns_index_keys)
        for s in specs
        if s.owns_entries
    ]


def paged_bytes_per_token(
    owners: Sequence[CompressedOwner],
    *,
    head_dim: int,
    index_head_dim: int,
    rope_dim: int = 64,
    main_format: RecordFormat = "bf16",
    index_format: RecordFormat = "bf16",
) -> float:
    """Bytes of paged compressed state one token adds, summed over owners: sum (main [+ index]) / ratio."""
    main = record_bytes(main_format, head_dim, rope_dim=rope_dim)
    index = record_bytes(index_format, index_head_dim, rope_dim=rope_dim)
    return sum((main + (index if o.has_index_keys else 0)) / o.ratio for o in owners)
