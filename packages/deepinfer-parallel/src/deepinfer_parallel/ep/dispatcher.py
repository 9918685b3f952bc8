"""EPDispatcher: expert-parallel dispatch / combine over torch.distributed with a reusable handle, in two modes
(docs/parallel.md, "Dispatch and combine").

throughput (prefill): the ranks first exchange how many (token, expert) pairs each sends to each other, then move
    exactly those rows with a variable-size `all_to_all_single`. One host read of the counts per dispatch, so not
    CUDA-graph capturable; traffic = routed pairs only.
low_latency (decode): every rank sends each peer a fixed-size block of `capacity = max_tokens_per_rank x
    min(top_k, slots_per_rank)` rows (enough for the worst case, so nothing is ever dropped) through preallocated
    buffers and an equal-split `all_to_all_single`; empty rows carry slot -1. No host read, fixed shapes: on NCCL
    the dispatch -> experts -> combine sequence can be captured in a CUDA graph.

In both modes `combine` sends the expert outputs back and sums them per token with the routing weights (float32
accumulation), plus an optional `bias` (the shared expert's output, which the caller computes locally). With
`fp8_block` set, dispatch payloads travel as FP8 e4m3 + UE8M0 scales per `fp8_block` values (`fp8_payload.py`);
combine payloads stay in the expert output's dtype. A `load_hook(layer, topk_slots)` (EPLBState.record) sees every
dispatch that names its layer, so expert load is counted where routing happens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer_parallel.ep.fp8_payload import decode_fp8_rows, encode_fp8_rows, fp8_row_bytes
from deepinfer_parallel.errors import ParallelConfigError, PlacementError
from deepinfer_parallel.state import ParallelState

__all__ = ["DispatchMode", "DispatchOutput", "EPDispatcher", "LowLatencyHandle", "ThroughputHandle"]

DispatchMode = Literal["throughput", "low_latency"]
LoadHook = Callable[[int, Tensor], None]


@dataclass(frozen=True, kw_only=True)
class ThroughputHandle:
    """What a throughput-mode `combine` needs: pair_token / pair_k `[P] int64` (source token and top-k column of
    every sent pair, in send order), pairs sent to / received from each rank, and the dispatched shape."""

    pair_token: Tensor
    pair_k: Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    num_tokens: int
    top_k: int


@dataclass(frozen=True, kw_only=True)
class LowLatencyHandle:
    """What a low-latency `combine` needs: send_index `[T * top_k] int64` (row of each pair in the send buffer;
    unrouted pairs point at a zero row past the end) and the dispatched shape. Device tensors only."""

    send_index: Tensor
    num_tokens: int
    top_k: int


@dataclass(frozen=True, kw_only=True)
class DispatchOutput:
    """Rows this rank must run through its local experts.

    recv_x: `[R, hidden]` (decoded to the dispatcher's dtype when the payload is FP8). Throughput: R = pairs
        received, grouped by source rank, then by slot. Low latency: R = ep_size x capacity, rows with
        recv_slot == -1 are padding (compute on them is allowed, their outputs are never read); the tensor is a
        view of the dispatcher's buffer, valid until its next low-latency dispatch.
    recv_slot: `[R] int64` local slot (0..slots_per_rank-1) of each row, -1 = padding.
    recv_count: `[slots_per_rank] int64` rows received per local slot (on device; the masked-GEMM counts).
    recv_payload: the raw FP8 rows `[R, hidden + hidden/fp8_block] uint8` when the payload is FP8, else None.
    handle: pass to `combine` exactly once.
    """

    recv_x: Tensor
    recv_slot: Tensor
    recv_count: Tensor
    recv_payload: Tensor | None
    handle: ThroughputHandle | LowLatencyHandle


class EPDispatcher:
    """Dispatch / combine for one EP group; build once per engine (buffers are sized once), use for every layer.

    state: the rank's ParallelState (its ep_group / ep_size / ep_rank / device are used).
    num_physical_experts: physical expert slots per layer over the whole EP group (logical + redundant); EP rank
        g owns slots [g*S, (g+1)*S), S = num_physical_experts / ep_size.
    hidden_size, top_k: activation width and routed experts per token.
    max_tokens_per_rank: largest number of tokens a rank passes to one low-latency dispatch (decode: max running
        requests x (1 + drafts)); sizes the fixed buffers. 0 = no low-latency buffers.
    dtype: activation / combine dtype. fp8_block: None (payload in dtype) or 32 / 128 (FP8 dispatch payload).
    load_hook: called as load_hook(layer, topk_slots) by every dispatch given a layer.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        num_physical_experts: int,
        hidden_size: int,
        top_k: int,
        max_tokens_per_rank: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        fp8_block: int | None = None,
        load_hook: LoadHook | None = None,
    ) -> None:
        for name, value, low in (("num_physical_experts", num_physical_experts, 1), ("hidden_size", hidden_size, 1),
                                 ("top_k", top_k, 1), ("max_tokens_per_rank", max_tokens_per_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ParallelConfigError(f"EPDispatcher.{name}: expected an int >= {low}, found {value!r}")
        if num_physical_experts % state.ep_size:
            raise ParallelConfigError(
                f"EPDispatcher.num_physical_experts: expected a multiple of ep_size={state.ep_size}, found "
                f"{num_physical_experts}"
            )
        self.state = state
        self.ep_size = state.ep_size
        self.num_physical_experts = num_physical_experts
        self.slots_per_rank = num_physical_experts // state.ep_size
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.load_hook = load_hook
        self.device = state.device
        self.payload_width = fp8_row_bytes(hidden_size, fp8_block) if fp8_block is not None else hidden_size
        self.payload_dtype = torch.uint8 if fp8_block is not None else dtype
        # Low-latency buffers: `capacity` rows per peer, plus one spare row at the end of the send buffers where
        # unrouted pairs are scattered (and, for combine, a zero row they gather), so no step needs a mask or a
        # data-dependent shape.
        self.capacity = max_tokens_per_rank * min(top_k, self.slots_per_rank)
        rows = self.ep_size * self.capacity
        if rows:
            dev = self.device
            self._ll_send = torch.zeros(rows + 1, self.payload_width, dtype=self.payload_dtype, device=dev)
            self._ll_recv = torch.zeros(rows, self.payload_width, dtype=self.payload_dtype, device=dev)
            self._ll_send_slot = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
            self._ll_recv_slot = torch.full((rows,), -1, dtype=torch.int64, device=dev)
            self._ll_back = torch.zeros(rows + 1, hidden_size, dtype=dtype, device=dev)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _a2a(self, out: Tensor, inp: Tensor, out_splits: list[int] | None = None,
             in_splits: list[int] | None = None) -> None:
        if self.state.world_group is None or self.ep_size == 1:
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=self.state.ep_group)

    def _encode(self, rows: Tensor) -> Tensor:
        if self.fp8_block is None:
            return rows.to(self.dtype)
        return encode_fp8_rows(rows, self.fp8_block)

    def _decode(self, payload: Tensor) -> Tensor:
        if self.fp8_block is None:
            return payload
        return decode_fp8_rows(payload, self.hidden_size, self.fp8_block, self.dtype)

    def _check(self, x: Tensor, topk_slots: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden_size or topk_slots.dim() != 2 or \
                topk_slots.shape != (x.shape[0], self.top_k):
            raise PlacementError(
                f"dispatch: expected x [T, {self.hidden_size}] and topk_slots [T, {self.top_k}], found "
                f"{tuple(x.shape)} and {tuple(topk_slots.shape)}"
            )
        if topk_slots.dtype.is_floating_point or topk_slots.dtype == torch.bool:
            raise PlacementError(f"topk_slots: expected an integer tensor, found {topk_slots.dtype}")

    # -- dispatch -----------------------------------------------------------------------------------------------
    def dispatch(
        self, x: Tensor, topk_slots: Tensor, *, mode: DispatchMode = "throughput", layer: int | None = None
    ) -> DispatchOutput:
        """Send every routed (token, physical slot) pair to the EP rank owning the slot.

        x: `[T, hidden]` this rank's tokens (T may be 0). topk_slots: `[T, top_k] int64` physical slots
        (`ExpertPlacement.map_to_physical`), -1 = not routed. layer: MoE layer index for the load hook.
        Every rank of the EP group must call dispatch (and later combine) with the same mode, also with T = 0.
        """
        self._check(x, topk_slots)
        if layer is not None and self.load_hook is not None:
            self.load_hook(layer, topk_slots)
        if mode == "throughput":
            return self._dispatch_throughput(x, topk_slots)
        if mode == "low_latency":
            return self._dispatch_low_latency(x, topk_slots)
        raise ParallelConfigError(f"mode: expected 'throughput' or 'low_latency', found {mode!r}")

    def _dispatch_throughput(self, x: Tensor, topk_slots: Tensor) -> DispatchOutput:
        world, spr = self.ep_size, self.slots_per_rank
        num_tokens, top_k = topk_slots.shape
        flat = topk_slots.reshape(-1).to(torch.int64)
        pairs = (flat >= 0).nonzero().squeeze(-1)
        slots = flat[pairs]
        if slots.numel() and int(slots.max()) >= self.num_physical_experts:
            raise PlacementError(
                f"topk_slots: expected slots < {self.num_physical_experts}, found {int(slots.max())}"
            )
        order = torch.sort(slots, stable=True).indices  # by destination rank, then slot
        pairs, slots = pairs[order], slots[order]
        send = torch.bincount(slots // spr, minlength=world)
        recv = torch.empty_like(send)
        self._a2a(recv, send)
        send_counts, recv_counts = send.tolist(), recv.tolist()  # the one host read of this mode
        pair_token, pair_k = pairs // top_k, pairs % top_k
        num_recv = sum(recv_counts)
        payload = self._encode(x[pair_token])
        recv_payload = payload.new_empty(num_recv, self.payload_width)
        self._a2a(recv_payload, payload.contiguous(), recv_counts, send_counts)
        recv_slot = torch.empty(num_recv, dtype=torch.int64, device=x.device)
        self._a2a(recv_slot, (slots % spr).contiguous(), recv_counts, send_counts)
        handle = ThroughputHandle(pair_token=pair_token, pair_k=pair_k, send_counts=tuple(send_counts),
                                  recv_counts=tuple(recv_counts), num_tokens=num_tokens, top_k=top_k)
        return DispatchOutput(
            recv_x=self._decode(recv_payload), recv_slot=recv_slot,
            recv_count=torch.bincount(recv_slot, minlength=spr),
            recv_payload=recv_payload if self.fp8_block is not None else None, handle=handle,
        )

    def _dispatch_low_latency(self, x: Tensor, topk_slots: Tensor) -> DispatchOutput:
        num_tokens, top_k = topk_slots.shape
        if num_tokens > self.max_tokens_per_rank:
            raise PlacementError(
                f"low_latency dispatch: {num_tokens} tokens > max_tokens_per_rank={self.max_tokens_per_rank}; "
                "use mode='throughput' or build the dispatcher with a larger max_tokens_per_rank"
            )
        world, spr, cap = self.ep_size, self.slots_per_rank, self.capacity
        flat = topk_slots.reshape(-1).to(torch.int64)
        valid = flat >= 0
        dest = torch.where(valid, flat // spr, torch.zeros_like(flat))
        # Row of each pair inside its destination block: how many earlier pairs (in (token, k) order) go there.
        # (a comparison, not F.one_hot, which may validate its input with a host read on some devices)
        onehot = ((dest[:, None] == torch.arange(world, device=dest.device)) & valid[:, None]).to(torch.int64)
        before = (onehot.cumsum(0) - onehot).gather(1, dest[:, None]).squeeze(1)
        send_index = torch.where(valid, dest * cap + before, torch.full_like(flat, world * cap))
        self._ll_send_slot.fill_(-1)
        self._ll_send_slot.index_copy_(0, send_index, torch.where(valid, flat % spr, torch.full_like(flat, -1)))
        # Padding rows keep stale data from earlier steps: harmless (slot -1, never read back).
        token = torch.arange(flat.numel(), device=flat.device) // top_k
        self._ll_send.index_copy_(0, send_index, self._encode(x[token]))
        rows = world * cap
        self._a2a(self._ll_recv, self._ll_send[:rows])
        self._a2a(self._ll_recv_slot, self._ll_send_slot[:rows])
        recv_slot = self._ll_recv_slot
        recv_count = torch.zeros(spr + 1, dtype=torch.int64, device=recv_slot.device)
        recv_count.index_add_(0, recv_slot + 1, torch.ones_like(recv_slot))  # bin 0 = padding rows
        return DispatchOutput(
            recv_x=self._decode(self._ll_recv), recv_slot=recv_slot, recv_count=recv_count[1:],
            recv_payload=self._ll_recv if self.fp8_block is not None else None,
            handle=LowLatencyHandle(send_index=send_index, num_tokens=num_tokens, top_k=top_k),
        )

    # -- combine ------------------------------------------------------------------------------------------------
    def combine(
        self, expert_out: Tensor, handle: ThroughputHandle | LowLatencyHandle, topk_weights: Tensor, *,
        bias: Tensor | None = None,
    ) -> Tensor:
        """`out[t] = bias[t] + sum_k topk_weights[t, k] * y(t, k)` for this rank's tokens: `[T, hidden]` in the
        dispatcher's dtype, summed in float32.

        expert_out: `[R, hidden]`, one row per row of the DispatchOutput the handle came from (padding rows of the
        low-latency mode may hold anything, NaN included). topk_weights: `[T, top_k]` float (unrouted columns are
        ignored). bias: optional `[T, hidden]` added once per token (the locally computed shared expert).
        """
        if topk_weights.shape != (handle.num_tokens, handle.top_k):
            raise PlacementError(
                f"topk_weights: expected shape {(handle.num_tokens, handle.top_k)}, found {tuple(topk_weights.shape)}"
            )
        if bias is not None and bias.shape != (handle.num_tokens, self.hidden_size):
            raise PlacementError(
                f"bias: expected shape {(handle.num_tokens, self.hidden_size)}, found {tuple(bias.shape)}"
            )
        if isinstance(handle, ThroughputHandle):
            out = self._combine_throughput(expert_out, handle, topk_weights)
        else:
            out = self._combine_low_latency(expert_out, handle, topk_weights)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(self.dtype)

    def _combine_throughput(self, expert_out: Tensor, handle: ThroughputHandle, topk_weights: Tensor) -> Tensor:
        if expert_out.shape != (sum(handle.recv_counts), self.hidden_size):
            raise PlacementError(
                f"expert_out: expected {(sum(handle.recv_counts), self.hidden_size)} (pairs received by dispatch), "
                f"found {tuple(expert_out.shape)}"
            )
        back = expert_out.new_empty(sum(handle.send_counts), self.hidden_size)
        self._a2a(back, expert_out.contiguous(), list(handle.send_counts), list(handle.recv_counts))
        w = topk_weights[handle.pair_token, handle.pair_k].to(torch.float32)
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, handle.pair_token, back.to(torch.float32) * w[:, None])
        return out

    def _combine_low_latency(self, expert_out: Tensor, handle: LowLatencyHandle, topk_weights: Tensor) -> Tensor:
        rows = self.ep_size * self.capacity
        if expert_out.shape != (rows, self.hidden_size):
            raise PlacementError(
                f"expert_out: expected {(rows, self.hidden_size)} (one row per low-latency receive row), found "
                f"{tuple(expert_out.shape)}"
            )
        self._a2a(self._ll_back[:rows], expert_out.to(self.dtype).contiguous())
        self._ll_back[-1].zero_()  # unrouted pairs gather this row
        vals = self._ll_back.index_select(0, handle.send_index).to(torch.float32)
        vals = vals.view(handle.num_tokens, handle.top_k, self.hidden_size)
        routed = (handle.send_index < rows).view(handle.num_tokens, handle.top_k)
        w = torch.where(routed, topk_weights.to(torch.float32), torch.zeros((), device=vals.device))
        return (vals * w[:, :, None]).sum(1)
