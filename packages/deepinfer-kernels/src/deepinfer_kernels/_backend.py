"""Kernel backend selection shared by every op family: `"auto" | "torch" | "triton"`.

Reads `DEEPINFER_KERNEL_BACKEND` and `TRITON_INTERPRET` at call time, imports triton only inside functions (an
availability probe), and keeps no state: the same arguments and environment always give the same answer.
"""

from __future__ import annotations

import os
from typing import Literal

from torch import Tensor

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "Backend",
    "KernelBackendError",
    "backend_from_env",
    "interpreter_enabled",
    "resolve_backend",
    "triton_available",
]

Backend = Literal["auto", "torch", "triton", "device", "triton-where-supported"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
# Resolved forms a model computes once at build (`backend_from_env`) and passes to every op, so no call reads the
# environment: "device" = auto without the variable; "triton-where-supported" = DEEPINFER_KERNEL_BACKEND=triton.
RESOLVED: tuple[str, ...] = ("torch", "device", "triton-where-supported")
ENV_VAR = "DEEPINFER_KERNEL_BACKEND"
# Same truthy spellings as triton's own env_bool knob parser (TRITON_INTERPRET is read by triton.jit).
_TRUE = ("1", "true", "on", "yes")


class KernelBackendError(ValueError):
    """A requested kernel backend cannot run these inputs (message: op, what was found, what is needed)."""


def triton_available() -> bool:
    """True when `import triton` succeeds (after the first import this is a sys.modules lookup)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET is set: triton.jit then builds CPU-interpreted kernels (decided at decoration)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def backend_from_env() -> Literal["torch", "device", "triton-where-supported"]:
    """The backend a model resolves once at build from `DEEPINFER_KERNEL_BACKEND` (unset / auto -> "device",
    torch -> "torch", triton -> "triton-where-supported"); raises KernelBackendError for any other value."""
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env not in ("",) + BACKENDS:
        raise KernelBackendError(f"{ENV_VAR}={env!r}, expected one of {BACKENDS} or unset")
    return {"": "device", "auto": "device", "torch": "torch", "triton": "triton-where-supported"}[env]


def resolve_backend(
    op: str, backend: str, *tensors: Tensor, triton_ok: bool = True, why_not: str = ""
) -> Literal["torch", "triton"]:
    """Pick the backend for one call of `op`.

    - `"torch"`: the reference, always.
    - `"triton"`: the Triton kernel; raises KernelBackendError when the op has no kernel for these inputs
      (`triton_ok=False`, reason in `why_not`), triton is missing, or the tensors are not all on CUDA (CPU
      tensors are accepted only with TRITON_INTERPRET=1, the interpreter used by the CPU tests).
    - `"auto"`: `DEEPINFER_KERNEL_BACKEND` decides when set (`torch` forces the references everywhere for
      parity debugging; `triton` acts as an explicit request for every op that has a kernel for the inputs and
      keeps the reference for the others; `auto`/unset: triton when every tensor is on CUDA, the op supports
      the inputs and triton imports, else the reference). An explicit `backend` argument is never overridden.
    """
    if backend == "device":  # resolved at model build: auto without reading the environment
        on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
        return "triton" if (triton_ok and on_cuda and triton_available()) else "torch"
    if backend == "triton-where-supported":
        if not triton_ok:
            return "torch"
        backend = "triton"
    if backend not in BACKENDS:
        raise KernelBackendError(f"{op}: backend={backend!r}, expected one of {BACKENDS + RESOLVED[1:]}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env not in ("",) + BACKENDS:
            raise KernelBackendError(f"{op}: {ENV_VAR}={env!r}, expected one of {BACKENDS} or unset")
        if env == "torch":
            return "torch"
        if env == "triton":
            if not triton_ok:
                return "torch"
            backend = "triton"
        else:
            on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
            return "triton" if (triton_ok and on_cuda and triton_available()) else "torch"
    if backend == "torch":
        return "torch"
    if not triton_ok:
        raise KernelBackendError(
            f"{op}: backend='triton' has no kernel for these inputs ({why_not}); use 'torch'"
        )
    if not triton_available():
        raise KernelBackendError(
            f"{op}: backend='triton' but triton is not importable; install deepinfer-kernels[gpu] or use 'torch'"
        )
    devices = sorted({t.device.type for t in tensors})
    if devices != ["cuda"] and not (devices == ["cpu"] and interpreter_enabled()):
        raise KernelBackendError(
            f"{op}: backend='triton' needs every tensor on CUDA (or on CPU with TRITON_INTERPRET=1); "
            f"found devices {devices}"
        )
    return "triton"
