"""Wall-clock wrappers around named methods or functions, for the benchmark scripts: inclusive seconds and calls per
phase since the last `take()`. About 1 µs per call, so unlike cProfile they do not inflate the Python work timed.

A phase is (name, module, owner, attribute): owner a class name, or None for a module-level function (the wrapper
is set on the module, so only callers that look it up there at call time are timed). The wrappers stay for the
process."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PhaseTimer", "wrap_phases"]


def wrap_phases(phases: Sequence[tuple[str, str, str | None, str]], wrap: Callable[[str, Any], Any]) -> None:
    """Replace each phase's method or function by `wrap(name, original)` (for the process's lifetime); a phase that
    is not found is reported on stderr and skipped."""
    for name, module, owner, attr in phases:
        mod = importlib.import_module(module)
        target = mod if owner is None else getattr(mod, owner, None)
        if target is None or not hasattr(target, attr):
            print(f"phase {name}: {module}.{owner}.{attr} not found, not wrapped", file=sys.stderr)
            continue
        setattr(target, attr, wrap(name, getattr(target, attr)))


class PhaseTimer:
    def __init__(self, phases: Sequence[tuple[str, str, str | None, str]]) -> None:
        self.phases = tuple(phases)
        self.sums: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        wrap_phases(self.phases, self._wrap)

    def _wrap(self, name: str, fn: Any) -> Any:
        sums, calls = self.sums, self.calls

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sums[name] = sums.get(name, 0.0) + time.perf_counter() - t0
                calls[name] = calls.get(name, 0) + 1

        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, calls) per phase since the last take."""
        out = dict(self.sums), dict(self.calls)
        self.sums.clear()
        self.calls.clear()
        return out
