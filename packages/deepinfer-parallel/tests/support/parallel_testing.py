"""Test helpers: run a function on several gloo ranks on the CPU (`run_ranks`). Nothing runs at import time."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from typing import Any

from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.launch import spawn_ranks
from deepinfer_parallel.state import ParallelState

__all__ = ["run_ranks"]


def _load(file: str, qualname: str) -> Callable[..., Any]:
    # Test modules are imported by pytest in importlib mode and are not importable by name in a spawned child, so
    # the child loads the function's file itself.
    spec = importlib.util.spec_from_file_location(f"_deepinfer_rank_module_{abs(hash(file))}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _by_file(state: ParallelState, file: str, qualname: str, *args: Any) -> Any:
    return _load(file, qualname)(state, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    config: ParallelConfig | None = None,
    timeout_s: float = 60.0,
    start_method: str = "fork",
    backend: str = "gloo",
    devices: list[str] | None = None,
) -> list[Any]:
    """Run `fn(state: ParallelState, *args)` on `world_size` ranks (gloo on the CPU by default; backend="nccl"
    with devices and start_method="spawn" for GPU tests); return the results by rank.

    start_method "fork" (default, Linux): children inherit the imported modules, so start-up costs milliseconds
    instead of one `import torch` per rank; use it only before any CUDA initialisation in the parent.
    "spawn": fn must be a module-level function; it is re-imported from its source file in each child.
    A failing rank raises RankFailedError here; every rank is gone when this returns or raises.
    """
    if start_method == "spawn":
        file = inspect.getsourcefile(fn)
        if file is None:
            raise ValueError(f"fn: expected a function defined in a source file, found {fn!r}")
        return spawn_ranks(_by_file, world_size, file, fn.__qualname__, *args, config=config, backend=backend,
                           devices=devices, start_method="spawn", timeout_s=timeout_s)
    return spawn_ranks(fn, world_size, *args, config=config, backend=backend, devices=devices,
                       start_method=start_method, timeout_s=timeout_s)
