"""What a decode step must move, and the two ceilings measured on the device it runs on.

`decode_step_bytes` counts the fewest bytes one decode step of B sequences (one new token each, `context_len`
tokens already cached) must read from device memory, in the checkpoint's formats (FP8 / FP4 weights with their
scales, bf16 or deployed KV records): every backbone weight once, except the embedding (B rows), the routed
experts (only the experts the batch touches, expected under uniform routing) and the Engram tables (the looked-up
rows); per sequence and layer the sliding window, the compressed entries attended to and the index keys scored.
Draft layers are not part of a plain decode step. Pure Python over the tensor inventory (no torch): the same
arithmetic serves `deepinfer bench latency` and `deepinfer inspect --config`.

`measure_copy_bandwidth` / `measure_matmul_rate` time a large device-to-device copy (bytes read + written) and a
large bf16 matrix product with device events, so a benchmark can state its times against ceilings of the same run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal

from deepinfer_kernels.device_rates import measure_copy_bandwidth, measure_matmul_rate

from deepinfer_engine.core.kv_cache_spec import RecordFormat, record_bytes
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.inventory import tensor_inventory

__all__ = ["StepBytes", "decode_step_bytes", "measure_copy_bandwidth", "measure_matmul_rate"]

KvFormat = Literal["bfloat16", "auto"]

# Deployed record formats (docs/caches.md §7): sliding window MXFP8; compressed main KV NVFP4 (V4.1) or the V4
# FP8 layout; index keys MXFP4.
_DEPLOYED_MAIN: dict[str, RecordFormat] = {"v41": "nvfp4", "v4": "fp8_ds"}


@dataclass(frozen=True, kw_only=True)
class StepBytes:
    """Bytes one decode step reads, by kind; `total` is their sum."""

    dense_weights: int
    routed_experts: int
    embed_rows: int
    engram_rows: int
    kv_window: int
    kv_compressed: int
    index_keys: int

    @property
    def weights(self) -> int:
        return self.dense_weights + self.routed_experts + self.embed_rows + self.engram_rows

    @property
    def kv(self) -> int:
        return self.kv_window + self.kv_compressed + self.index_keys

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "weights": self.weights, "kv": self.kv, "total": self.total}


def _touched_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by `tokens` tokens of top-k routing, uniform over the experts."""
    if n_experts <= 0 or tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_bytes(args: ModelArgs, batch: int, context_len: int, kv_format: KvFormat = "bfloat16") -> StepBytes:
    """Fewest bytes a decode step of `batch` sequences at `context_len` cached tokens must read (see module doc)."""
    if batch < 1 or context_len < 0:
        raise ValueError(f"decode_step_bytes: found batch={batch}, context_len={context_len}; expected >= 1, >= 0")
    dense = experts = embed = engram = 0
    per_layer_expert: dict[int, int] = defaultdict(int)
    for spec in tensor_inventory(args):
        if spec.section == "draft":
            continue
        if spec.name == "embed.weight":
            embed += batch * spec.shape[1] * (spec.nbytes // spec.numel)
        elif spec.component == "routed_experts":
            per_layer_expert[spec.layer_id] += spec.total_bytes
        elif spec.name.endswith("engram.embed.weight"):
            row = spec.total_bytes / spec.shape[0]
            lookups = args.engram_n_heads * (args.engram_max_ngram_size - 1)
            engram += int(batch * lookups * row)
        else:
            dense += spec.total_bytes
    for plan in args.layer_plans:
        if plan.is_draft or plan.layer_id not in per_layer_expert:
            continue
        e = plan.n_routed_experts
        experts += int(per_layer_expert[plan.layer_id] / e * _touched_experts(e, plan.num_experts_per_tok, batch))

    c = context_len + 1  # the new token is attended to as well
    deployed = kv_format == "auto"
    rope = args.qk_rope_head_dim
    swa_row = record_bytes("mxfp8" if deployed else "bf16", args.head_dim)
    main_entry = record_bytes(_DEPLOYED_MAIN[args.arch] if deployed else "bf16", args.head_dim, rope_dim=rope)
    index_entry = record_bytes("mxfp4" if deployed else "bf16", args.index_head_dim)
    window = compressed = index = 0.0
    for plan in args.layer_plans:
        if plan.is_draft:
            continue
        window += min(c, args.sliding_window) * swa_row
        if plan.ratio <= 0:
            continue
        visible = c // plan.ratio
        if plan.kind == "hca":
            compressed += visible * main_entry
        else:
            compressed += min(args.index_topk, visible) * main_entry
        if plan.has_indexer_q or plan.kind == "csa":
            index += visible * index_entry
    return StepBytes(dense_weights=dense, routed_experts=experts, embed_rows=embed, engram_rows=engram,
                     kv_window=int(batch * window), kv_compressed=int(batch * compressed),
                     index_keys=int(batch * index))
