"""The tensor inventory of an official checkpoint (docs/checkpoint.md §6): every tensor name, shape, stored dtype.

One table serves the writer (what to create), the reader (what to check) and `deepinfer inspect` (parameter
and byte counts, §8). Pure Python (no torch). Shapes are logical `[out, in]`; FP4 experts are stored packed
`[out, in/2]` (`stored_shape`). Vision-tower tensors (V4.1) are not listed: their names are [I] (§6.5).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from deepinfer_engine.model.args import LayerPlan, ModelArgs

__all__ = [
    "DTYPE_BYTES",
    "SAFETENSORS_DTYPE",
    "InventorySummary",
    "ScaleSpec",
    "TensorSpec",
    "optional_tensor_names",
    "summarize",
    "tensor_inventory",
]

StoredDtype = Literal["bf16", "f32", "i64", "f8_e4m3", "fp4_e2m1x2", "f8_e8m0"]
Section = Literal["backbone", "engram", "draft"]

# bytes per STORED element (fp4_e2m1x2: one int8 byte holds two logical values)
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "f32": 4, "i64": 8, "f8_e4m3": 1, "fp4_e2m1x2": 1, "f8_e8m0": 1}
# dtype strings in safetensors headers
SAFETENSORS_DTYPE: dict[str, str] = {
    "bf16": "BF16",
    "f32": "F32",
    "i64": "I64",
    "f8_e4m3": "F8_E4M3",
    "fp4_e2m1x2": "I8",
    "f8_e8m0": "F8_E8M0",
}


@dataclass(frozen=True, kw_only=True)
class ScaleSpec:
    """The `.scale` companion of a quantized weight: `W[i, j] = q[i, j] * scale[i // b0, j // b1]`."""

    name: str
    shape: tuple[int, ...]
    dtype: Literal["f8_e8m0", "f32"]
    block: tuple[int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One checkpoint tensor. `shape` is logical; `component` / `section` group the counts of `inspect`."""

    name: str
    shape: tuple[int, ...]
    dtype: StoredDtype
    scale: ScaleSpec | None = None
    component: str
    section: Section
    layer_id: int | None = None
    # True: the release may carry it or not, and the model never reads it (the loader accepts and drops it).
    optional: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.dtype == "fp4_e2m1x2":
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape

    @property
    def numel(self) -> int:
        """Logical parameters (FP4: two per stored byte)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Stored bytes of the weight itself (without the scale)."""
        return math.prod(self.stored_shape) * DTYPE_BYTES[self.dtype]

    @property
    def total_bytes(self) -> int:
        return self.nbytes + (self.scale.nbytes if self.scale is not None else 0)


# --------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self, args: ModelArgs) -> None:
        self.a = args
        self.out: list[TensorSpec] = []
        self.scale_dtype: Literal["f8_e8m0", "f32"] = "f8_e8m0" if args.scale_fmt == "ue8m0" else "f32"

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: StoredDtype,
        component: str,
        section: Section,
        layer_id: int | None = None,
        *,
        optional: bool = False,
    ) -> None:
        self.out.append(
            TensorSpec(
                name=name, shape=shape, dtype=dtype, component=component, section=section, layer_id=layer_id,
                optional=optional,
            )
        )  # fmt: skip

    def fp8(
        self,
        name: str,
        shape: tuple[int, int],
        component: str,
        section: Section,
        layer_id: int | None = None,
        block: tuple[int, int] | None = None,
        scale_dtype: Literal["f8_e8m0", "f32"] | None = None,
    ) -> None:
        """`name` ends with `.weight`; its scale is `<base>.scale` (official naming)."""
        b0, b1 = block or self.a.weight_block_size
        base = name.removesuffix(".weight")
        scale = ScaleSpec(
            name=f"{base}.scale",
            shape=(_cdiv(shape[0], b0), _cdiv(shape[1], b1)),
            dtype=scale_dtype or self.scale_dtype,
            block=(b0, b1),
        )
        self.out.append(
            TensorSpec(
                name=name,
                shape=shape,
                dtype="f8_e4m3",
                scale=scale,
                component=component,
                section=section,
                layer_id=layer_id,
            )
        )

    def expert(self, name: str, shape: tuple[int, int], section: Section, layer_id: int) -> None:
        if self.a.expert_dtype == "fp4":
            base = name.removesuffix(".weight")
            scale = ScaleSpec(
                name=f"{base}.scale", shape=(shape[0], _cdiv(shape[1], 32)), dtype="f8_e8m0", block=(1, 32)
            )
            self.out.append(
                TensorSpec(
                    name=name,
                    shape=shape,
                    dtype="fp4_e2m1x2",
                    scale=scale,
                    component="routed_experts",
                    section=section,
                    layer_id=layer_id,
                )
            )
        else:  # V4-Flash-Base: FP8 block experts (float32 scales when scale_fmt is absent)
            self.fp8(name, shape, "routed_experts", section, layer_id)


