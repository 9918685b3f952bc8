"""Small launch helpers shared by the Triton backend files (grid sizes, interpreter detection). Imports no triton."""

from __future__ import annotations

import torch

from deepinfer_kernels._backend import KernelBackendError

__all__ = ["cdiv", "check_launchable", "is_interpreted", "next_pow2", "target_programs"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_interpreted(kernel: object) -> bool:
    """True when triton.jit built the CPU interpreter object (TRITON_INTERPRET was set when the backend file was
    imported). Checked by type name because the class moved between triton releases (3.6 .. 3.9)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(op: str, kernel: object, *tensors: torch.Tensor) -> bool:
    """Raise when CPU tensors meet a compiled kernel (or CUDA tensors the interpreter); return is_interpreted."""
    interp = is_interpreted(kernel)
    on_cpu = [t.device.type == "cpu" for t in tensors]
    if interp and not all(on_cpu):
        raise KernelBackendError(
            f"{op}: the triton backend was imported with TRITON_INTERPRET=1 and needs CPU tensors"
        )
    if not interp and any(on_cpu):
        raise KernelBackendError(
            f"{op}: CPU tensors need the triton interpreter, but the backend module was imported without "
            "TRITON_INTERPRET=1 (set it before the first triton-backend call of the process)"
        )
    return interp


def target_programs(device: torch.device) -> int:
    """Programs needed to fill the GPU about twice (split-K decisions); a small fixed number on the interpreter."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count
