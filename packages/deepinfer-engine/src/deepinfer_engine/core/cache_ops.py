"""Cache operations the model runner applies before a step's forward (docs/prefix_cache.md). Pure Python.

The scheduler decides, the runner moves tensors: every op names slot ids, page ids or host-tier ids handed out
by the torch-free cache manager. Order of application (`worker.cache_ops.apply_cache_ops`): snapshots, offloads (device page -> host),
loads (host -> device page), page copies, slot clones, state restores, token histories, replay floors; captures
are armed for the forward itself (they read rows the forward computes).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheOps", "Capture", "ReplayFloor", "TokenHistory"]


@dataclass(frozen=True, kw_only=True)
class TokenHistory:
    """Token ids of positions [position - len(ids), position) of the sequence in `slot` (Engram n-gram history
    of a sequence that resumes at `position` without having computed what precedes it in this slot)."""

    slot: int
    position: int
    ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ReplayFloor:
    """Per-slot floors of a sequence placed in `slot` this step (both 0 for a sequence without a replayed hit).

    window_floor: positions below it are not visible through the sliding window (approximate replay: the window
    rows before the replay start were never cached). write_floor: compressed entries (and index keys) of tokens
    below it are not written (they live in shared cached pages)."""

    slot: int
    window_floor: int = 0
    write_floor: int = 0


@dataclass(frozen=True, kw_only=True)
class Capture:
    """During this step's forward, copy the ring rows a step starting at `position` would read (every backbone
    layer's window ring and compressor state ring; the draft layers' rings when the drafter writes them after the
    forward) from the sequence in `slot` into state slot `dest`."""

    slot: int
    position: int
    dest: int


@dataclass(frozen=True, kw_only=True)
class CacheOps:
    # (slot, state slot, position): copy a slot whose sequence stopped exactly at a page boundary in the previous
    # step into a state block; applied first (a capture that needs no rows of the forward: decode steps stay
    # free of captures, so fixed-shape CUDA-graph steps never carry one)
    snapshots: tuple[tuple[int, int, int], ...] = ()
    offload: tuple[tuple[int, int], ...] = ()  # (device page, host page): save an evicted cached page
    load: tuple[tuple[int, int], ...] = ()  # (host page, device page): bring a cached page back
    copy_pages: tuple[tuple[int, int], ...] = ()  # (src page, dst page)
    clone_slots: tuple[tuple[int, int, int], ...] = ()  # (src slot, dst slot, position the state is valid at)
    restore: tuple[tuple[int, int, int], ...] = ()  # (state slot, dst slot, position the state block was taken at)
    history: tuple[TokenHistory, ...] = ()
    floors: tuple[ReplayFloor, ...] = ()
    captures: tuple[Capture, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.snapshots or self.offload or self.load or self.copy_pages or self.clone_slots or self.restore
                    or self.history or self.floors or self.captures)