def _block(b: _Builder, p: LayerPlan, section: Section) -> None:
    """Tensors of one transformer block (backbone layer or MTP/DSpark stage) under `p.prefix`."""
    a = b.a
    d, pre, l = a.hidden_size, p.prefix, p.layer_id
    H, Dh, Rq = a.num_attention_heads, a.head_dim, a.q_lora_rank
    G, Ro = a.o_groups, a.o_lora_rank
    n = a.hc_mult
    b.add(f"{pre}attn_norm.weight", (d,), "bf16", "norms", section, l)
    b.add(f"{pre}ffn_norm.weight", (d,), "bf16", "norms", section, l)
    for sub in ("attn", "ffn"):
        b.add(f"{pre}hc_{sub}_fn", (a.hc_dim, n * d), "f32", "mhc", section, l)
        b.add(f"{pre}hc_{sub}_base", (a.hc_dim,), "f32", "mhc", section, l)
        b.add(f"{pre}hc_{sub}_scale", (3,), "f32", "mhc", section, l)
    # attention core
    at = f"{pre}attn."
    b.add(f"{at}attn_sink", (H,), "f32", "norms", section, l)
    b.add(f"{at}q_norm.weight", (Rq,), "bf16", "norms", section, l)
    b.add(f"{at}kv_norm.weight", (Dh,), "bf16", "norms", section, l)
    b.fp8(f"{at}wq_a.weight", (Rq, d), "attention", section, l)
    b.fp8(f"{at}wq_b.weight", (H * Dh, Rq), "attention", section, l)
    b.fp8(f"{at}wkv.weight", (Dh, d), "attention", section, l)
    b.fp8(f"{at}wo_a.weight", (G * Ro, H * Dh // G), "attention", section, l)
    b.fp8(f"{at}wo_b.weight", (d, G * Ro), "attention", section, l)
    ni, di = a.index_n_heads, a.index_head_dim
    if a.arch == "v4":
        if p.has_compressor:
            overlap = p.kind == "csa"  # CSA compressors pool two overlapping windows: 2x wide projections
            w = (2 if overlap else 1) * Dh
            b.add(f"{at}compressor.wkv.weight", (w, d), "bf16", "compressor", section, l)
            b.add(f"{at}compressor.wgate.weight", (w, d), "bf16", "compressor", section, l)
            b.add(f"{at}compressor.ape", (p.ratio, w), "f32", "compressor", section, l)
            b.add(f"{at}compressor.norm.weight", (Dh,), "bf16", "compressor", section, l)
        if p.has_indexer_q:
            b.fp8(f"{at}indexer.wq_b.weight", (ni * di, Rq), "indexer", section, l)
            b.add(f"{at}indexer.weights_proj.weight", (ni, d), "bf16", "indexer", section, l)
        if p.has_indexer_k:
            ic = f"{at}indexer.compressor."
            b.add(f"{ic}wkv.weight", (2 * di, d), "bf16", "indexer", section, l)
            b.add(f"{ic}wgate.weight", (2 * di, d), "bf16", "indexer", section, l)
            b.add(f"{ic}ape", (p.ratio, 2 * di), "f32", "indexer", section, l)
            b.add(f"{ic}norm.weight", (di,), "bf16", "indexer", section, l)
    else:
        if p.has_compressor:
            b.add(f"{at}compressor.wkv.weight", (Dh, d), "bf16", "compressor", section, l)
            if p.ratio >= 2:  # ratio 1 keeps every token: no gate to pool with
                b.add(f"{at}compressor.wgate.weight", (Dh, d), "bf16", "compressor", section, l)
            b.add(f"{at}compressor.norm.weight", (Dh,), "bf16", "compressor", section, l)
        if p.has_indexer_k:
            b.add(f"{at}indexer.wk.weight", (di, Dh), "bf16", "indexer", section, l)
            b.add(f"{at}indexer.k_norm.weight", (di,), "bf16", "indexer", section, l)
        if p.has_indexer_q:
            b.fp8(f"{at}indexer.wq_b.weight", (ni * di, Rq), "indexer", section, l)
            b.add(f"{at}indexer.weights_proj.weight", (ni, d), "bf16", "indexer", section, l)
    # MoE
    ff = f"{pre}ffn."
    E, I, k = p.n_routed_experts, a.moe_intermediate_size, p.num_experts_per_tok
    b.add(f"{ff}gate.weight", (E, d), "bf16", "gate", section, l)
    if p.is_hash_layer:
        b.add(f"{ff}gate.tid2eid", (a.vocab_size, k), "i64", "gate", section, l)
    else:
        b.add(f"{ff}gate.bias", (E,), "f32", "gate", section, l)
        if a.has_gate_bias_vl:
            # DeepSeek's code declares bias_vl on every gate, the DSpark stages' too, so a release carries
            # mtp.{k}.ffn.gate.bias_vl; drafts never apply it: optional there (docs/fidelity.md §1)
            b.add(f"{ff}gate.bias_vl", (E,), "f32", "gate", section, l, optional=p.is_draft)
    for e in range(E):
        ex = f"{ff}experts.{e}."
        b.expert(f"{ex}w1.weight", (I, d), section, l)
        b.expert(f"{ex}w2.weight", (d, I), section, l)
        b.expert(f"{ex}w3.weight", (I, d), section, l)
    Is = I * a.n_shared_experts
    if a.n_shared_experts:
        sh = f"{ff}shared_experts."
        b.fp8(f"{sh}w1.weight", (Is, d), "shared_experts", section, l)
        b.fp8(f"{sh}w2.weight", (d, Is), "shared_experts", section, l)
        b.fp8(f"{sh}w3.weight", (Is, d), "shared_experts", section, l)


def _engram(b: _Builder, p: LayerPlan) -> None:
    a = b.a
    d, l, pre = a.hidden_size, p.layer_id, f"{p.prefix}engram."
    rows = a.engram_num_embeddings[a.engram_layer_ids.index(l)]
    # Tables: FP8 e4m3 rows with 1x32 E8M0 block scales (§6.2), whatever the dense block size is.
    b.fp8(
        f"{pre}embed.weight",
        (rows, a.engram_head_dim),
        "engram_table",
        "engram",
        l,
        block=(1, 32),
        scale_dtype="f8_e8m0",
    )
    b.fp8(
        f"{pre}wkv.weight",
        ((a.hc_mult + 1) * d, a.engram_num_ngram_heads * a.engram_head_dim),
        "engram",
        "engram",
        l,
    )
    # q_weight / k_weight dtype bf16 is [S] (docs/model.md §C.6, open question 9).
    b.add(f"{pre}q_weight", (a.hc_mult, d), "bf16", "engram", "engram", l)
    b.add(f"{pre}k_weight", (a.hc_mult, d), "bf16", "engram", "engram", l)


def optional_tensor_names(args: ModelArgs) -> frozenset[str]:
    """Names a release may or may not carry and the model never reads (``TensorSpec.optional``)."""
    return frozenset(s.name for s in tensor_inventory(args) if s.optional)


def tensor_inventory(args: ModelArgs) -> list[TensorSpec]:
    """Every tensor of the official release format for `args`, in a stable order (globals, layers, drafts).

    The writer writes every entry, optional ones included (a V4.1 release carries them)."""
    a = args
    b = _Builder(a)
    d, V, n = a.hidden_size, a.vocab_size, a.hc_mult
    b.add("embed.weight", (V, d), "bf16", "embed_head", "backbone")
    for p in a.layer_plans[: a.num_hidden_layers]:
        if p.has_engram:
            _engram(b, p)
        _block(b, p, "backbone")
    b.add("norm.weight", (d,), "bf16", "embed_head", "backbone")
    if a.has_hc_head:
        b.add("hc_head_fn", (n, n * d), "f32", "embed_head", "backbone")
        b.add("hc_head_base", (n,), "f32", "embed_head", "backbone")
        b.add("hc_head_scale", (1,), "f32", "embed_head", "backbone")
    b.add("head.weight", (V, d), "bf16", "embed_head", "backbone")

    drafts = a.layer_plans[a.num_hidden_layers :]
    for k, p in enumerate(drafts):
        pre, l = p.prefix, p.layer_id
        if a.has_dspark:
            if k == 0:  # fuses the hc-stream means of the target layers (docs/model.md §B.2); dtype FP8 [I]
                b.fp8(
                    f"{pre}main_proj.weight",
                    (d, d * len(a.dspark_target_layer_ids)),
                    "dspark_heads",
                    "draft",
                    l,
                )
                b.add(f"{pre}main_norm.weight", (d,), "bf16", "dspark_heads", "draft", l)
        else:  # V4-Flash MTP block (docs/model.md §A.9)
            b.fp8(f"{pre}e_proj.weight", (d, d), "mtp_heads", "draft", l)
            b.fp8(f"{pre}h_proj.weight", (d, d), "mtp_heads", "draft", l)
            b.add(f"{pre}enorm.weight", (d,), "bf16", "mtp_heads", "draft", l)
            b.add(f"{pre}hnorm.weight", (d,), "bf16", "mtp_heads", "draft", l)
        _block(b, p, "draft")
        last = k == len(drafts) - 1
        if not a.has_dspark or last:
            b.add(
                f"{pre}norm.weight", (d,), "bf16", "dspark_heads" if a.has_dspark else "mtp_heads", "draft", l
            )
            if a.has_hc_head:
                comp = "dspark_heads" if a.has_dspark else "mtp_heads"
                b.add(f"{pre}hc_head_fn", (n, n * d), "f32", comp, "draft", l)
                b.add(f"{pre}hc_head_base", (n,), "f32", comp, "draft", l)
                b.add(f"{pre}hc_head_scale", (1,), "f32", comp, "draft", l)
        if a.has_dspark and last:
            r = a.dspark_markov_rank or 0
            # V4-0731 names markov_w1/markov_w2, V4.1 embed/head (docs/model.md §B.2, docs/model.md §C.7); bf16 assumed [I].
            w1, w2 = ("markov_w1", "markov_w2") if a.arch == "v4" else ("embed", "head")
            b.add(f"{pre}markov_head.{w1}.weight", (V, r), "bf16", "dspark_heads", "draft", l)
            b.add(f"{pre}markov_head.{w2}.weight", (V, r), "bf16", "dspark_heads", "draft", l)
            b.add(f"{pre}confidence_head.proj.weight", (1, d + r), "f32", "dspark_heads", "draft", l)
    return b.out


# --------------------------------------------------------------------------------------------------
# counts


@dataclass(frozen=True, kw_only=True)
class InventorySummary:
    """Parameter / byte / tensor counts of an inventory (scales count as tensors and bytes, not parameters)."""

    params_by_section: tuple[tuple[str, int], ...]
    params_by_component: tuple[tuple[str, str, int], ...]  # (section, component, params)
    bytes_by_section: tuple[tuple[str, int], ...]
    num_tensors: int  # weights + scales = entries of the index weight_map
    total_bytes: int  # = index metadata.total_size
    total_params: int

    def params(self, section: str) -> int:
        return dict(self.params_by_section).get(section, 0)

    def bytes(self, section: str) -> int:
        return dict(self.bytes_by_section).get(section, 0)


def summarize(specs: Iterable[TensorSpec]) -> InventorySummary:
    by_sec: dict[str, int] = {}
    by_comp: dict[tuple[str, str], int] = {}
    bytes_sec: dict[str, int] = {}
    count = 0
    for s in specs:
        by_sec[s.section] = by_sec.get(s.section, 0) + s.numel
        key = (s.section, s.component)
        by_comp[key] = by_comp.get(key, 0) + s.numel
        bytes_sec[s.section] = bytes_sec.get(s.section, 0) + s.total_bytes
        count += 1 + (s.scale is not None)
    return InventorySummary(
        params_by_section=tuple(by_sec.items()),
        params_by_component=tuple((sec, comp, v) for (sec, comp), v in by_comp.items()),
        bytes_by_section=tuple(bytes_sec.items()),
        num_tensors=count,
        total_bytes=sum(bytes_sec.values()),
        total_params=sum(by_sec.values()),
    )
