"""Offline benchmarks: throughput (many random prompts at once) and latency (one batch, repeated).

Prints a fixed-width result block with stable labels (vLLM style) and returns a dict for `--output-json`.
Random token prompts (seeded), `ignore_eos`, so every request generates exactly `output_len` tokens.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int, bos: int | None) -> list[list[int]]:
    """`n` prompts of `length` ordinary token ids (no special ids), reproducible from `seed`; the first id is
    `bos` when given."""
    rng = random.Random(seed)
    hi = min(vocab, 128000) - 1  # ordinary (non-special) ids
    out = []
    for _ in range(n):
        ids = [rng.randint(3, hi) for _ in range(length)]
        if bos is not None:
            ids[0] = bos
        out.append(ids)
    return out


def _device(llm: LLM) -> torch.device:
    runner = llm.engine.runner  # None for a data-parallel engine: its models live in the rank processes
    return runner.device if runner is not None else llm.engine.core.device


def _device_info(llm: LLM) -> dict[str, Any]:
    dev = _device(llm)
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
    prompts = random_prompts(num_prompts, input_len, vocab, seed, llm.engine.bos_token_id)
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)
    llm.generate(prompts[:1], sp.replace(max_tokens=2), use_tqdm=False)  # warm-up
    spec0 = _spec_reset(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    spec = _spec_summary(llm, spec0)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "benchmark": "throughput", "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "temperature": temperature, "elapsed_s": elapsed, "input_tokens": n_in, "output_tokens": n_out,
        "requests_per_s": num_prompts / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed, "errors": sum(o.error is not None for o in outs),
        **({"speculative": spec} if spec is not None else {}), **_prefix_stats(llm),
        **_device_info(llm), "settings": _settings(llm), **_data_parallel(llm),
    }


def _shared_prefix_prompts(n: int, length: int, shared: int, vocab: int, seed: int, bos: int | None
                           ) -> list[list[int]]:
    """n prompts of `length` ids: the same first `shared` ids, then a random suffix each."""
    common = random_prompts(1, length, vocab, seed, bos)[0][:shared]
    tails = random_prompts(n, length - shared, vocab, seed + 1, None)
    return [common + t for t in tails]


def _prefix_stats(llm: LLM) -> dict[str, float]:
    sched = llm.engine.scheduler  # None for a data-parallel engine: each rank keeps its own prefix cache
    kv = sched.kv if sched is not None else None
    return kv.stats.as_dict() if kv is not None and kv.prefix is not None else {}


def _timed_batch(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> dict[str, Any]:
    """One generate call over all prompts on a cold prefix cache: elapsed, time to first token, throughput and
    the prefix-cache counters of this call."""
    kv = llm.engine.scheduler.kv
    if kv.prefix is not None:
        kv.reset_prefix_cache()  # cold: what the batch shares it must compute once itself
    before = _prefix_stats(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = _prefix_stats(llm)
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                  if o.metrics.first_token_time is not None)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    stats = {k: after[k] - before[k] for k in after if k != "prefix_hit_rate"}
    if stats:
        q = stats["prefix_query_tokens"]
        stats["prefix_hit_rate"] = stats["prefix_cached_tokens"] / q if q else 0.0
    return {
        "elapsed_s": elapsed, "input_tokens": n_in, "output_tokens": n_out,
        "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens_per_s": n_out / elapsed,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_max_s": ttft[-1] if ttft else None,
        "errors": sum(o.error is not None for o in outs), **stats,
        "outputs": [[c.token_ids for c in o.outputs] for o in outs],
    }


def shared_prefix(make_llm: Callable[[bool], LLM], *, num_prompts: int, input_len: int, output_len: int,
                  shared_fraction: float, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """The shared-prefix workload: `num_prompts` prompts whose first round(shared_fraction * input_len) ids are
    equal, generated in one batch with the prefix cache on (`make_llm(True)`) and off (`make_llm(False)`); one
    engine at a time (the first is released before the second loads)."""
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"shared_fraction: found {shared_fraction}, expected in [0, 1]")
    shared = min(input_len - 1, round(shared_fraction * input_len))
    runs: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for label, on in (("cache_on", True), ("cache_off", False)):
        llm = make_llm(on)
        vocab = int(getattr(llm.engine.args, "vocab_size", 129280))
        prompts = _shared_prefix_prompts(num_prompts, input_len, shared, vocab, seed, llm.engine.bos_token_id)
        sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)
        warm = random_prompts(1, input_len, vocab, seed + 7, llm.engine.bos_token_id)
        llm.generate(warm, sp.replace(max_tokens=2), use_tqdm=False)  # warm-up (shares nothing)
        runs[label] = _timed_batch(llm, prompts, sp)
        if on:
            meta = {**_device_info(llm), "settings": _settings(llm)}
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on_, off = runs["cache_on"], runs["cache_off"]
    same = on_.pop("outputs") == off.pop("outputs")
    return {
        "benchmark": "shared_prefix", "num_prompts": num_prompts, "input_len": input_len,
        "output_len": output_len, "shared_fraction": shared_fraction, "shared_tokens": shared,
        "temperature": temperature, "cache_on": on_, "cache_off": off,
        "speedup_elapsed": off["elapsed_s"] / on_["elapsed_s"],
        "outputs_equal": same, **meta,
    }


def _data_parallel(llm: LLM) -> dict[str, Any]:
    """Placement and per-rank work of a data-parallel engine since it started (warm-up included)."""
    stats = getattr(llm.engine.core, "dp_stats", None)
    return {} if stats is None else {"data_parallel": stats()}



def _spec_reset(llm: LLM) -> bool:
    """Start fresh speculative statistics for the timed run (False without speculation)."""
    spec = getattr(llm.engine.runner, "spec", None)
    if spec is None:
        return False
    spec.reset_stats()
    return True


def _spec_summary(llm: LLM, on: bool) -> dict[str, Any] | None:
    """The timed run's speculative statistics: drafts proposed / verified / accepted, mean accepted length,
    verified draft tokens per step, per-position acceptance."""
    if not on:
        return None
    spec = llm.engine.runner.spec
    return {"method": llm.config.speculative.speculative_method, "policy": spec.policy.kind,
            **spec.stats.as_dict()}


def latency(llm: LLM, *, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
            num_iters_warmup: int = 1, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    vocab = int(getattr(llm.engine.args, "vocab_size", 129280))
    prompts = random_prompts(batch_size, input_len, vocab, seed, llm.engine.bos_token_id)
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, sp, use_tqdm=False)
    spec0 = _spec_reset(llm)
    times = []
    for _ in range(num_iters):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    spec = _spec_summary(llm, spec0)
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
        **({"speculative": spec} if spec is not None else {}), **_device_info(llm), "settings": _settings(llm),
        **_data_parallel(llm),
    }


def kv_storage(llm: LLM) -> str:
    """"auto" where the engine's cache holds the deployed KV records, else "bfloat16" (`model.cache.kv_storage`)."""
    from deepinfer_engine.model.cache import kv_storage as storage

    return storage(llm.engine.args, llm.config.cache.kv_cache_dtype)


