"""`deepinfer plan`: expert-parallel sizing of a GPU cluster for a model config (docs/parallel.md, "Sizing").

Prints, from the config alone (no weights): the per-GPU weight bytes at every EP size, the smallest EP that fits a
prefill rank (prefill is compute-bound, so the smallest EP group that fits wins), and the decode layout at
EP64-EP128 (decode MoE is bandwidth-bound on expert weights, so a large EP group with many tokens per expert wins):
experts and redundant slots per rank, KV capacity per rank, and the Engram tables, which stay in host memory.
Weight bytes come from the checkpoint inventory; KV bytes per token from the production cache formats
(core.kv_cache_spec); the memory arithmetic is deepinfer_parallel.sizing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.sizing import (
    DEFAULT_EP_CANDIDATES,
    dispatch_buffer_bytes,
    estimate_gpu_memory,
    resolve_num_redundant_experts,
    smallest_ep_that_fits,
)

from deepinfer_engine.core.kv_cache_spec import compressed_owners, paged_bytes_per_token, record_bytes
from deepinfer_engine.errors import DeepInferError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.inventory import tensor_inventory

__all__ = ["ModelBytes", "PlanReport", "add_arguments", "model_bytes", "plan", "run"]

GB = 10**9
DECODE_EP_SIZES: tuple[int, ...] = (64, 96, 128)
# Rows a sliding-window ring keeps beyond the window (verify tokens of one step) and the state-slot headroom
# (late frees under asynchronous scheduling, plus a copy buffer): docs/parallel.md, "Sizing".
_RING_EXTRA_ROWS = 6
_STATE_SLOT_FACTOR = 1.2
_STATE_COPIES = 2


@dataclass(frozen=True, kw_only=True)
class ModelBytes:
    """Bytes of one model by where they live: routed experts (split over EP), replicated (on every GPU), Engram
    tables (host memory); KV bytes per token and per running request in the production cache formats."""

    routed_main: int
    routed_draft: int
    replicated: int
    engram_tables: int
    kv_bytes_per_token: float
    state_bytes_per_request: int
    num_experts: int
    top_k: int
    hidden_size: int
    decode_tokens_per_request: int


def model_bytes(args: ModelArgs) -> ModelBytes:
    specs = tensor_inventory(args)
    routed_main = sum(s.total_bytes for s in specs if s.component == "routed_experts" and s.section == "backbone")
    routed_draft = sum(s.total_bytes for s in specs if s.component == "routed_experts" and s.section == "draft")
    engram = sum(s.total_bytes for s in specs if s.component == "engram_table")
    replicated = sum(s.total_bytes for s in specs) - routed_main - routed_draft - engram
    owners = compressed_owners(args.compress_ratios, args.num_hidden_layers, args.kv_source_layer_ids or None)
    v41 = bool(args.kv_source_layer_ids)
    main_fmt, index_fmt = ("nvfp4", "mxfp4") if v41 else ("fp8_ds", "fp8_f32scale")
    per_token = paged_bytes_per_token(owners, head_dim=args.head_dim, index_head_dim=args.index_head_dim,
                                      rope_dim=args.qk_rope_head_dim, main_format=main_fmt, index_format=index_fmt)
    # Per running request: an FP8 sliding-window ring in every layer (draft layers included) and the fp32
    # compressor state (kv + score rows) of every owner that compresses (ratio > 1).
    layers = args.num_hidden_layers + args.num_draft_layers
    ring = layers * (args.sliding_window + _RING_EXTRA_ROWS) * record_bytes("mxfp8", args.head_dim)
    comp = sum((o.ratio + _RING_EXTRA_ROWS - 1) * 2 * (args.head_dim + (args.index_head_dim if o.has_index_keys else 0))
               * 4 for o in owners if o.ratio > 1)
    verify = 1 + (args.dspark_block_size or args.num_draft_layers)
    return ModelBytes(routed_main=routed_main, routed_draft=routed_draft, replicated=replicated,
                      engram_tables=engram, kv_bytes_per_token=per_token, state_bytes_per_request=ring + comp,
                      num_experts=args.n_routed_experts, top_k=args.num_experts_per_tok, hidden_size=args.hidden_size,
                      decode_tokens_per_request=verify)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One EP layout: per-GPU bytes and what is left for KV."""

    ep_size: int
    experts_per_rank: int
    redundant_experts: int
    routed_bytes: int  # routed experts of this GPU (main incl. redundant + draft)
    weight_bytes: int  # + replicated
    buffer_bytes: int  # dispatch / combine buffers
    reserved_bytes: int  # activations / headroom (prefill) or request state + activations (decode)
    kv_bytes: int  # left for paged KV
    kv_tokens: int
    fits: bool


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    gpus: int
    gpu_memory_bytes: int
    model: ModelBytes
    table: list[Layout]
    prefill: Layout | None
    prefill_replicas: int
    decode: list[Layout]
    context_len: int
    max_num_seqs: int


