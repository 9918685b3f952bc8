"""`deepinfer inspect`: architecture, per-layer plan, parameter and byte counts; checks a checkpoint.

`deepinfer inspect DIR` reads DIR/config.json and checks the shards against the inventory;
`deepinfer inspect --config FILE` does the same from a bare config.json (no weights);
without either it inspects the embedded default checkpoint. `--forward` runs the model on a short prompt.
`deepinfer inspect DIR --verify [--json]` reads every tensor and lists what would load but compute garbage
(non-finite values, invalid scale codes) besides every structural problem; exit status 1 on findings.
`--load` loads the model (weights in their checkpoint formats) on `--device` with `--dtype` and reports the bytes
it holds against the checkpoint's; `--json` prints that report as one JSON object. `--config` reports the
resident bytes of the model a load would build (meta device: no weights needed). `--prefill-flops` (with DIR or
--config) prints the matrix-product FLOPs of one prompt's prefill with and without decoder truncation
(prefill_flops.py) at prompt lengths 1K .. 128K.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepinfer_engine.errors import DeepInferError
from deepinfer_engine.model.args import LayerPlan, ModelArgs
from deepinfer_engine.model.inventory import InventorySummary, summarize, tensor_inventory

__all__ = ["add_arguments", "format_report", "format_verify", "run", "run_verify"]

_SECTION_TITLE = {"backbone": "backbone", "engram": "Engram", "draft": "draft (MTP/DSpark)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", nargs="?", type=Path, help="checkpoint directory (default: the embedded default)"
    )
    parser.add_argument("--config", type=Path, help="inspect a bare config.json instead (no weights)")
    parser.add_argument("--no-plan", action="store_true", help="omit the per-layer table")
    parser.add_argument(
        "--forward", action="store_true", help="run the model on a short prompt, print logit stats"
    )
    parser.add_argument("--prompt", default="Hello, DeepSeek!", help="prompt for --forward")
    parser.add_argument("--device", default="cpu", help="device for --forward (default cpu)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype for --forward / --load / the --config resident bytes (default float32)",
    )
    add_verify_arguments(parser)
    parser.add_argument(
        "--load",
        action="store_true",
        help="load the model and report resident weight bytes (parameters + buffers) vs the checkpoint's",
    )
    parser.add_argument("--prefill-flops", action="store_true",
                        help="prefill FLOPs per prompt length, full vs prefill_truncation=compact (V4.1)")
    parser.add_argument("--keep", type=int, default=140,
                        help="kept rows for --prefill-flops (prefill_truncation_keep, default 140)")


def prefill_flops_lines(args: ModelArgs, keep: int) -> list[str]:
    from deepinfer_engine.prefill_flops import prefill_flops_table

    rows = prefill_flops_table(args, [1024 << i for i in range(8)], keep)
    out = [f"prefill FLOPs of one prompt (matrix products, first token only), compact keep = {keep}:",
           f"  {'prompt':>7}  {'full TFLOP':>11}  {'compact TFLOP':>13}  {'saved':>6}  {'GFLOP/token full':>16}  "
           f"{'compact':>7}"]
    for r in rows:
        P = r["prompt_len"]
        out.append(f"  {P:>7}  {r['full'] / 1e12:>11.2f}  {r['compact'] / 1e12:>13.2f}  {r['saved_frac']:>6.1%}  "
                   f"{r['full'] / P / 1e9:>16.1f}  {r['compact'] / P / 1e9:>7.1f}")
    return out


def _arch_lines(a: ModelArgs) -> list[str]:
    name = {"v4": "DeepSeek-V4-Flash family", "v41": "DeepSeek-V4.1-Flash family"}[a.arch]
    draft = (
        f"{a.num_draft_layers} DSpark stages (block {a.dspark_block_size}, targets {list(a.dspark_target_layer_ids)})"
        if a.has_dspark
        else f"{a.num_draft_layers} MTP block(s)"
    )
    if a.expert_dtype == "fp4":
        experts = "FP4 e2m1 experts with 1x32 E8M0 scales"
    else:
        experts = "FP8 experts"
    lines = [
        f"architecture: {name} (model_type {a.model_type}, arch {a.arch})",
        f"  hidden {a.hidden_size}, layers {a.num_hidden_layers} + {draft}, vocab {a.vocab_size}",
        f"  attention: {a.num_attention_heads} heads x {a.head_dim} (rope {a.qk_rope_head_dim}), 1 shared KV head, "
        f"q_lora {a.q_lora_rank}, wo {a.o_groups} groups x {a.o_lora_rank}, window {a.sliding_window}",
        f"  indexer: {a.index_n_heads} heads x {a.index_head_dim}, top-{a.index_topk}",
        f"  MoE: {a.n_routed_experts} experts top-{a.num_experts_per_tok} (I={a.moe_intermediate_size}) + "
        f"{a.n_shared_experts} shared, {a.scoring_func}, x{a.routed_scaling_factor}, hash layers {a.num_hash_layers}",
        f"  mHC: {a.hc_mult} streams, {a.hc_sinkhorn_iters} Sinkhorn iters"
        + (", delayed pre-mix, no hc_head" if a.uses_delayed_mhc else ", learned hc_head"),
        f"  RoPE: theta {a.rope_theta:g} (ratio 0) / {a.compress_rope_theta:g}"
        + (
            f" + YaRN x{a.rope_scaling.factor:g} from {a.rope_scaling.original_max_position_embeddings}"
            if a.rope_scaling
            else ""
        )
        + f"; rms_norm_eps {a.rms_norm_eps:g}",
        f"  weights: FP8 e4m3, {a.weight_block_size[0]}x{a.weight_block_size[1]} blocks, "
        f"{a.scale_fmt or 'float32'} scales; {experts}",
    ]
    if a.engram_layer_ids:
        lines.append(
            f"  Engram: layers {list(a.engram_layer_ids)}, rows {list(a.engram_num_embeddings)}, "
            f"{a.engram_num_ngram_heads} lookups x {a.engram_head_dim}, compressed vocab "
            f"{a.engram_compressed_vocab_size}"
        )
    if a.arch == "v41":
        lines.append(
            f"  CSA2: kv sources {list(a.kv_source_layer_ids)}, index sources {list(a.index_source_layer_ids)}, "
            f"candidate source {a.candidate_source_layer_id} ({a.candidate_topk_blocks} blocks x "
            f"{a.candidate_block_size})"
        )
    return lines


def _plan_lines(plans: tuple[LayerPlan, ...]) -> list[str]:
    def flag(b: bool, c: str) -> str:
        return c if b else "."

    out = [
        "layer plan:",
        "  layer  prefix     ratio kind mode    kv idx  C K Q P U H E  rope            experts",
    ]
    for p in plans:
        out.append(
            f"  {p.layer_id:>5}  {p.prefix:<10} {p.ratio:>5} {p.kind:<4} {p.mode:<7} "
            f"{'-' if p.kv_source is None else p.kv_source:>2} {'-' if p.index_source is None else p.index_source:>3}  "
            f"{flag(p.has_compressor, 'C')} {flag(p.has_indexer_k, 'K')} {flag(p.has_indexer_q, 'Q')} "
            f"{flag(p.publishes_candidates, 'P')} {flag(p.consumes_candidates, 'U')} {flag(p.is_hash_layer, 'H')} "
            f"{flag(p.has_engram, 'E')}  {p.rope_theta:>8g}{' yarn' if p.use_yarn else '     '}  "
            f"{p.n_routed_experts} top-{p.num_experts_per_tok}"
        )
    out.append(
        "  (C compressor, K indexer keys, Q indexer query/top-k, P publishes / U consumes candidate blocks, "
        "H hash-routed, E Engram)"
    )
    return out


def _count_lines(s: InventorySummary) -> list[str]:
    out = ["parameters:"]
    sections = [sec for sec, _ in s.params_by_section]
    for sec in sections:
        out.append(f"  {_SECTION_TITLE.get(sec, sec):<22} {s.params(sec):>20,}")
        for sec2, comp, v in s.params_by_component:
            if sec2 == sec:
                out.append(f"    {comp:<20} {v:>20,}")
    if "draft" in sections:
        out.append(f"  {'total without draft':<22} {s.total_params - s.params('draft'):>20,}")
    out.append(f"  {'total':<22} {s.total_params:>20,}")
    out.append("bytes (weights + scales, as stored):")
    for sec in sections:
        out.append(f"  {_SECTION_TITLE.get(sec, sec):<22} {s.bytes(sec):>20,}")
    out.append(f"  {'total_size':<22} {s.total_bytes:>20,}")
    out.append(f"tensors (weights + scales): {s.num_tensors:,}")
    return out


def format_report(args: ModelArgs, *, plan: bool = True) -> list[str]:
    lines = _arch_lines(args)
    if plan:
        lines += _plan_lines(args.layer_plans)
    lines += _count_lines(summarize(tensor_inventory(args)))
    return lines


def _forward_lines(directory: Path, prompt: str, device: str, dtype_name: str) -> list[str]:
    import torch

    try:
        from deepinfer_engine.model.cache import ModelCache
        from deepinfer_engine.model.forward_batch import ForwardBatch
        from deepinfer_engine.model.loader import load_model
    except ImportError as exc:
        raise DeepInferError(
            f"--forward needs the model modules, which are not importable yet ({exc})"
        ) from exc
    from deepinfer_engine.model.checkpoint_files import load_tokenizer

    tok_path = directory / "tokenizer.json"
    if not tok_path.is_file():
        raise DeepInferError(f"--forward: {directory} has no tokenizer.json to encode the prompt")
    tokenizer = load_tokenizer(tok_path, required=False)
    ids = [0, *tokenizer.encode(prompt, add_special_tokens=False).ids]  # BOS first
    dtype = getattr(torch, dtype_name)
    model = load_model(directory, dtype=dtype, device=device, with_draft=False)
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    cache, block_tables = ModelCache.allocate_dense(model.args, [len(ids)], dtype=dtype, device=device)
    batch = ForwardBatch.single(input_ids, block_table=block_tables.to(device))
    with torch.inference_mode():
        logits = model.forward(batch, cache).float()
    last = logits[-1]
    finite = bool(torch.isfinite(logits).all())
    return [
        f"forward: {len(ids)} tokens ({device}, {dtype_name}), logits {list(logits.shape)}",
        f"  all positions: mean {logits.mean().item():.4f} std {logits.std().item():.4f} "
        f"min {logits.min().item():.4f} max {logits.max().item():.4f} finite {finite}",
        f"  last position: argmax {int(last.argmax())} max {last.max().item():.4f} std {last.std().item():.4f}",
    ]


def resident_estimate(args: ModelArgs, dtype_name: str, specs: list | None = None) -> dict[str, object]:
    """Bytes the loaded model would hold (weights in checkpoint formats, floats in `dtype_name`), computed by
    building it on the meta device: {"resident_weight_bytes", "resident_bytes_by_dtype"}. `specs`: the tensor
    inventory of `args` if the caller has it."""
    import torch

    from deepinfer_engine.model.model import Transformer
    from deepinfer_engine.model.weight_formats import apply_checkpoint_formats, resident_bytes

    with torch.device("meta"):
        model = Transformer(args, getattr(torch, dtype_name))
        apply_checkpoint_formats(model, args, specs=specs)
    by = resident_bytes(model)
    return {"resident_weight_bytes": sum(by.values()), "resident_bytes_by_dtype": by}


def _resident_lines(args: ModelArgs, dtype_name: str) -> list[str]:
    specs = tensor_inventory(args)
    est = resident_estimate(args, dtype_name, specs)
    total = summarize(specs).total_bytes
    lines = [f"resident bytes when loaded ({dtype_name}, weights in checkpoint formats):"]
    for k, v in sorted(est["resident_bytes_by_dtype"].items()):
        lines.append(f"  {k:<22} {v:>20,}")
    r = est["resident_weight_bytes"]
    lines.append(f"  {'resident_weight_bytes':<22} {r:>20,}  ({r / total:.4f} x total_size)")
    return lines


def load_report(directory: Path, device: str, dtype_name: str) -> dict[str, object]:
    """Load the model from `directory` and measure what it holds: checkpoint_bytes (the index's total_size),
    resident_weight_bytes (parameters + buffers), both by dtype, and their ratio."""
    import torch

    from deepinfer_engine.model.checkpoint import CheckpointReader
    from deepinfer_engine.model.loader import load_model
    from deepinfer_engine.model.weight_formats import resident_bytes

    with CheckpointReader(directory) as reader:
        ck_total = reader.total_size if reader.total_size is not None else reader.stored_nbytes()
        ck_by: dict[str, int] = {}
        for spec in reader.weight_specs():
            for dt, n in [(spec.dtype, spec.nbytes)] + (
                [(spec.scale.dtype, spec.scale.nbytes)] if spec.scale else []
            ):
                ck_by[dt] = ck_by.get(dt, 0) + n
    model = load_model(directory, dtype=getattr(torch, dtype_name), device=device)
    by = resident_bytes(model)
    resident = sum(by.values())
    return {
        "checkpoint": str(directory),
        "device": device,
        "dtype": dtype_name,
        "checkpoint_bytes": ck_total,
        "checkpoint_bytes_by_dtype": ck_by,
        "resident_weight_bytes": resident,
        "resident_bytes_by_dtype": by,
        "resident_over_checkpoint": resident / ck_total if ck_total else None,
    }


def _load_lines(report: dict[str, object]) -> list[str]:
    lines = [f"load: {report['device']}, {report['dtype']}"]
    lines.append(f"  checkpoint_bytes       {report['checkpoint_bytes']:>20,}")
    for k, v in sorted(report["resident_bytes_by_dtype"].items()):
        lines.append(f"    resident {k:<13} {v:>20,}")
    lines.append(
        f"  resident_weight_bytes  {report['resident_weight_bytes']:>20,}  "
        f"({report['resident_over_checkpoint']:.4f} x checkpoint_bytes)"
    )
    return lines


def run(ns: argparse.Namespace) -> int:
    if ns.json and not (ns.verify or ns.load):
        raise DeepInferError("--json goes with --verify or --load (the plain report is text only)")
    if ns.config is not None and ns.dir is not None:
        raise DeepInferError("give either a checkpoint DIR or --config FILE, not both")
    if ns.prefill_flops:
        path = ns.config if ns.config is not None else Path(ns.dir or _default_dir()) / "config.json"
        print("\n".join(prefill_flops_lines(ModelArgs.from_file(path), ns.keep)))
        return 0
    if ns.config is not None:
        if ns.forward or ns.verify:
            raise DeepInferError("--forward and --verify need weights: give a checkpoint DIR, not --config")
        args = ModelArgs.from_file(ns.config)
        print(f"config: {ns.config}")
        print("\n".join(format_report(args, plan=not ns.no_plan)))
        print("\n".join(_resident_lines(args, ns.dtype)))
        return 0
    directory = ns.dir if ns.dir is not None else _default_dir()
    if ns.verify:
        return run_verify(Path(directory), as_json=ns.json, progress=ns.progress)
    from deepinfer_engine.model.checkpoint import CheckpointReader

    if ns.load and ns.json:
        print(json.dumps(load_report(Path(directory), ns.device, ns.dtype)))
        return 0
    with CheckpointReader(directory) as reader:
        print(f"checkpoint: {directory}")
        print("\n".join(format_report(reader.args, plan=not ns.no_plan)))
        names = reader.tensor_names()
        shards = len({reader.shard_of(n) for n in names})
        probs = reader.problems(limit=0)
        if probs:
            print(f"check: FAILED, {len(probs)} problems")
            for p in probs[:50]:
                print(f"  {p}")
            if len(probs) > 50:
                print(f"  ... {len(probs) - 50} more")
            return 1
        print(f"check: OK ({len(names):,} tensors in {shards} shards, {reader.stored_nbytes():,} bytes)")
    if ns.load:
        print("\n".join(_load_lines(load_report(Path(directory), ns.device, ns.dtype))))
    if ns.forward:
        print("\n".join(_forward_lines(Path(directory), ns.prompt, ns.device, ns.dtype)))
    return 0


def _default_dir() -> Path:
    from deepinfer_engine.default_model import default_model_dir

    return Path(default_model_dir())


# ------------------------------------------------------------------------------------------------------------
# --verify: every tensor's bytes (kept apart from the plain report)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify", action="store_true",
                        help="read every tensor (streamed shard by shard) and list non-finite values, invalid "
                             "scale codes, bad offsets and invalid small files; exit 1 on findings")
    parser.add_argument("--json", action="store_true",
                        help="with --verify or --load: print the result as one JSON object")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="with --verify: progress bar on stderr (default: on)")


def run_verify(directory: Path, *, as_json: bool, progress: bool) -> int:
    from deepinfer_engine.model.checkpoint_verify import verify_checkpoint

    if not directory.is_dir():
        raise DeepInferError(f"checkpoint directory {str(directory)!r} does not exist")
    report = verify_checkpoint(directory, progress=progress)
    if as_json:
        print(json.dumps(report.to_json(), ensure_ascii=False))
    else:
        print("\n".join(format_verify(report)))
    return 0 if report.ok else 1


def format_verify(report) -> list[str]:
    lines = [f"checkpoint: {report.directory}"]
    summary = f"{report.tensors_checked:,} tensors, {report.bytes_checked:,} bytes read"
    if report.ok:
        return [*lines, f"verify: OK ({summary})"]
    lines.append(f"verify: FAILED, {len(report.findings)} findings ({summary})")
    lines += [f"  [{f.kind}] {f.message}" for f in report.findings]
    return lines
