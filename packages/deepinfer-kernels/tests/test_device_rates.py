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


def test_device_state_reads_nvml_through_torch_and_gives_up_quietly(monkeypatch):
    """CUDA: SM clock, temperature and power (mW -> W) as torch.cuda reports them; None off CUDA and wherever the
    telemetry cannot be read (no NVML binding on the machine)."""
    import torch
    from deepinfer_kernels.device_rates import device_state

    assert device_state("cpu") is None
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda dev: 1755)
    monkeypatch.setattr(torch.cuda, "temperature", lambda dev: 61)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda dev: 512_000)
    assert device_state("cuda:0") == {"sm_clock_mhz": 1755.0, "temperature_c": 61.0, "power_w": 512.0}

    def missing(dev):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", missing)
    assert device_state("cuda:0") is None
