"""Typed errors of deepinfer-parallel (the engine maps them onto its own ConfigError / CapacityError)."""

from __future__ import annotations

__all__ = ["ParallelConfigError", "PlacementError", "RankFailedError"]


class ParallelConfigError(ValueError):
    """A parallel / EPLB / sizing argument is invalid; the message names the field, the value and what is expected."""


class PlacementError(ValueError):
    """An expert placement (phy2log / log2phy / logcnt) or an id tensor routed through it is inconsistent."""


class RankFailedError(RuntimeError):
    """A rank of a spawned world raised, was killed, exited without a result or outlived the timeout.

    rank: the first rank seen failing (-1 when the whole world timed out); exitcode: its exit status (negative =
    killed by that signal, None = still running when the timeout hit); detail: the rank's traceback or a reason.
    Every other rank has been terminated by the time this is raised.
    """

    def __init__(self, rank: int, exitcode: int | None, detail: str) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.detail = detail
        who = "the world" if rank < 0 else f"rank {rank}"
        super().__init__(f"{who} failed (exit code {exitcode}): {detail}")
