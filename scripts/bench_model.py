"""Forward throughput of the model alone (no scheduler, no sampler): prefill tokens/s and decode tokens/s at batch B.

    python scripts/bench_model.py --model DIR|tiny-v41|tiny-v4 [--device cuda] [--dtype bfloat16,float32]
        [--batch 1,8] [--prefill-len 128] [--decode-steps 16] [--iters 3] [--warmup 1] [--kernel-backend auto,torch]
        [--output-json FILE]

Per (dtype, batch): prefill = one forward over B sequences of prefill-len tokens each (varlen batch, fresh
positions 0..L-1, last-token logits); decode = decode-steps forwards of one token per sequence at positions
L, L+1, ... Timings are wall clock with a device synchronize around each timed region; every iteration rewrites
the same cache positions (the cache is addressed by position). `tiny-v41` / `tiny-v4` write a random tiny
checkpoint (make_checkpoint "tiny") into --cache-dir first. --kernel-backend runs every row once per kernel backend
(DEEPINFER_KERNEL_BACKEND, applied to the loaded model with set_kernel_backend: auto = Triton kernels where
they exist on CUDA, torch = the references). Prints a table;
--output-json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _csv(kind: type):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-v41", help="checkpoint directory, or tiny-v41 / tiny-v4 (written first)")
    p.add_argument("--cache-dir", default="/tmp/deepinfer-bench-model", help="where tiny-* checkpoints are written")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", type=_csv(str), default=["bfloat16", "float32"], help="comma list: bfloat16,float32")
    p.add_argument("--batch", type=_csv(int), default=[1, 8], help="comma list of batch sizes B")
    p.add_argument("--prefill-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode forwards per iteration")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (default: torch's)")
    p.add_argument("--kernel-backend", type=_csv(str), default=["auto"],
                   help="comma list of DEEPINFER_KERNEL_BACKEND values to run: auto, torch, triton")
    p.add_argument("--output-json", help="write {env, rows} here")
    ns = p.parse_args(argv)
    bad = [d for d in ns.dtype if d not in DTYPES]
    if bad:
        p.error(f"--dtype: found {bad}, expected names from {sorted(DTYPES)}")
    bad = [b for b in ns.kernel_backend if b not in ("auto", "torch", "triton")]
    if bad:
        p.error(f"--kernel-backend: found {bad}, expected auto, torch or triton")
    if min(ns.batch) < 1 or ns.prefill_len < 1 or ns.decode_steps < 1 or ns.iters < 1 or ns.warmup < 0:
        p.error("--batch, --prefill-len, --decode-steps, --iters must be >= 1 and --warmup >= 0")
    return ns


def resolve_model_dir(model: str, cache_dir: str) -> Path:
    if model in ("tiny-v41", "tiny-v4"):
        from engine_testing import make_tiny_checkpoint

        out = Path(cache_dir) / model
        if not (out / "config.json").is_file():
            make_tiny_checkpoint(out, arch=model.split("-")[1], seed=0)
        return out
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model: {model!r} is neither tiny-v41 / tiny-v4 nor a directory with config.json")
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(ids: torch.Tensor, start: int, bt: torch.Tensor, device: torch.device):
    """ids [B, n] -> ForwardBatch of B sequences at positions start..start+n-1 (slot b, block table row b), with
    its host facts (as the runner's input batch provides them: the forward reads nothing back)."""
    from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost

    b, n = ids.shape
    pos = torch.arange(start, start + n, dtype=torch.int64).repeat(b)
    host = StepHost(ctx_lens=(start,) * b, input_ids=ids.reshape(-1).to(torch.int64).numpy(),
                    block_tables=bt.cpu().numpy())
    return ForwardBatch(
        host=host,
        input_ids=ids.reshape(-1).to(device),
        positions=pos.to(device),
        query_lens=(n,) * b,
        slots=tuple(range(b)),
        block_tables=bt.to(device),
        logits_indices=(torch.arange(b, dtype=torch.int64) * n + n - 1).to(device),
    )


@torch.inference_mode()
def bench_one(model: Any, *, batch: int, prefill_len: int, decode_steps: int, iters: int, warmup: int,
              device: torch.device, seed: int = 0) -> dict[str, Any]:
    from deepinfer_engine.model.cache import ModelCache

    a = model.args
    total = prefill_len + decode_steps
    cache, bt = ModelCache.allocate_dense(a, [total] * batch, dtype=model.dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    hi = min(int(a.vocab_size), 128000)
    prompt = torch.randint(3, hi, (batch, prefill_len), generator=g)
    steps = torch.randint(3, hi, (decode_steps, batch, 1), generator=g)
    pre_b = _batch(prompt, 0, bt, device)
    dec_b = [_batch(steps[s], prefill_len + s, bt, device) for s in range(decode_steps)]
    pre_t, dec_t = [], []
    for it in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        logits = model(pre_b, cache)
        _sync(device)
        t1 = time.perf_counter()
        for b in dec_b:
            logits = model(b, cache)
        _sync(device)
        t2 = time.perf_counter()
        if it >= warmup:
            pre_t.append(t1 - t0)
            dec_t.append((t2 - t1) / decode_steps)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("non-finite logits in the benchmark run")
    pre, dec = statistics.median(pre_t), statistics.median(dec_t)
    return {
        "batch": batch,
        "prefill_len": prefill_len,
        "decode_steps": decode_steps,
        "prefill_s": pre,
        "prefill_tokens_per_s": batch * prefill_len / pre,
        "decode_step_ms": dec * 1e3,
        "decode_tokens_per_s": batch / dec,
    }


def env_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'arch':<5} {'dtype':<9} {'device':<7} {'kernels':<8} {'B':>4} {'L':>5} {'prefill tok/s':>14} {'prefill ms':>11} " \
           f"{'decode ms/step':>15} {'decode tok/s':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['arch']:<5} {r['dtype']:<9} {r['device']:<7} {r['kernels']:<8} {r['batch']:>4} {r['prefill_len']:>5} "
                     f"{r['prefill_tokens_per_s']:>14.1f} {r['prefill_s'] * 1e3:>11.2f} {r['decode_step_ms']:>15.2f} "
                     f"{r['decode_tokens_per_s']:>13.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from deepinfer_engine.model.loader import load_model
    from deepinfer_kernels import backend_from_env

    device = torch.device(ns.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest")  # fp32 rows measure real fp32 (no TF32)
    elif ns.threads:
        torch.set_num_threads(ns.threads)
    model_dir = resolve_model_dir(ns.model, ns.cache_dir)
    rows = []
    for name in ns.dtype:
        dtype = DTYPES[name]
        t0 = time.perf_counter()
        model = load_model(model_dir, dtype=dtype, device=device)
        load_s = time.perf_counter() - t0
        for kb in ns.kernel_backend:
            os.environ["DEEPINFER_KERNEL_BACKEND"] = kb
            model.set_kernel_backend(backend_from_env())  # the model resolves the backend once, not per call
            for b in ns.batch:
                r = bench_one(model, batch=b, prefill_len=ns.prefill_len, decode_steps=ns.decode_steps,
                              iters=ns.iters, warmup=ns.warmup, device=device)
                r.update(arch=model.args.arch, dtype=str(dtype).removeprefix("torch."), device=device.type,
                         kernels=kb, load_s=load_s)
                rows.append(r)
                print(f"  done: {r['arch']} {r['dtype']} kernels={kb} B={b}", file=sys.stderr, flush=True)
                _write_json(ns.output_json, device, model_dir, rows)  # after every row: a cut run keeps its rows
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_table(rows))
    _write_json(ns.output_json, device, model_dir, rows)
    return 0


def _write_json(path: str | None, device: torch.device, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    if path:
        result = {"env": env_info(device), "model": str(model_dir), "rows": rows}
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
