"""Side streams of a decode-sized step: independent work runs beside the main stream (docs/overlap.md).

At small batches most decode kernels are latency-bound: a 2-40 MB weight read takes 5-20 µs of which the bytes
need 1-10, and the SMs and the memory system idle in between. Work that does not depend on the main stream's
latest results can fill that idle time:

- the shared expert of a MoE layer beside the router and the routed experts (joined at the combine);
- the attention query's up-projection (wq_b, the largest attention weight) and rope beside the window KV write and
  the compressed-entry selection (compressor, indexer; joined before the attention kernel);
- the Engram key/value projection of the next layer (its inputs are token ids only) beside the current layer;
- with delayed mHC (V4.1), each sub-layer's mHC mixes beside the sub-layer itself: its input was collapsed with the
  previous sub-layer's pre, so its own pre / post / comb are needed only when its output is combined.

Fork / join are CUDA events, so a captured CUDA graph records them as parallel branches. Memory stays safe without
`record_stream` because every side segment starts with a fork from the main stream (it is ordered after every main
kernel enqueued before it, so it never reuses a block a pending main kernel reads) and is joined before the main
stream drops its last reference to the segment's inputs and before it reads the segment's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["OVERLAP_MAX_TOKENS", "Overlapped", "SideStreams", "join", "run_beside"]

# Above this many tokens a step is compute-bound enough that the main stream's kernels fill the GPU alone (and the
# Engram prefetch would hold T x 5d fp32 per engram layer): the side streams are not used.
OVERLAP_MAX_TOKENS = 256

@dataclass(frozen=True)
class SideStreams:
    """The side streams of one CUDA device: one per kind of side work, so the kinds never wait for each other."""

    device: torch.device
    shared_expert: torch.cuda.Stream
    prefetch: torch.cuda.Stream
    query: torch.cuda.Stream
    mix: torch.cuda.Stream

    @classmethod
    def create(cls, device: torch.device) -> SideStreams:
        return cls(device, *(torch.cuda.Stream(device) for _ in range(4)))


@dataclass(frozen=True)
class Overlapped:
    """The result of side work and the event the main stream joins before reading it."""

    value: object
    done: torch.cuda.Event


def run_beside(stream: torch.cuda.Stream, fn: Callable[..., object], *args: object) -> Overlapped:
    """Enqueue fn(*args) on `stream`, after everything the current stream has enqueued so far; returns its result
    (to be read only after `join`)."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        value = fn(*args)
        done = torch.cuda.Event()
        done.record(stream)
    return Overlapped(value, done)


def join(work: Overlapped) -> object:
    """Make the current stream wait for the side work; returns its result."""
    torch.cuda.current_stream().wait_event(work.done)
    return work.value
