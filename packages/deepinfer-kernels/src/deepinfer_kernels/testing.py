"""Test helpers for kernel suites (importlib mode forbids test-to-test imports): the Triton CPU interpreter switch.

Imports nothing beyond the standard library at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["triton_interpreter"]


@contextlib.contextmanager
def triton_interpreter(*module_names: str) -> Iterator[list[ModuleType]]:
    """Import the named Triton backend modules afresh with TRITON_INTERPRET=1 and yield them.

    triton.jit reads TRITON_INTERPRET (triton.knobs.runtime.interpret) when the decorator runs, i.e. when the
    backend module is imported, and then returns either a compiled JITFunction or an InterpretedFunction. So the
    variable must be set before the import, and a module imported earlier without it (a GPU test in the same
    process) must be re-imported. The same holds for triton's own jit-decorated library functions (`tl.zeros`,
    `tl.max`, ... in triton.language.standard, decorated when triton is first imported): if triton was imported
    without the interpreter (e.g. by `torch._dynamo`), its Python modules are imported afresh too (the C
    extension `triton._C` is kept). On exit the environment variable, `sys.modules` entries and the parent
    package attributes are restored (so `from pkg import triton` in a dispatcher sees the original again).
    """
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved = {name: sys.modules.get(name) for name in module_names}
    saved_triton: dict[str, ModuleType] = {}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        standard = sys.modules.get("triton.language.standard")
        if standard is not None and type(standard.zeros).__name__ != "InterpretedFunction":
            saved_triton = {
                k: m
                for k, m in sys.modules.items()
                if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")
            }
            for k in saved_triton:
                del sys.modules[k]
        for name in module_names:
            sys.modules.pop(name, None)
        yield [importlib.import_module(name) for name in module_names]
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_triton:
            for k in [
                k
                for k in sys.modules
                if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")
            ]:
                del sys.modules[k]
            sys.modules.update(saved_triton)
        for name, module in saved.items():
            parent_name, _, child = name.rpartition(".")
            parent = sys.modules.get(parent_name)
            if module is None:
                sys.modules.pop(name, None)
                if parent is not None and hasattr(parent, child):
                    delattr(parent, child)
            else:
                sys.modules[name] = module
                if parent is not None:
                    setattr(parent, child, module)
