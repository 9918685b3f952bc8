"""Programmatic dependent launch (PDL) for Triton launches: may this launch use it, and with which launch keywords.

A caller opts in per call (``pdl=True`` on the public ops that support it; a model threads one flag from its
config), never through process state. The rules a kernel must follow to be launched this way are in docs/pdl.md.
Imports no triton at import time.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_CAPABILITY", "launch_kwargs", "triton_has_pdl", "use_pdl"]

# griddepcontrol (the in-kernel wait / trigger) and the programmatic launch attribute exist from Hopper (sm_90) on
MIN_CAPABILITY = (9, 0)


def triton_has_pdl() -> bool:
    """True when the installed triton has both halves: the in-kernel `gdc_wait` / `gdc_launch_dependents`
    (triton.language.extra.cuda, triton >= 3.6 spells them so) and the ``launch_pdl`` launch option of its CUDA
    backend. False when triton is missing or older."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents") and "launch_pdl" in fields


def use_pdl(requested: bool, device: torch.device, *, interpreted: bool) -> bool:
    """Whether one launch on `device` runs with PDL: the caller asked for it, the kernel is compiled (the CPU
    interpreter cannot run griddepcontrol, so there the PDL variant is built with the wait compiled out, which is
    the plain kernel), the device is CUDA of compute capability >= 9.0, and triton has the API. Anything else
    launches as usual, which is always correct: the request is a speed hint, never a semantic change."""
    if not requested or interpreted or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY and triton_has_pdl()


def launch_kwargs(on: bool) -> dict[str, bool]:
    """Extra keywords of a Triton launch ``kernel[grid](..., **launch_kwargs(on))``: the programmatic stream
    serialization attribute when on (CUDA-graph capture records it as a programmatic edge), nothing when off."""
    return {"launch_pdl": True} if on else {}