def decode_step_seconds(llm: LLM, *, batch_size: int, input_len: int, steps: int, seed: int = 0,
                        forward_only: dict[str, float] | None = None) -> list[float]:
    """Wall time of `steps` pure decode steps of one batch in which all `batch_size` sequences decode, through
    the engine's step loop: schedule + forward + sampling + the step's one host read, i.e. what a user waits per
    token. Chunked prefill lets the first-prefilled sequences decode beside later prompts, so each request gets
    enough tokens to still be running when the last prompt is done; steps with a prompt chunk, or with fewer
    sequences decoding, are not timed, and the batch is aborted once `steps` were timed.

    `forward_only` (a dict) receives "forward_s": the median device time of the last step's CUDA graph replayed
    alone (no scheduling, host plan, sampling or host read), when that step ran from a graph."""
    eng = llm.engine
    vocab = int(getattr(eng.args, "vocab_size", 129280))
    prompts = random_prompts(batch_size, input_len, vocab, seed, eng.bos_token_id)
    budget = max(1, int(llm.config.scheduler.max_num_batched_tokens))
    prefill_steps = -(-batch_size * input_len // budget) + 1
    sp = SamplingParams(max_tokens=steps + prefill_steps + 1, temperature=0.0, ignore_eos=True, seed=seed)
    ids = [f"bench-decode-{seed}-{i}" for i in range(batch_size)]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)
    times: list[float] = []
    while eng.has_unfinished_requests() and len(times) < steps:
        prefilled, decoded = eng.total.prefill_tokens, eng.total.decode_tokens
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if eng.total.prefill_tokens == prefilled and eng.total.decode_tokens - decoded == batch_size:
            times.append(dt)
    graphs = getattr(eng.runner, "cuda_graphs", None)
    if forward_only is not None and graphs is not None and times:
        fwd = graphs.replay_seconds()
        if fwd is not None and graphs.last_shape is not None and graphs.last_shape[0] >= batch_size:
            forward_only["forward_s"] = fwd
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return times


