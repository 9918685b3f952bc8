"""Reference expert-parallel dispatch / combine over torch.distributed `all_to_all_single` with uneven splits
(runtime.md §4.4 (2)): every (token, expert) pair travels to the EP rank that owns its physical slot, the rank runs
its local experts, and the results travel back and are summed with the routing weights. Works on gloo (CPU) and
NCCL; one host sync per call for the split sizes (not CUDA-graph capturable). Imports torch only.

Also `reference_moe`, the single-process definition both are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer_parallel.errors import PlacementError

__all__ = ["DispatchHandle", "combine", "dispatch", "reference_moe"]


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What `combine` needs to send results back and un-permute them (reuse it for exactly one combine).

    pair_token: `[P] int64` source token of every sent pair, in send order (grouped by destination rank, then by
        physical slot); pair_k: `[P] int64` its top-k column.
    send_counts / recv_counts: pairs sent to / received from each rank.
    num_tokens, top_k: the shape of the dispatched `topk_slots`.
    """

    pair_token: Tensor
    pair_k: Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    num_tokens: int
    top_k: int


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    if _world(group)[0] == 1:
        out.copy_(inp)
        return
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


def dispatch(
    x: Tensor, topk_slots: Tensor, *, slots_per_rank: int, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor, DispatchHandle]:
    """Send every routed (token, expert) pair to the rank owning its physical slot.

    x: `[num_tokens, hidden]` this rank's tokens. topk_slots: `[num_tokens, top_k] int64` physical slots
        (`ExpertPlacement.map_to_physical`), -1 = not routed. Slot s lives on EP rank s // slots_per_rank.
    group: the EP process group (None = the default group; without an initialised process group the call is the
        single-rank identity, which is what the reference tests use).
    Returns `recv_x [num_recv, hidden]` (pairs this rank must compute, grouped by source rank, then by slot),
    `recv_slot [num_recv] int64` (local slot index 0..slots_per_rank-1 of each received pair) and the handle.
    """
    if x.dim() != 2 or topk_slots.dim() != 2 or topk_slots.shape[0] != x.shape[0]:
        raise PlacementError(
            f"dispatch: expected x [T, hidden] and topk_slots [T, top_k] with equal T, found {tuple(x.shape)} and "
            f"{tuple(topk_slots.shape)}"
        )
    world, _ = _world(group)
    num_tokens, top_k = topk_slots.shape
    flat = topk_slots.reshape(-1).to(torch.int64)
    if flat.numel() and int(flat.max()) >= world * slots_per_rank:
        raise PlacementError(
            f"topk_slots: expected slots < {world * slots_per_rank} ({world} ranks x {slots_per_rank}), "
            f"found {int(flat.max())}"
        )
    pairs = (flat >= 0).nonzero().squeeze(-1)
    slots = flat[pairs]
    order = torch.sort(slots, stable=True).indices  # by destination rank, then slot (a rank owns a slot range)
    pairs, slots = pairs[order], slots[order]
    dest = slots // slots_per_rank
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    _all_to_all(recv, send, [1] * world, [1] * world, group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    pair_token, pair_k = pairs // top_k, pairs % top_k

    num_recv = sum(recv_counts)
    recv_x = x.new_empty(num_recv, x.shape[1])
    _all_to_all(recv_x, x[pair_token].contiguous(), recv_counts, send_counts, group)
    recv_slot = torch.empty(num_recv, dtype=torch.int64, device=x.device)
    _all_to_all(recv_slot, (slots % slots_per_rank).contiguous(), recv_counts, send_counts, group)
    handle = DispatchHandle(
        pair_token=pair_token, pair_k=pair_k, send_counts=tuple(send_counts), recv_counts=tuple(recv_counts),
        num_tokens=num_tokens, top_k=top_k,
    )
    return recv_x, recv_slot, handle


def combine(
    expert_out: Tensor, handle: DispatchHandle, topk_weights: Tensor, *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Send expert outputs back and sum them per token: `out[t] = sum_k topk_weights[t, k] * y(t, k)`.

    expert_out: `[num_recv, hidden]` in the order `dispatch` returned the pairs. topk_weights: `[num_tokens, top_k]`
    float (weights of unrouted columns are ignored). Returns `[num_tokens, hidden]` in expert_out's dtype, summed
    in float32.
    """
    if expert_out.shape[0] != sum(handle.recv_counts):
        raise PlacementError(
            f"expert_out: expected {sum(handle.recv_counts)} rows (pairs received by dispatch), found {expert_out.shape[0]}"
        )
    if topk_weights.shape != (handle.num_tokens, handle.top_k):
        raise PlacementError(
            f"topk_weights: expected shape {(handle.num_tokens, handle.top_k)}, found {tuple(topk_weights.shape)}"
        )
    back = expert_out.new_empty(sum(handle.send_counts), expert_out.shape[1])
    _all_to_all(back, expert_out.contiguous(), list(handle.send_counts), list(handle.recv_counts), group)
    w = topk_weights[handle.pair_token, handle.pair_k].to(torch.float32)
    out = torch.zeros(handle.num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, handle.pair_token, back.to(torch.float32) * w[:, None])
    return out.to(expert_out.dtype)


def reference_moe(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, expert_fn: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Single-process definition: `out[t] = sum_k w[t, k] * expert_fn(topk_ids[t, k], x[t])`, ids < 0 skipped,
    float32 accumulation. expert_fn(e, rows [n, hidden]) -> [n, hidden]."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, k = (topk_ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, expert_fn(e, x[tok]).to(torch.float32) * topk_weights[tok, k, None].to(torch.float32))
    return out.to(x.dtype)
