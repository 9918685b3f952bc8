"""Applies a step's prefix-cache `CacheOps` (core.cache_ops) to the model's cache before the forward
(docs/prefix_cache.md). The one hook of the prefix cache in the model runner.

Host-tier transfers run on a side CUDA stream (non-blocking copies from / into pinned memory) that first waits
for the work already queued on the compute stream (an offloaded page must be complete) and that the compute
stream waits for before the forward: the copies overlap whatever is still queued ahead of them. On CPU they
are plain copies.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_engine.core.cache_ops import CacheOps

__all__ = ["apply_cache_ops"]


def apply_cache_ops(cache: Any, ops: CacheOps) -> None:
    """Snapshots, offloads, loads, page copies, slot clones / state restores, token histories, floors, then arm the
    captures for the forward that follows (`cache.copy_stream`: the CUDA stream of the host-tier transfers)."""
    cache.captures.clear()  # captures left armed by a step whose forward failed must not fire now
    cache.draft_captures.clear()
    for src, dst, pos in ops.snapshots:  # state blocks of sequences that stopped at a page boundary last step
        cache.clone_slot(src, dst, pos)
    if ops.offload or ops.load:
        copy_stream = getattr(cache, "copy_stream", None)
        if copy_stream is not None:
            main = torch.cuda.current_stream()
            copy_stream.wait_stream(main)
            with torch.cuda.stream(copy_stream):
                cache.offload_pages(ops.offload)
                cache.load_pages(ops.load)
            main.wait_stream(copy_stream)
        else:
            cache.offload_pages(ops.offload)
            cache.load_pages(ops.load)
    if ops.copy_pages:
        cache.copy_pages(ops.copy_pages)
    for src, dst, pos in ops.clone_slots:
        cache.clone_slot(src, dst, pos)
    for src, dst, pos in ops.restore:
        cache.clone_slot(src, dst, pos)
    for h in ops.history:
        cache.set_token_history(h.slot, h.position, h.ids)
    for f in ops.floors:
        cache.set_floors(f.slot, f.window_floor, f.write_floor)
    for c in ops.captures:
        cache.arm_capture(c.slot, c.position, c.dest)
