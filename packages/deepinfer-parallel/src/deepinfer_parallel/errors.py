"""Typed errors of deepinfer-parallel (the engine maps them onto its own ConfigError / CapacityError)."""

from __future__ import annotations

__all__ = ["ParallelConfigError", "PlacementError"]


class ParallelConfigError(ValueError):
    """A parallel / EPLB / sizing argument is invalid; the message names the field, the value and what is expected."""


class PlacementError(ValueError):
    """An expert placement (phy2log / log2phy / logcnt) or an id tensor routed through it is inconsistent."""
