"""Root pytest hooks: skip `gpu` / `multigpu(n)` tests with a visible reason when devices are missing."""

from __future__ import annotations

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # the recipe's isolated environment has no torch
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") or item.get_closest_marker("multigpu") for item in items):
        return
    count = _cuda_device_count()
    for item in items:
        if item.get_closest_marker("gpu") and count == 0:
            item.add_marker(pytest.mark.skip(reason="gpu test: no CUDA device on this machine"))
        marker = item.get_closest_marker("multigpu")
        if marker is not None:
            need = int(marker.args[0]) if marker.args else 2
            if count < need:
                item.add_marker(pytest.mark.skip(reason=f"multigpu test: needs {need} CUDA devices, found {count}"))
