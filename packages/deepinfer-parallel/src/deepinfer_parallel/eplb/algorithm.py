"""EPLB placement policy as one pure function (docs/parallel.md, "EPLB"): replicate hot experts into redundant slots and
pack the replicas onto GPUs so that the per-GPU load is balanced. Torch at the boundaries, exact greedy in plain
Python inside (the inputs are small: layers x a few hundred experts), so results are bit-for-bit deterministic on
any device. Imports torch only.

Policy (hierarchical, used when num_nodes divides num_groups; otherwise the global policy = one node, one group):
  1. pack the expert groups onto nodes (equal number of groups per node, balancing the summed group load);
  2. inside each node, replicate: start with one replica per expert, then give each of the node's redundant slots
     to the expert with the largest load per replica;
  3. pack the node's replicas onto its GPUs (equal number of slots per GPU), each replica carrying load / count,
     keeping replicas of one expert on different GPUs whenever a GPU with room allows it.
Both packings are the greedy "heaviest item into the lightest pack that still has room" rule.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["balanced_packing", "build_log2phy", "gpu_loads", "rebalance_experts", "replicate_experts"]


def _check_weight(weight: Tensor) -> None:
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        found = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ParallelConfigError(f"weight: expected a [layers, items] tensor, found {found}")
    if weight.is_complex() or not torch.isfinite(weight.to(torch.float64)).all() or (weight < 0).any():
        raise ParallelConfigError("weight: expected finite, non-negative loads")


def _pack_row(loads: list[float], num_packs: int, keys: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Greedy balanced packing of one row: items by load descending (ties: lower index first) go to the lightest
    pack that still has room (ties: lower pack index). Every pack receives exactly len(loads) // num_packs items.

    keys: optional item keys (the logical expert of a replica). An item skips packs already holding an item with the
    same key while another pack has room: two replicas of one expert on one GPU would cost a slot and balance
    nothing.
    Returns (pack of each item, position of each item inside its pack in assignment order).
    """
    capacity = len(loads) // num_packs
    order = sorted(range(len(loads)), key=lambda i: (-loads[i], i))
    heap = [(0.0, p) for p in range(num_packs)]  # (pack load, pack id) of packs that still have room
    fill = [0] * num_packs
    held: list[set[int]] = [set() for _ in range(num_packs)]
    pack_of = [0] * len(loads)
    rank_of = [0] * len(loads)
    for item in order:
        skipped = []
        load, pack = heapq.heappop(heap)
        if keys is not None:
            while keys[item] in held[pack] and heap:
                skipped.append((load, pack))
                load, pack = heapq.heappop(heap)
            if keys[item] in held[pack]:  # every pack with room holds the key: take the lightest after all
                skipped.append((load, pack))
                skipped.sort()
                load, pack = skipped.pop(0)
            held[pack].add(keys[item])
        for entry in skipped:
            heapq.heappush(heap, entry)
        pack_of[item] = pack
        rank_of[item] = fill[pack]
        fill[pack] += 1
        if fill[pack] < capacity:
            heapq.heappush(heap, (load + loads[item], pack))
    return pack_of, rank_of


def balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """Split the items of every row into `num_packs` packs of equal size, balancing the summed weight.

    weight: `[rows, items]` float, non-negative; items must be divisible by num_packs.
    Returns `pack_index [rows, items] int64` (pack of each item) and `rank_in_pack [rows, items] int64`
    (0..items/num_packs-1, the order in which items entered the pack: heaviest first).
    """
    _check_weight(weight)
    rows, items = weight.shape
    if not isinstance(num_packs, int) or num_packs < 1 or items % num_packs != 0:
        raise ParallelConfigError(f"num_packs: expected a divisor of the item count {items}, found {num_packs!r}")
    packs, ranks = [], []
    for row in weight.detach().to("cpu", torch.float64).tolist():
        p, r = _pack_row(row, num_packs)
        packs.append(p)
        ranks.append(r)
    shape = (rows, items)
    return (torch.tensor(packs, dtype=torch.int64).reshape(shape), torch.tensor(ranks, dtype=torch.int64).reshape(shape))


def _replicate_row(loads: list[float], num_slots: int) -> list[int]:
    """Replica count per item: one each, then every extra slot to the item with the largest load per replica
    (ties: lower index). This greedy minimises the maximum load / count for the given number of slots."""
    counts = [1] * len(loads)
    heap = [(-load, i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-loads[i] / counts[i], i))
    return counts


def replicate_experts(weight: Tensor, num_replicas: int) -> tuple[Tensor, Tensor]:
    """Replicate the items of every row into `num_replicas >= items` slots (no packing).

    weight: `[rows, items]` float. Returns `phy2log [rows, num_replicas] int64` (item of each slot: slots grouped by
    item in ascending item order) and `logcnt [rows, items] int64` (replicas per item, >= 1, row sum num_replicas).
    """
    _check_weight(weight)
    rows, items = weight.shape
    if not isinstance(num_replicas, int) or num_replicas < items:
        raise ParallelConfigError(f"num_replicas: expected an int >= {items} (one slot per item), found {num_replicas!r}")
    counts = [_replicate_row(row, num_replicas) for row in weight.detach().to("cpu", torch.float64).tolist()]
    logcnt = torch.tensor(counts, dtype=torch.int64).reshape(rows, items)
    phy2log = torch.repeat_interleave(torch.arange(items).expand(rows, items).reshape(-1), logcnt.reshape(-1))
    return phy2log.reshape(rows, num_replicas), logcnt


