"""Test helpers: run a function on several gloo ranks on the CPU (`run_ranks`). Imports torch only; nothing runs at
import time."""

from __future__ import annotations

import importlib.util
import inspect
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _child(rank: int, world_size: int, port: int, target: Any, args: tuple, threads: int) -> None:
    import torch

    # Forked children must not enter the parent's OpenMP pool; one intra-op thread is also right for tiny tensors
    # on shared cores (the DataLoader-worker rule).
    torch.set_num_threads(threads)
    fn = _load(*target) if isinstance(target, tuple) else target
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., None], world_size: int, *args: Any, threads: int = 1, start_method: str = "fork"
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` child processes joined in one gloo process group (CPU).

    start_method "fork" (default, Linux): children inherit the imported modules, so start-up costs milliseconds
    instead of one `import torch` per rank; use it only before any CUDA initialisation in the parent.
    "spawn": fn must be a module-level function; it is re-imported from its source file in each child (pytest's
    importlib mode makes test modules unimportable by name) and args must be picklable.
    An exception in any rank is re-raised here (torch.multiprocessing.ProcessRaisedException).
    """
    if start_method == "spawn":
        file = inspect.getsourcefile(fn)
        if file is None:
            raise ValueError(f"fn: expected a function defined in a source file, found {fn!r}")
        target: Any = (file, fn.__qualname__)
    elif start_method == "fork":
        target = fn
    else:
        raise ValueError(f"start_method: expected 'fork' or 'spawn', found {start_method!r}")
    mp.start_processes(
        _child,
        args=(world_size, free_port(), target, args, threads),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
