"""Decode step of our V4 model beside HF transformers' eager `DeepseekV4ForCausalLM` on the same checkpoint, in
the same run, beside the bytes bound measured on the same device, and the whole engine decode step (scheduler +
CUDA-graph replay on a GPU + sampler, as `deepinfer bench latency` times it).

    python scripts/bench_hf_peer.py --model DIR [--device cuda] [--batch 1,32] [--prefill-len 1024]
        [--decode-steps 16] [--iters 3] [--async-scheduling] [--output-json FILE]

DIR is a V4 checkpoint (e.g. `deepinfer make-checkpoint --arch v4 --preset layers-3 --device cuda --out DIR`).
Both models run in bf16 from the same weights (HF gets the dequantized checkpoint, as its loader does). Per batch
size: a prefill of B x prefill-len tokens, then decode-steps forwards of one token per sequence; the median step of
`iters` timed iterations is reported (forward only: no scheduler, no sampling). The bytes bound is
`deepinfer_engine.roofline.decode_step_bytes` over the copy bandwidth measured first. Without transformers
(>= 5.23, which has DeepseekV4ForCausalLM) the HF column is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "deepinfer-engine" / "tests" / "support"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="V4 checkpoint directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", default="1,32", help="comma list of batch sizes")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine column with / without asynchronous scheduling (default: the engine's default, "
                   "on for CUDA); the forward columns are unaffected")
    p.add_argument("--output-json")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_decode_step_s(model: Any, *, batch: int, prefill_len: int, decode_steps: int, iters: int,
                     device: torch.device, vocab: int) -> float:
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    hi = min(vocab, 128000)
    times = []
    for it in range(iters + 1):
        prompt = torch.randint(3, hi, (batch, prefill_len), generator=g).to(device)
        cache = DynamicCache(config=model.config)
        pos = torch.arange(prefill_len, device=device).expand(batch, -1)
        model(input_ids=prompt, position_ids=pos, cache=cache, use_cache=True)
        _sync(device)
        t0 = time.perf_counter()
        for s in range(decode_steps):
            tok = torch.randint(3, hi, (batch, 1), generator=g).to(device)
            p = torch.full((batch, 1), prefill_len + s, device=device)
            model(input_ids=tok, position_ids=p, cache=cache, use_cache=True)
        _sync(device)
        if it:  # the first iteration warms up
            times.append((time.perf_counter() - t0) / decode_steps)
        del cache
    return statistics.median(times)


def load_hf(model_dir: Path, device: torch.device) -> tuple[Any, str | None]:
    try:
        from hf_oracle import build_hf_model
    except ImportError as exc:
        return None, f"HF oracle helpers not importable: {exc}"
    try:
        import transformers
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        import importlib.metadata as md

        try:
            v = md.version("transformers")
        except md.PackageNotFoundError:
            v = "not installed"
        return None, f"transformers {v} has no DeepseekV4ForCausalLM (needs >= 5.23)"
    from deepinfer_engine.model.checkpoint import CheckpointReader

    with CheckpointReader(model_dir) as reader:
        args = reader.args
        names = [n for n in reader.tensor_names() if not n.startswith("mtp.") and not n.endswith(".scale")]
        state = {n: reader.load(n, dtype=torch.bfloat16, device=device) for n in names}
    model = build_hf_model(state, args, dtype=torch.bfloat16).to(device)
    return model, f"transformers {transformers.__version__}"


def engine_decode_steps(model_dir: Path, rows: list[dict[str, Any]], ns: argparse.Namespace) -> None:
    """Add "engine_step_ms": the whole engine decode step (schedule, CUDA-graph replay, sampling, the host read)
    from `deepinfer_engine.bench.decode_roofline`, i.e. what `deepinfer bench latency` reports."""
    from deepinfer_engine import LLM
    from deepinfer_engine.bench import decode_roofline

    llm = LLM(str(model_dir), device=ns.device, dtype="bfloat16", max_num_seqs=max(r["batch"] for r in rows),
              async_scheduling=ns.async_scheduling)
    rep = decode_roofline(llm, batch_sizes=[r["batch"] for r in rows], input_len=ns.prefill_len,
                          steps=ns.decode_steps)
    for row, er in zip(rows, rep["rows"], strict=True):
        row["engine_step_ms"] = er["step_s"] * 1e3
        if "forward_s" in er:
            row["engine_forward_ms"] = er["forward_s"] * 1e3
        print(f"  engine B={row['batch']}: {row['engine_step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    ns.async_scheduling = llm.config.scheduler.async_scheduling  # as resolved, for the JSON
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from bench_model import bench_one, env_info
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.loader import load_model
    from deepinfer_engine.roofline import decode_step_bytes, measure_copy_bandwidth, measure_matmul_rate

    device = torch.device(ns.device)
    model_dir = Path(ns.model)
    args = ModelArgs.from_checkpoint_dir(model_dir)
    if args.arch != "v4":
        raise SystemExit(f"--model: found arch {args.arch!r}; HF has only V4 (DeepseekV4ForCausalLM)")
    batches = [int(b) for b in ns.batch.split(",") if b]
    copy_bw = measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    mm = measure_matmul_rate(device, n=8192 if device.type == "cuda" else 512)
    rows: list[dict[str, Any]] = []
    ours = load_model(model_dir, dtype=torch.bfloat16, device=device)
    for b in batches:
        r = bench_one(ours, batch=b, prefill_len=ns.prefill_len, decode_steps=ns.decode_steps, iters=ns.iters,
                      warmup=1, device=device)
        nbytes = decode_step_bytes(args, b, ns.prefill_len + ns.decode_steps // 2)
        rows.append({"batch": b, "ours_step_ms": r["decode_step_ms"], "bytes": nbytes.as_dict(),
                     "bound_ms": nbytes.total / copy_bw * 1e3})
        print(f"  ours B={b}: {r['decode_step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    del ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine_decode_steps(model_dir, rows, ns)
    hf, hf_note = load_hf(model_dir, device)
    for row in rows:
        if hf is not None:
            row["hf_step_ms"] = 1e3 * hf_decode_step_s(hf, batch=row["batch"], prefill_len=ns.prefill_len,
                                                       decode_steps=ns.decode_steps, iters=ns.iters,
                                                       device=device, vocab=args.vocab_size)
            print(f"  HF B={row['batch']}: {row['hf_step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    head = (f"{'B':>4} {'ours ms':>9} {'HF ms':>9} {'speedup':>8} {'bound ms':>9} {'ours/bound':>11} "
            f"{'engine ms':>10} {'HF/engine':>10}")
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write), bf16 matmul {mm / 1e12:.1f} TFLOP/s; "
          f"HF: {hf_note}; context {ns.prefill_len}")
    print(head)
    for row in rows:
        hf_ms = row.get("hf_step_ms")
        print(f"{row['batch']:>4} {row['ours_step_ms']:>9.2f} {hf_ms if hf_ms is not None else float('nan'):>9.2f} "
              f"{(hf_ms / row['ours_step_ms']) if hf_ms else float('nan'):>7.2f}x {row['bound_ms']:>9.3f} "
              f"{row['bound_ms'] / row['ours_step_ms'] * 100:>10.1f}% {row.get('engine_step_ms', float('nan')):>10.2f} "
              f"{(hf_ms / row['engine_step_ms']) if hf_ms and 'engine_step_ms' in row else float('nan'):>9.2f}x")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(
            {"env": env_info(device), "model": str(model_dir), "hf": hf_note, "copy_bandwidth_Bps": copy_bw,
             "bf16_matmul_flops": mm, "prefill_len": ns.prefill_len, "decode_steps": ns.decode_steps,
             "engine_async_scheduling": ns.async_scheduling,
             "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