def _rebalance_layer(
    loads: list[float], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[int], list[int]]:
    """One layer of the hierarchical policy. Returns (phy2log [num_replicas], logcnt [experts]) as lists."""
    num_experts = len(loads)
    group_size = num_experts // num_groups
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = num_replicas // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    group_loads = [sum(loads[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group, _ = _pack_row(group_loads, num_nodes)

    phy2log = [0] * num_replicas
    logcnt = [0] * num_experts
    for node in range(num_nodes):
        experts = [
            g * group_size + j for g in range(num_groups) if node_of_group[g] == node for j in range(group_size)
        ]
        counts = _replicate_row([loads[e] for e in experts], slots_per_node)
        replicas = [(e, k) for e, c in zip(experts, counts) for k in range(c)]
        replica_loads = [loads[e] / c for e, c in zip(experts, counts) for _ in range(c)]
        gpu_of_replica, _ = _pack_row(replica_loads, gpus_per_node, keys=[e for e, _ in replicas])
        for local_gpu in range(gpus_per_node):
            # Inside a GPU, slots are ordered by (expert id, replica id) so weight files map to slots in order.
            mine = sorted(replicas[i] for i in range(len(replicas)) if gpu_of_replica[i] == local_gpu)
            base = (node * gpus_per_node + local_gpu) * slots_per_gpu
            for offset, (expert, _) in enumerate(mine):
                phy2log[base + offset] = expert
        for e, c in zip(experts, counts):
            logcnt[e] = c
    return phy2log, logcnt


def rebalance_experts(
    weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Expert placement for every MoE layer.

    weight: `[layers, num_logical_experts]` float (or int) load per logical expert, e.g. token counts summed over a
        window (`ExpertLoadRecorder.load()`); non-negative.
    num_replicas: physical expert slots per layer (= logical experts + redundant), divisible by num_gpus.
    num_groups: expert groups (routing groups); must divide num_logical_experts. V4 / V4.1 route over all experts
        without group limits, so pass 1 there (docs/parallel.md, "EPLB").
    num_nodes: nodes (server boxes); must divide num_gpus. The hierarchical policy (groups packed onto nodes) is used
        when num_nodes divides num_groups, otherwise the global policy (all experts and GPUs as one node).
    num_gpus: GPUs of the EP group; GPU g owns the contiguous physical slots [g*S, (g+1)*S), S = num_replicas/num_gpus.

    Returns, all int64 on the CPU:
      phy2log `[layers, num_replicas]`: logical expert held by each physical slot;
      log2phy `[layers, num_logical_experts, max_replicas]`: physical slots of each logical expert in ascending
        slot order, -1 padded (max_replicas = the largest replica count of any expert in any layer);
      logcnt `[layers, num_logical_experts]`: replica count of each logical expert (>= 1; row sum num_replicas).
    """
    _check_weight(weight)
    num_layers, num_experts = weight.shape
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParallelConfigError(f"{name}: expected an int >= 1, found {value!r}")
    if num_replicas < num_experts:
        raise ParallelConfigError(
            f"num_replicas: expected >= num_logical_experts={num_experts} (every expert needs a slot), found {num_replicas}"
        )
    if num_replicas % num_gpus != 0:
        raise ParallelConfigError(f"num_replicas: expected a multiple of num_gpus={num_gpus}, found {num_replicas}")
    if num_experts % num_groups != 0:
        raise ParallelConfigError(
            f"num_groups: expected a divisor of num_logical_experts={num_experts}, found {num_groups}"
        )
    if num_gpus % num_nodes != 0:
        raise ParallelConfigError(f"num_nodes: expected a divisor of num_gpus={num_gpus}, found {num_nodes}")
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1  # global policy

    rows = weight.detach().to("cpu", torch.float64).tolist()
    results = [_rebalance_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in rows]
    phy2log = torch.tensor([p for p, _ in results], dtype=torch.int64).reshape(num_layers, num_replicas)
    logcnt = torch.tensor([c for _, c in results], dtype=torch.int64).reshape(num_layers, num_experts)
    return phy2log, build_log2phy(phy2log, logcnt), logcnt


def build_log2phy(phy2log: Tensor, logcnt: Tensor) -> Tensor:
    """`log2phy [layers, experts, max(logcnt)] int64` (ascending physical slots, -1 padded) from phy2log/logcnt."""
    num_layers, num_replicas = phy2log.shape
    num_experts = logcnt.shape[1]
    max_replicas = int(logcnt.max()) if logcnt.numel() else 0
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    # Stable sort by logical id keeps slots of one expert in ascending order; the rank of a slot among its
    # expert's slots is its position minus the expert's first position.
    order = torch.sort(phy2log, dim=1, stable=True).indices
    first = torch.cumsum(logcnt, dim=1) - logcnt
    sorted_log = phy2log.gather(1, order)
    rank = torch.arange(num_replicas).expand(num_layers, -1) - first.gather(1, sorted_log)
    log2phy.view(num_layers, -1).scatter_(1, sorted_log * max_replicas + rank, order)
    return log2phy


def gpu_loads(weight: Tensor, phy2log: Tensor, logcnt: Tensor, num_gpus: int) -> Tensor:
    """Expected load per GPU `[layers, num_gpus] float64` when every expert's tokens are split evenly over its
    replicas and GPU g owns the contiguous slots [g*S, (g+1)*S)."""
    num_layers, num_replicas = phy2log.shape
    if num_replicas % num_gpus != 0:
        raise ParallelConfigError(f"num_gpus: expected a divisor of num_replicas={num_replicas}, found {num_gpus}")
    w = weight.to(torch.float64)
    per_replica = (w / logcnt.to(torch.float64)).gather(1, phy2log)
    return per_replica.reshape(num_layers, num_gpus, -1).sum(-1)
