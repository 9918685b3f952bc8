"""Test harness: a CudaGraphRunner on CPU whose 'captures' run the fixed-shape (StaticDecodeStep) forward eagerly
on every replay and write its outputs into the tensors the capture returned, as a graph's replay rewrites its
output buffers in place. Exercises the graph path of the runner (padded shapes, static plans, outputs read from
the graph's buffers) without a GPU."""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch
from deepinfer_engine.worker.cuda_graph import CudaGraphRunner

__all__ = ["EagerReplayGraphs"]


class _EagerReplay:
    """Holds the forward weakly, as a CUDA graph holds nothing of the Python objects its kernels read: the runner
    must keep the callable (and so every tensor it closed over) alive with the graph, or the replay fails here."""

    def __init__(self, forward, outputs) -> None:
        self.forward = weakref.WeakMethod(forward) if inspect.ismethod(forward) else weakref.ref(forward)
        self.outputs = outputs

    def replay(self) -> None:
        forward = self.forward()
        if forward is None:
            raise AssertionError("the runner dropped a captured forward: a CUDA graph would read tensors that "
                                 "were freed with it (keep it in the graph's record)")
        out = forward()
        if isinstance(out, torch.Tensor):
            self.outputs.copy_(out)
            return
        for f in dataclasses.fields(out):
            new, old = getattr(out, f.name), getattr(self.outputs, f.name)
            if isinstance(new, torch.Tensor):
                old.copy_(new)
            elif isinstance(new, dict):
                for k, v in new.items():
                    old[k].copy_(v)


class EagerReplayGraphs(CudaGraphRunner):
    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(model, cache, device="cuda", max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.device = torch.device("cpu")  # the constructor only checks the device type; nothing was allocated

    def _record(self, forward, prepare=None, *, pool: str = "shared"):  # one eager "pool": nothing is shared
        out = forward()
        if prepare is not None:  # the static step's freeze, after the forward registered its plans
            prepare()
        return _EagerReplay(forward, out), out
