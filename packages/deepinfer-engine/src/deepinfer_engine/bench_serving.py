"""`deepinfer bench serving`: load an OpenAI-compatible server with streamed completions and measure what a client
sees: time to first token (TTFT), time per output token after the first (TPOT), the gaps between streamed chunks
(ITL), end-to-end latency, and request / token throughput over the whole run.

Closed loop (default): `concurrency` client threads, each with one request in flight at a time; open loop
(`request_rate`): Poisson arrivals at that rate, at most `concurrency` in flight. Over `num_prompts` random token-id
prompts of `input_len` tokens with `output_len` tokens each (`ignore_eos`, so every request generates exactly that
many). The server is the one at `url`, or one this process starts over its own `LLM` on a free local port
(`server.serve_in_thread`). Standard library only on the client side.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestTiming", "format_serving", "run_serving"]


@dataclass
class RequestTiming:
    """One request as the client saw it: seconds from its send to the first chunk and to the end, the arrival
    times of its chunks, the output tokens the server reported, or the error that ended it."""

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def _one(url: str, prompt: list[int], output_len: int, temperature: float, model: str) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = RequestTiming()
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    t.chunk_times_s.append(now)
    except urllib.error.HTTPError as exc:  # the server's refusal: its message says why
        try:
            t.error = f"HTTP {exc.code}: {json.loads(exc.read())['error']['message']}"
        except (ValueError, KeyError, TypeError, OSError):
            t.error = f"HTTP {exc.code}: {exc.reason}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        t.error = f"{type(exc).__name__}: {exc}"
    t.e2e_s = time.perf_counter() - t0
    if t.chunk_times_s:
        t.ttft_s = t.chunk_times_s[0]
    elif t.error is None:
        t.error = "no text arrived"
    return t


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "p50": q(50), "p90": q(90), "p99": q(99), "max": s[-1]}


def run_serving(url: str, *, num_prompts: int, input_len: int, output_len: int, concurrency: int,
                vocab_size: int = 129280, temperature: float = 0.0, seed: int = 0, model: str = "deepinfer",
                request_rate: float | None = None) -> dict[str, Any]:
    """Send the prompts and summarise the timings (milliseconds in the summary). request_rate None: a closed loop
    of `concurrency` clients, each sending its next request when the last one ends; a rate (requests/s): an open
    loop, requests arriving as a Poisson process of that rate (seeded), at most `concurrency` in flight (an
    arrival waits for a free slot, as a client pool would)."""
    import random

    from deepinfer_engine.bench import random_prompts

    prompts = random_prompts(num_prompts, input_len, vocab_size, seed, None)
    timings: list[RequestTiming | None] = [None] * num_prompts
    t0 = time.perf_counter()
    if request_rate is None:
        nxt = iter(range(num_prompts))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                timings[i] = _one(url, prompts[i], output_len, temperature, model)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(max(1, concurrency))]
        for th in threads:
            th.start()
    else:
        rng = random.Random(seed)
        slots = threading.Semaphore(max(1, concurrency))
        threads = []

        def send(i: int) -> None:
            try:
                timings[i] = _one(url, prompts[i], output_len, temperature, model)
            finally:
                slots.release()

        due = 0.0
        for i in range(num_prompts):
            due += rng.expovariate(request_rate)
            time.sleep(max(0.0, due - (time.perf_counter() - t0)))
            slots.acquire()
            threads.append(threading.Thread(target=send, args=(i,), daemon=True))
            threads[-1].start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    done = [t for t in timings if t is not None and t.error is None]
    failed = [t for t in timings if t is None or t.error is not None]
    ms = 1e3
    tpot = [(t.e2e_s - t.ttft_s) / (t.output_tokens - 1) * ms for t in done if t.output_tokens > 1]
    itl = [(b - a) * ms for t in done for a, b in zip(t.chunk_times_s, t.chunk_times_s[1:], strict=False)]
    out_tokens = sum(t.output_tokens for t in done)
    return {
        "benchmark": "serving", "url": url, "num_prompts": num_prompts, "input_len": input_len,
        "output_len": output_len, "concurrency": concurrency, "request_rate": request_rate,
        "completed": len(done), "failed": len(failed),
        "errors": sorted({t.error for t in failed if t is not None and t.error})[:5],
        "duration_s": wall, "requests_per_s": len(done) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + len(done) * input_len) / wall,
        "ttft_ms": _percentiles([t.ttft_s * ms for t in done]), "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles(itl), "e2e_ms": _percentiles([t.e2e_s * ms for t in done]),
    }


def format_serving(r: dict[str, Any]) -> str:
    lines = [f"{' Serving Benchmark Result ':=^60}",
             f"{'Successful requests:':<30}{r['completed']}", f"{'Failed requests:':<30}{r['failed']}",
             f"{'Concurrency:':<30}{r['concurrency']}",
             f"{'Request rate (req/s):':<30}{'closed loop' if r['request_rate'] is None else r['request_rate']}",
             f"{'Duration (s):':<30}{r['duration_s']:.2f}",
             f"{'Request throughput (req/s):':<30}{r['requests_per_s']:.2f}",
             f"{'Output tokens/s:':<30}{r['output_tokens_per_s']:.1f}",
             f"{'Total tokens/s:':<30}{r['total_tokens_per_s']:.1f}"]
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-chunk latency"), ("e2e_ms", "End-to-end latency")):
        p = r[key]
        if p:
            lines.append(f"{'-' * 6} {title} (ms) {'-' * max(0, 46 - len(title))}")
            lines.extend(f"{name + ':':<30}{p[name]:.2f}" for name in ("mean", "p50", "p90", "p99"))
    for e in r["errors"]:
        lines.append(f"error: {e}")
    lines.append("=" * 60)
    return "\n".join(lines)
