"""The device-rate probes run on the CPU too and report rates of the right size for what they time."""

from __future__ import annotations

from deepinfer_kernels.device_rates import measure_copy_bandwidth, measure_matmul_rate


def test_copy_bandwidth_counts_read_and_write_bytes():
    bw = measure_copy_bandwidth("cpu", nbytes=1 << 20, iters=3)
    # 2 MiB moved per copy: a CPU memcpy of 1 MiB runs at 0.1-1000 GB/s, whatever this machine is
    assert 1e8 < bw < 1e12


def test_matmul_rate_counts_two_flops_per_multiply_add():
    rate = measure_matmul_rate("cpu", n=64, iters=3)
    assert 1e6 < rate < 1e13
