"""Move one MoE layer's expert weights between EP ranks when the placement changes (docs/parallel.md, "EPLB").

Weights stay in whatever format the engine keeps them in (FP4 packed uint8 + UE8M0 scales, FP8 + scales, bf16):
every tensor is a stack `[slots_per_rank, ...]` indexed by local slot, and is moved as raw bytes, so any dtype
works and the bytes arrive unchanged. Copies inside a rank are local; an expert a rank does not hold yet comes
from one old holder, chosen the same way on every rank, through point-to-point sends batched in one
`batch_isend_irecv` (each expert crosses the wire once per receiving rank). The tensors are updated in place, so
their addresses (captured CUDA graphs, engine references) stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer_parallel.errors import PlacementError
from deepinfer_parallel.state import ParallelState

__all__ = ["TransferPlan", "move_expert_weights", "plan_transfers"]

TransferPlan = dict[tuple[int, int], list[int]]  # (src ep rank, dst ep rank) -> logical experts, ascending


def _holders(old: list[int], slots_per_rank: int) -> dict[int, list[int]]:
    """Logical expert -> EP ranks holding it under `old` (ascending, unique)."""
    out: dict[int, list[int]] = {}
    for slot, e in enumerate(old):
        r = slot // slots_per_rank
        ranks = out.setdefault(e, [])
        if not ranks or ranks[-1] != r:
            ranks.append(r)
    return out


def plan_transfers(old_phy2log: Sequence[int], new_phy2log: Sequence[int], ep_size: int) -> TransferPlan:
    """Which experts each rank must receive from which rank: a rank needs every expert of its new slots that none
    of its old slots holds; the source is old holder number `dst mod holders` (spreads senders, same on every
    rank). Pure function of the two `[num_physical]` maps."""
    old, new = list(old_phy2log), list(new_phy2log)
    if len(old) != len(new) or len(old) % ep_size:
        raise PlacementError(
            f"phy2log: expected two maps of equal length divisible by ep_size={ep_size}, found {len(old)} and {len(new)}"
        )
    spr = len(old) // ep_size
    holders = _holders(old, spr)
    plan: TransferPlan = {}
    for dst in range(ep_size):
        have = set(old[dst * spr : (dst + 1) * spr])
        for e in sorted(set(new[dst * spr : (dst + 1) * spr]) - have):
            if e not in holders:
                raise PlacementError(f"new placement: logical expert {e} is held by no slot of the old placement")
            src = holders[e][dst % len(holders[e])]
            plan.setdefault((src, dst), []).append(e)
    return plan


def _as_bytes(t: Tensor) -> Tensor:
    """The same storage seen as bytes (`t` is a fresh contiguous buffer), so any dtype crosses the wire."""
    return t.view(torch.uint8)


def move_expert_weights(
    tensors: Sequence[Tensor], old_phy2log: Tensor, new_phy2log: Tensor, state: ParallelState
) -> int:
    """Rearrange this rank's expert tensors of one layer from `old_phy2log` to `new_phy2log` (`[num_physical]`,
    EP rank g owns slots [g*S, (g+1)*S)). tensors: every per-expert tensor of the layer, each `[S, ...]` of any
    dtype (weights and their scales). Collective over the EP group: every rank calls it with the same maps.
    Returns the bytes this rank received."""
    ep, me = state.ep_size, state.ep_rank
    old, new = old_phy2log.tolist(), new_phy2log.tolist()
    plan = plan_transfers(old, new, ep)
    spr = len(old) // ep
    for t in tensors:
        if t.dim() < 1 or t.shape[0] != spr:
            raise PlacementError(f"expert tensor: expected [{spr}, ...] (one row per local slot), found {tuple(t.shape)}")
    old_local, new_local = old[me * spr : (me + 1) * spr], new[me * spr : (me + 1) * spr]
    if old_local == new_local and not any(src == me for src, _ in plan):
        return 0
    first_slot = {}
    for i, e in enumerate(old_local):
        first_slot.setdefault(e, i)

    def peer(ep_rank: int) -> int:
        return state.ep_global_rank(ep_rank)

    ops: list[dist.P2POp] = []
    received: dict[int, list[Tensor]] = {}  # logical expert -> one row per tensor
    pending: list[tuple[list[int], list[Tensor]]] = []
    for (src, dst), experts in sorted(plan.items()):
        if src == me:
            idx = torch.tensor([first_slot[e] for e in experts], device=tensors[0].device)
            for k, t in enumerate(tensors):
                ops.append(dist.P2POp(dist.isend, _as_bytes(t.index_select(0, idx)), peer(dst), state.ep_group,
                                      tag=k))
        if dst == me:
            bufs = [torch.empty((len(experts), *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensors]
            for k, b in enumerate(bufs):
                ops.append(dist.P2POp(dist.irecv, _as_bytes(b), peer(src), state.ep_group, tag=k))
            pending.append((experts, bufs))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    nbytes = 0
    for experts, bufs in pending:
        for i, e in enumerate(experts):
            received[e] = [b[i] for b in bufs]
        nbytes += sum(b.numel() * b.element_size() for b in bufs)
    # Local rows may be overwritten below while still needed as a source for another local slot: snapshot them.
    snapshot = [t.clone() for t in tensors]
    for j, e in enumerate(new_local):
        if old_local[j] == e:
            continue
        for k, t in enumerate(tensors):
            t[j].copy_(snapshot[k][first_slot[e]] if e in first_slot else received[e][k])
    return nbytes
