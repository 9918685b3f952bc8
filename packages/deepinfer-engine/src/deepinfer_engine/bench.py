"""Offline benchmarks: throughput (many random prompts at once) and latency (one batch, repeated).

Prints a fixed-width result block with stable labels (vLLM style) and returns a dict for `--output-json`.
Random token prompts (seeded), `ignore_eos`, so every request generates exactly `output_len` tokens.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams


def _random_prompts(n: int, length: int, vocab: int, seed: int, bos: int | None) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 128000) - 1  # ordinary (non-special) ids
    out = []
    for _ in range(n):
        ids = [rng.randint(3, hi) for _ in range(length)]
        if bos is not None:
            ids[0] = bos
        out.append(ids)
    return out


def _device_info(llm: LLM) -> dict[str, Any]:
    dev = llm.engine.runner.device
    info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__, "python": platform.python_version()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def _settings(llm: LLM) -> dict[str, Any]:
    args = llm.engine.args
    return {
        "model": str(llm.engine.model_dir),
        "arch": getattr(args, "arch", None),
        "hidden_size": getattr(args, "hidden_size", None),
        "num_layers": getattr(args, "num_hidden_layers", None),
        "engine_options": {k: v for k, v in llm.config.to_options().items() if v is not None},
        "cache_plan": {"page_size": llm.engine.plan.page_size, "num_pages": llm.engine.plan.num_pages,
                       "num_slots": llm.engine.plan.num_slots, "bytes_per_token": llm.engine.plan.bytes_per_token},
    }


def throughput(llm: LLM, *, num_prompts: int, input_len: int, output_len: int, temperature: float = 0.0,
               seed: int = 0) -> dict[str, Any]:
    vocab = int(getattr(llm.engine.args, "vocab_size", 129280))
    prompts = _random_prompts(num_prompts, input_len, vocab, seed, llm.engine.bos_token_id)
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)
    llm.generate(prompts[:1], sp.replace(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "benchmark": "throughput", "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "temperature": temperature, "elapsed_s": elapsed, "input_tokens": n_in, "output_tokens": n_out,
        "requests_per_s": num_prompts / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed, "errors": sum(o.error is not None for o in outs),
        **_device_info(llm), "settings": _settings(llm),
    }


def latency(llm: LLM, *, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
            num_iters_warmup: int = 1, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    vocab = int(getattr(llm.engine.args, "vocab_size", 129280))
    prompts = _random_prompts(batch_size, input_len, vocab, seed, llm.engine.bos_token_id)
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, sp, use_tqdm=False)
    times = []
    for _ in range(num_iters):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    qs = sorted(times)

    def pct(p: float) -> float:
        k = (len(qs) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(qs) - 1)
        return qs[lo] + (qs[hi] - qs[lo]) * (k - lo)

    return {
        "benchmark": "latency", "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters": num_iters, "avg_latency_s": statistics.fmean(times),
        "std_latency_s": statistics.pstdev(times), "latencies_s": times,
        "percentiles_s": {str(p): pct(p) for p in (10, 25, 50, 75, 90, 99)},
        "output_tokens_per_s": batch_size * output_len / statistics.fmean(times),
        **_device_info(llm), "settings": _settings(llm),
    }


def format_result(r: dict[str, Any]) -> str:
    """The fixed-width result block (labels are stable: scripts may grep them)."""
    w = 28
    lines = [f"{' ' + r['benchmark'].capitalize() + ' Benchmark Result ':=^60}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label + ':':<{w}}{value}")

    row("Device", r["device"] + (f" ({r.get('gpu') or r.get('cpu')}, {r.get('cpu_threads', '-')} threads)"
                                 if "cpu_threads" in r else f" ({r.get('gpu', '')})"))
    row("Model", f"{r['settings']['arch']} hidden {r['settings']['hidden_size']} x {r['settings']['num_layers']} layers")
    if r["benchmark"] == "throughput":
        row("Requests", str(r["num_prompts"]))
        row("Input / output len", f"{r['input_len']} / {r['output_len']}")
        row("Elapsed (s)", f"{r['elapsed_s']:.3f}")
        row("Throughput", f"{r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.1f} total tokens/s, "
                          f"{r['output_tokens_per_s']:.1f} output tokens/s")
    else:
        row("Batch size", str(r["batch_size"]))
        row("Input / output len", f"{r['input_len']} / {r['output_len']}")
        row("Avg latency (s)", f"{r['avg_latency_s']:.4f} (std {r['std_latency_s']:.4f})")
        for p, v in r["percentiles_s"].items():
            row(f"{p}% percentile (s)", f"{v:.4f}")
        row("Output tokens/s", f"{r['output_tokens_per_s']:.1f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(r, indent=2, default=str) + "\n", encoding="utf-8")
