"""`deepinfer_kernels._pdl`: when a launch may use programmatic dependent launch, and its launch keywords."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels import _pdl


def test_off_unless_requested_compiled_and_on_cuda():
    cuda = torch.device("cuda", 0)
    assert not _pdl.use_pdl(False, cuda, interpreted=False)
    assert not _pdl.use_pdl(True, cuda, interpreted=True)  # the interpreter cannot run griddepcontrol
    assert not _pdl.use_pdl(True, torch.device("cpu"), interpreted=False)
    assert _pdl.launch_kwargs(False) == {}
    assert _pdl.launch_kwargs(True) == {"launch_pdl": True}


@pytest.mark.parametrize(("capability", "want"), [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_needs_hopper_and_triton(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: True)
    assert _pdl.use_pdl(True, torch.device("cuda", 0), interpreted=False) is want
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: False)
    assert not _pdl.use_pdl(True, torch.device("cuda", 0), interpreted=False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_installed_triton_has_the_api():
    """triton >= 3.6 (the package's floor) has gdc_wait / gdc_launch_dependents and the launch_pdl option."""
    assert _pdl.triton_has_pdl()
