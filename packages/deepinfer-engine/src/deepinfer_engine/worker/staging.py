"""Small host arrays of one step -> device tensors with ONE non-blocking copy, from persistent pinned buffers.

`HostStaging.stage(parts)` packs every part (a list / NumPy array and its dtype) into a pinned byte buffer at
8-byte aligned offsets, copies the used bytes into a fresh device allocation in one `copy_(non_blocking=True)`,
and returns typed views of it (one per part, in the part's shape). A plain `torch.tensor(..).pin_memory()` per
array costs a pinned allocation, a host copy and a copy launch each; here a step pays one NumPy write per part
and one copy launch in all.

Reuse of a pinned buffer is the hazard: the copy of step k reads it after the call returns (asynchronously), and
with asynchronous scheduling step k + 1 is staged while step k may not have been copied yet. The buffers are
used in turn (`slots` of them, default 4: a step stages up to two packs, placeholder sources and sampling
parameters, and two steps are in flight) and each records an event after its copy; a buffer is rewritten only
once that event has completed (a query; a wait only when the copy staged `slots` calls earlier is still
pending). The device side is a new allocation per call (the caching allocator's, stream-ordered), so views
handed out earlier are never overwritten. On CPU there is nothing to copy: the parts become fresh tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from deepinfer_engine.errors import ConfigError, InputError

__all__ = ["HostStaging"]

_ALIGN = 8  # bytes: every dtype staged here (int32/int64/float32/float64) views an 8-byte aligned offset
_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
       torch.bool: np.bool_}


def _np_dtype(dtype: torch.dtype) -> type:
    try:
        return _NP[dtype]
    except KeyError:
        raise InputError(f"host staging: found dtype {dtype}, expected one of {sorted(map(str, _NP))}; convert the "
                         "values first") from None


class _Slot:
    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.np = self.host.numpy()
        self.event = torch.cuda.Event()  # recorded after the latest copy out of this buffer
        self.pending = False  # the event was recorded and not yet seen completed


class HostStaging:
    """Pinned staging buffers of one device, reused across steps (see the module docstring)."""

    def __init__(self, device: torch.device | str, *, slots: int = 4, nbytes: int = 4096) -> None:
        if slots < 1:
            raise ConfigError(f"host staging: found {slots} slots, expected >= 1")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._slots = [_Slot(nbytes) for _ in range(slots)] if self.cuda else []
        self._next = 0
        self.waits = 0  # how often a buffer was still being copied when its turn came (diagnostic)

    def tensor(self, values: object, dtype: torch.dtype) -> Tensor:
        """One host array (list, nested list, NumPy array) as a device tensor."""
        return self.stage([(values, dtype)])[0]

    def stage(self, parts: Sequence[tuple[object, torch.dtype]]) -> list[Tensor]:
        """Device tensors of `parts` ((values, dtype) each, any shape), all from one host -> device copy."""
        arrays = [np.asarray(v, dtype=_np_dtype(dt)) for v, dt in parts]
        if not self.cuda:
            return [torch.from_numpy(np.array(a, copy=True)).to(self.device) for a in arrays]
        offs, total = [], 0
        for a in arrays:
            offs.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        slot = self._acquire(max(total, _ALIGN))
        for a, o in zip(arrays, offs):
            slot.np[o : o + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
        dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
        dev.copy_(slot.host[: dev.shape[0]], non_blocking=True)
        slot.event.record()
        slot.pending = True
        return [dev[o : o + a.nbytes].view(dt).view(a.shape) for a, o, (_, dt) in zip(arrays, offs, parts)]

    def _acquire(self, nbytes: int) -> _Slot:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot.pending:
            if not slot.event.query():  # this buffer's previous copy has not run yet
                self.waits += 1
                slot.event.synchronize()
            slot.pending = False
        if slot.np.shape[0] < nbytes:  # free to drop: its last copy completed above
            slot = self._slots[i] = _Slot(1 << (nbytes - 1).bit_length())
        return slot
