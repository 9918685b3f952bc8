"""Kernel-suite hooks: on machines without CUDA, import triton once in interpreter mode before any test does.

triton.jit picks "interpreted" vs "compiled" when a function is decorated, and triton's own library functions
(`tl.zeros`, `tl.max`, ...) are decorated when triton is first imported. Importing it here with
TRITON_INTERPRET=1 (then restoring the variable) keeps the whole CPU session on the interpreter without the
re-import fallback of `kernels_testing.triton_interpreter` (tests/support). No effect when CUDA is present or triton
is missing or already imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    import torch

    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