def decode_roofline(llm: LLM, *, batch_sizes: list[int], input_len: int, steps: int, seed: int = 0,
                    kv_format: str | None = None, repeats: int = 1) -> dict[str, Any]:
    """Median decode step time per batch size beside the bytes that step must read (`roofline`) and the copy
    bandwidth and bf16 matmul rate measured on the same device in the same run. kv_format (None: what the engine
    stores, `kv_storage`) sets the KV bytes of the bound. repeats: the `steps` timed steps of a batch size are
    measured this many times back to back; a row's step (and forward) time is then the median of the repeats'
    medians, `step_s_repeats` holds each repeat's median and `step_s_all` every timed step, and `device_state`
    (SM clock, temperature, power, where readable) is taken after each repeat."""
    from deepinfer_engine.errors import ConfigError

    if repeats < 1:
        raise ConfigError(f"decode_roofline: repeats {repeats}, expected a positive count (1 = measure once)")
    from deepinfer_kernels.device_rates import device_state

    from deepinfer_engine.roofline import decode_step_bytes, measure_copy_bandwidth, measure_matmul_rate

    kv_format = kv_format or kv_storage(llm)

    dev = _device(llm)
    copy_bw = measure_copy_bandwidth(dev, nbytes=(1 << 30) if dev.type == "cuda" else (1 << 26))
    mm_rate = measure_matmul_rate(dev, n=8192 if dev.type == "cuda" else 512, iters=10 if dev.type == "cuda" else 3)
    rows = []
    for b in batch_sizes:
        decode_step_seconds(llm, batch_size=b, input_len=input_len, steps=2, seed=seed + 1)  # warm-up
        times: list[float] = []
        medians: list[float] = []
        forwards: list[float] = []
        states: list[dict[str, float]] = []
        for _ in range(repeats):
            fwd: dict[str, float] = {}
            t = decode_step_seconds(llm, batch_size=b, input_len=input_len, steps=steps, seed=seed, forward_only=fwd)
            state = device_state(dev)  # right after the timed steps: the clock they ran at, as closely as NVML tells
            times += t
            medians.append(statistics.median(t))
            if "forward_s" in fwd:
                forwards.append(fwd["forward_s"])
            if state is not None:
                states.append(state)
        step = statistics.median(medians)
        nbytes = decode_step_bytes(llm.engine.args, b, input_len + steps // 2, kv_format)  # type: ignore[arg-type]
        bound = nbytes.total / copy_bw
        row = {"batch_size": b, "step_s": step, "step_s_all": times, "step_s_repeats": medians,
               "tokens_per_s": b / step, "bytes": nbytes.as_dict(), "bytes_bound_s": bound,
               "fraction_of_bound": bound / step}
        if forwards:  # engine overhead = the whole step over its graph replayed alone
            row["forward_s"] = statistics.median(forwards)
            row["engine_overhead"] = step / row["forward_s"] - 1.0
        if states:
            row["device_state"] = states[-1]
            row["device_state_repeats"] = states
        rows.append(row)
    return {"benchmark": "decode_roofline", "input_len": input_len, "steps": steps, "kv_format": kv_format,
            "copy_bandwidth_Bps": copy_bw, "bf16_matmul_flops": mm_rate, "rows": rows,
            **_device_info(llm), "settings": _settings(llm)}


def format_roofline(r: dict[str, Any]) -> str:
    lines = [f"{' Decode step vs bytes bound ':=^97}",
             f"device {r['device']} {r.get('gpu', r.get('cpu', ''))}: copy {r['copy_bandwidth_Bps'] / 1e9:.1f} GB/s "
             f"(read + write), bf16 matmul {r['bf16_matmul_flops'] / 1e12:.1f} TFLOP/s, context {r['input_len']}",
             f"{'batch':>6} {'step ms':>10} {'tok/s':>10} {'GB/step':>9} {'bound ms':>9} {'of bound':>9} "
             f"{'fwd ms':>8} {'overhead':>9}"]
    spread = any(len(row.get("step_s_repeats", ())) > 1 for row in r["rows"])
    if spread:
        lines[-1] += f" {'repeats ms':>15}"
    clocks = any("device_state" in row for row in r["rows"])
    if clocks:
        lines[-1] += f" {'SM MHz':>7} {'C':>4} {'W':>5}"
    for row in r["rows"]:
        fwd = f"{row['forward_s'] * 1e3:>8.3f} {row['engine_overhead'] * 100:>8.1f}%" if "forward_s" in row else (
            f"{'-':>8} {'-':>9}")
        line = (f"{row['batch_size']:>6} {row['step_s'] * 1e3:>10.3f} {row['tokens_per_s']:>10.1f} "
                f"{row['bytes']['total'] / 1e9:>9.3f} {row['bytes_bound_s'] * 1e3:>9.3f} "
                f"{row['fraction_of_bound'] * 100:>8.1f}% {fwd}")
        if spread:  # the range of the repeats' medians, and how many
            reps = row.get("step_s_repeats") or [row["step_s"]]
            line += f" {f'{min(reps) * 1e3:.3f}-{max(reps) * 1e3:.3f} x{len(reps)}':>15}"
        if clocks:
            st = row.get("device_state")
            line += (f" {st['sm_clock_mhz']:>7.0f} {st['temperature_c']:>4.0f} {st['power_w']:>5.0f}" if st else
                     f" {'-':>7} {'-':>4} {'-':>5}")
        lines.append(line)
    lines.append("=" * (len(lines[2]) if clocks or spread else 97))
    return "\n".join(lines)


def check_plot_target(path: str | Path) -> None:
    """Before any work: matplotlib importable and the PNG's directory writable (ConfigError otherwise)."""
    from deepinfer_engine.errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:  # optional dependency of a benchmark flag
        raise ConfigError("--plot: matplotlib is not installed; install it (uv pip install matplotlib) or drop "
                          "--plot") from exc
    p = Path(path)
    if p.is_dir() or not p.parent.is_dir():
        raise ConfigError(f"--plot: {str(p)!r} is a directory or its directory does not exist; expected a PNG path "
                          "in an existing directory")


def plot_roofline(r: dict[str, Any], path: str | Path) -> None:
    """Step time vs batch size against the bytes bound (PNG; needs matplotlib, see `check_plot_target`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bs = [row["batch_size"] for row in r["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(bs, [row["step_s"] * 1e3 for row in r["rows"]], "o-", label="decode step (measured)")
    ax.plot(bs, [row["bytes_bound_s"] * 1e3 for row in r["rows"]], "s--",
            label=f"bytes / copy bandwidth ({r['copy_bandwidth_Bps'] / 1e9:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{r['settings']['arch']} hidden {r['settings']['hidden_size']} x {r['settings']['num_layers']} "
                 f"layers, {r['device']}, context {r['input_len']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_result(r: dict[str, Any]) -> str:
    """The fixed-width result block (labels are stable: scripts may grep them)."""
    w = 30
    title = r["benchmark"].replace("_", "-").capitalize()
    lines = [f"{' ' + title + ' Benchmark Result ':=^60}"]

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
    elif r["benchmark"] == "shared_prefix":
        row("Requests", str(r["num_prompts"]))
        row("Input / output len", f"{r['input_len']} / {r['output_len']} ({r['shared_tokens']} shared)")
        for label in ("cache_on", "cache_off"):
            x = r[label]
            tag = "cache on" if label == "cache_on" else "cache off"
            row(f"Elapsed, {tag} (s)", f"{x['elapsed_s']:.3f}")
            row(f"TTFT mean/p50, {tag} (s)", f"{x['ttft_mean_s']:.4f} / {x['ttft_p50_s']:.4f}")
            row(f"Throughput, {tag}", f"{x['total_tokens_per_s']:.1f} total tokens/s, "
                                      f"{x['output_tokens_per_s']:.1f} output tokens/s")
        on_ = r["cache_on"]
        row("Prefix hit rate", f"{on_.get('prefix_hit_rate', 0.0):.3f} ({on_.get('prefix_cached_tokens', 0)} of "
                               f"{on_.get('prefix_query_tokens', 0)} prompt tokens)")
        row("Hits / forks / replayed", f"{on_.get('prefix_hits', 0)} / {on_.get('prefix_forks', 0)} / "
                                       f"{on_.get('prefix_replayed_tokens', 0)} tokens")
        row("Speedup (elapsed)", f"{r['speedup_elapsed']:.2f}x, outputs equal: {r['outputs_equal']}")
    else:
        row("Batch size", str(r["batch_size"]))
        row("Input / output len", f"{r['input_len']} / {r['output_len']}")
        row("Avg latency (s)", f"{r['avg_latency_s']:.4f} (std {r['std_latency_s']:.4f})")
        for p, v in r["percentiles_s"].items():
            row(f"{p}% percentile (s)", f"{v:.4f}")
        row("Output tokens/s", f"{r['output_tokens_per_s']:.1f}")
    dp = r.get("data_parallel")
    if dp:
        row("DP tokens per rank", f"{dp['tokens_per_rank']} (imbalance max/mean {dp['token_imbalance']:.2f})")
    spec = r.get("speculative")
    if spec is not None:
        row("Speculative", f"{spec['method']} / {spec['policy']}")
        row("Mean accepted length", f"{spec['mean_accepted_length']:.3f}")
        row("Draft/verified/accepted", f"{spec['num_draft_tokens']} / {spec['num_verified_tokens']} / "
                                           f"{spec['num_accepted_tokens']}")
        row("Verified tokens per step", f"{spec['verified_tokens_per_step']:.2f}")
        cal = spec.get("survival_calibration")
        if cal is not None:  # predicted over accepted drafts: near 1 when the Confidence Head is calibrated
            row("Predicted/accepted drafts", f"{cal:.3f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(r, indent=2, default=str) + "\n", encoding="utf-8")