def _layout(mb: ModelBytes, ep: int, redundant: int, budget: int, buffers: int, reserved: int) -> Layout:
    est = estimate_gpu_memory(ep_size=ep, replicated_bytes=mb.replicated, routed_expert_bytes=mb.routed_main,
                              num_experts=mb.num_experts, num_redundant_experts=redundant,
                              draft_expert_bytes=mb.routed_draft, comm_buffer_bytes=buffers, activation_bytes=reserved)
    kv = budget - est.total_bytes
    return Layout(ep_size=ep, experts_per_rank=(mb.num_experts + redundant) // ep, redundant_experts=redundant,
                  routed_bytes=est.routed_expert_bytes + est.draft_expert_bytes, weight_bytes=est.weight_bytes,
                  buffer_bytes=buffers, reserved_bytes=reserved, kv_bytes=max(kv, 0),
                  kv_tokens=int(max(kv, 0) // mb.kv_bytes_per_token), fits=kv >= 0)


def plan(
    args: ModelArgs, *, gpus: int, gpu_memory_gb: float, prefill_free_gb: float = 25.0, prefill_tokens: int = 8192,
    max_num_seqs: int = 256, redundant_per_rank: int = 1, decode_activation_gb: float = 2.0, context_len: int = 32768,
    counted: ModelBytes | None = None,
) -> PlanReport:
    """The sizing report (pure arithmetic). prefill_free_gb: memory a prefill rank keeps free beyond weights and
    buffers (KV of the batch, activations, indexer scratch, graphs); redundant_per_rank: EPLB slots per decode rank;
    counted: `model_bytes(args)` when the caller already has it (counting a real config takes a second)."""
    if gpus < 1 or gpu_memory_gb <= 0:
        raise ParallelConfigError(f"--gpus / --gpu-memory-gb: expected >= 1 and > 0, found {gpus} / {gpu_memory_gb}")
    mb = model_bytes(args) if counted is None else counted
    if mb.num_experts < 1:
        raise ParallelConfigError("model: has no routed experts, so there is nothing to place over an EP group")
    budget = int(gpu_memory_gb * GB)
    table = []
    for ep in DEFAULT_EP_CANDIDATES:
        if ep > max(gpus, 128) or (mb.num_experts + resolve_num_redundant_experts(
                num_experts=mb.num_experts, ep_size=ep)) // ep < 1:
            continue
        red = resolve_num_redundant_experts(num_experts=mb.num_experts, ep_size=ep)
        table.append(_layout(mb, ep, red, budget, 0, 0))
    prefill_buffers = dispatch_buffer_bytes(max_tokens_per_rank=prefill_tokens, hidden_size=mb.hidden_size,
                                            top_k=mb.top_k)
    reserve = int(prefill_free_gb * GB)
    prefill = None
    try:
        est = smallest_ep_that_fits(
            budget_bytes=budget, replicated_bytes=mb.replicated, routed_expert_bytes=mb.routed_main,
            num_experts=mb.num_experts, draft_expert_bytes=mb.routed_draft, comm_buffer_bytes=prefill_buffers,
            min_free_bytes=reserve, candidates=[c for c in DEFAULT_EP_CANDIDATES if c <= gpus],
        )
        prefill = _layout(mb, est.ep_size, est.num_redundant_experts, budget, prefill_buffers, reserve)
    except ParallelConfigError:
        prefill = None
    decode_tokens = max_num_seqs * mb.decode_tokens_per_request
    decode_buffers = dispatch_buffer_bytes(max_tokens_per_rank=decode_tokens, hidden_size=mb.hidden_size,
                                           top_k=mb.top_k)
    state_slots = int(max_num_seqs * _STATE_SLOT_FACTOR) + 1
    decode_reserved = _STATE_COPIES * state_slots * mb.state_bytes_per_request + int(decode_activation_gb * GB)
    decode = []
    for ep in DECODE_EP_SIZES:
        red = resolve_num_redundant_experts(num_experts=mb.num_experts, ep_size=ep,
                                            min_redundant=redundant_per_rank * ep)
        decode.append(_layout(mb, ep, red, budget, decode_buffers, decode_reserved))
    return PlanReport(gpus=gpus, gpu_memory_bytes=budget, model=mb, table=table, prefill=prefill,
                      prefill_replicas=gpus // prefill.ep_size if prefill else 0, decode=decode,
                      context_len=context_len, max_num_seqs=max_num_seqs)


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def format_report(r: PlanReport, prefill_free_gb: float) -> list[str]:
    mb = r.model
    g = r.gpu_memory_bytes
    lines = [
        f"model: {mb.num_experts} routed experts top-{mb.top_k}, hidden {mb.hidden_size}; routed experts "
        f"{_gb(mb.routed_main)} (main) + {_gb(mb.routed_draft)} (draft), replicated on every GPU "
        f"{_gb(mb.replicated)}",
        f"KV: {mb.kv_bytes_per_token:.0f} B per token (paged) + {mb.state_bytes_per_request / 1e6:.2f} MB per "
        f"running request (window ring + compressor state)",
        f"cluster: {r.gpus} GPUs x {_gb(g)}",
        "",
        "weights per GPU by EP size (no redundant experts, before KV / activations / buffers):",
        "    EP  routed experts/GPU  + replicated  fits",
    ]
    for t in r.table:
        lines.append(f"  {t.ep_size:>4}  {_gb(t.routed_bytes):>18}  {_gb(t.weight_bytes):>12}  "
                     f"{'yes' if t.fits else 'no'}")
    lines.append("")
    if r.prefill is None:
        lines.append(f"prefill: no EP size <= {r.gpus} fits {_gb(g)} per GPU with {prefill_free_gb:g} GB kept free")
    else:
        p = r.prefill
        lines.append(
            f"prefill: EP{p.ep_size} (smallest EP that fits with {prefill_free_gb:g} GB kept free): "
            f"{p.experts_per_rank} experts per rank ({p.redundant_experts} redundant), weights {_gb(p.weight_bytes)} + "
            f"dispatch buffers {_gb(p.buffer_bytes)}; {r.prefill_replicas} prefill replica(s) of EP{p.ep_size} "
            f"on {r.gpus} GPUs"
        )
    lines += [
        f"decode (max {r.max_num_seqs} requests x {mb.decode_tokens_per_request} verify tokens per rank):",
        "    EP  experts/rank  redundant  weights/GPU  buffers  state+act  KV per rank  KV tokens/rank  "
        f"requests at {r.context_len // 1024}K  GPUs",
    ]
    for d in r.decode:
        reqs = d.kv_tokens // r.context_len
        lines.append(
            f"  {d.ep_size:>4}  {d.experts_per_rank:>12}  {d.redundant_experts:>9}  {_gb(d.weight_bytes):>11}  "
            f"{_gb(d.buffer_bytes):>7}  {_gb(d.reserved_bytes):>9}  {_gb(d.kv_bytes):>11}  {d.kv_tokens:>14,}  "
            f"{reqs:>15,}  {'ok' if d.ep_size <= r.gpus else f'needs {d.ep_size}'}"
        )
    lines.append(
        f"Engram tables: {_gb(mb.engram_tables)} in host memory (not counted per GPU)"
        if mb.engram_tables else "Engram tables: none in this model"
    )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, required=True, help="GPUs available")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory per GPU in GB (1e9 bytes)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="checkpoint directory (its config.json is read, no weights)")
    src.add_argument("--config", type=Path, help="a bare config.json (default: the DeepSeek-V4.1-Flash release config)")
    parser.add_argument("--prefill-free-gb", type=float, default=25.0,
                        help="memory a prefill rank keeps free for KV, activations, indexer scratch (default 25)")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per prefill step per rank (buffers)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running requests per decode rank")
    parser.add_argument("--redundant-per-rank", type=int, default=1, help="EPLB redundant experts per decode rank")
    parser.add_argument("--context-len", type=int, default=32768, help="context length for the requests column")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(ns: argparse.Namespace) -> int:
    try:
        if ns.model is not None:
            args = ModelArgs.from_checkpoint_dir(ns.model)
        elif ns.config is not None:
            args = ModelArgs.from_file(ns.config)
        else:
            from deepinfer_engine.model.presets import v41_flash_config

            args = ModelArgs.from_config_dict(v41_flash_config())
        report = plan(args, gpus=ns.gpus, gpu_memory_gb=ns.gpu_memory_gb, prefill_free_gb=ns.prefill_free_gb,
                      prefill_tokens=ns.prefill_tokens, max_num_seqs=ns.max_num_seqs,
                      redundant_per_rank=ns.redundant_per_rank, context_len=ns.context_len)
    except (DeepInferError, ParallelConfigError) as exc:
        print(f"deepinfer plan: error: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(asdict(report), indent=1))
    else:
        print("\n".join(format_report(report, ns.prefill_free_gb)))
    return 0
