"""Physical rates of the device a benchmark runs on, measured in the same run as the times they bound: the copy
bandwidth (bytes bound = bytes / it) and the bf16 matmul rate (FLOP bound = FLOPs / it). One implementation for
the kernel benchmarks and the engine's `bench latency`, so their "% of bound" columns are comparable. And the
device's state when a time was taken (`device_state`: SM clock, temperature, power), which an issue-bound kernel's
time follows."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["device_state", "measure_copy_bandwidth", "measure_matmul_rate"]


def measure_copy_bandwidth(device: Any, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes read + written per second of a device-to-device copy of `nbytes` (CUDA events, median of `iters`)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device, iters)


def measure_matmul_rate(device: Any, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on random inputs (median of `iters`)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / _median_seconds(lambda: a @ b, device, iters)


def device_state(device: Any) -> dict[str, float] | None:
    """The CUDA device's SM clock (MHz, NVML's last sample period), temperature (°C) and power draw (W) now, or None
    where they cannot be read (not CUDA, no NVML binding installed, NVML refuses). A benchmark records them beside
    each time: under sustained load the SM clock drops, and kernels bound by instruction issue slow with it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        return {"sm_clock_mhz": float(torch.cuda.clock_rate(dev)), "temperature_c": float(torch.cuda.temperature(dev)),
                "power_w": torch.cuda.power_draw(dev) / 1e3}  # fmt: skip
    except Exception:  # NVML is optional telemetry (ModuleNotFoundError, NVMLError, ...): not recorded
        return None


def _median_seconds(fn: Callable[[], object], device: Any, iters: int) -> float:
    dev = torch.device(device)
    fn()  # warm-up: allocation, handle creation, kernel selection
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
