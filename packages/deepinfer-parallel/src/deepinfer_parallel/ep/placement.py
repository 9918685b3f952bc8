"""ExpertPlacement: which logical expert every physical slot holds, and the deterministic choice of a replica for
each routed (token, expert) pair (docs/parallel.md, "Process layout"). Imports torch only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer_parallel.eplb.algorithm import build_log2phy
from deepinfer_parallel.errors import PlacementError

__all__ = ["REPLICA_HASH_PRIME", "ExpertPlacement"]

# Multiplier of the token index in the replica hash. Any odd constant spreads consecutive tokens over the replicas;
# a prime keeps the pattern from aliasing with replica counts. (DeepInfer uses "a large prime" too, value unknown.)
REPLICA_HASH_PRIME = 1_000_003


def _int_tensor(name: str, t: object, dim: int) -> Tensor:
    if not isinstance(t, Tensor) or t.dim() != dim or t.dtype.is_floating_point or t.dtype == torch.bool:
        found = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise PlacementError(f"ExpertPlacement.{name}: expected a {dim}-d integer tensor, found {found}")
    return t


def _check_maps(phy2log: Tensor, logcnt: Tensor) -> tuple[Tensor, Tensor]:
    """Range and count checks of phy2log / logcnt; returns both as CPU int64."""
    if phy2log.shape[0] != logcnt.shape[0]:
        raise PlacementError(
            f"ExpertPlacement: phy2log {tuple(phy2log.shape)} and logcnt {tuple(logcnt.shape)} differ in layers"
        )
    num_logical = logcnt.shape[1]
    p, c = phy2log.cpu().to(torch.int64), logcnt.cpu().to(torch.int64)
    if phy2log.shape[1] < num_logical:
        raise PlacementError(f"ExpertPlacement: {phy2log.shape[1]} physical slots < {num_logical} logical experts")
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= num_logical):
        raise PlacementError(
            f"ExpertPlacement.phy2log: expected ids in [0, {num_logical}), found [{int(p.min())}, {int(p.max())}]"
        )
    if c.numel() and int(c.min()) < 1:
        raise PlacementError(f"ExpertPlacement.logcnt: expected every expert to have >= 1 replica, found {int(c.min())}")
    counted = torch.zeros_like(c).scatter_add_(1, p, torch.ones_like(p))
    if not torch.equal(counted, c):
        raise PlacementError("ExpertPlacement.logcnt: does not match the number of phy2log slots of each expert")
    return p, c


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """Expert placement of all MoE layers of one EP group (the `rebalance_experts` outputs).

    phy2log: `[layers, num_physical] int64`, logical expert held by each physical slot. With EP size G, GPU (EP rank)
        g owns the contiguous slots [g*S, (g+1)*S), S = num_physical / G.
    log2phy: `[layers, num_logical, max_replicas] int64`, physical slots of each logical expert in ascending order,
        -1 padded.
    logcnt: `[layers, num_logical] int64`, replicas per logical expert (>= 1).
    Validated on construction (one pass over the maps, host-side; placements change rarely).
    """

    phy2log: Tensor
    log2phy: Tensor
    logcnt: Tensor

    def __post_init__(self) -> None:
        phy2log = _int_tensor("phy2log", self.phy2log, 2)
        log2phy = _int_tensor("log2phy", self.log2phy, 3)
        logcnt = _int_tensor("logcnt", self.logcnt, 2)
        layers = phy2log.shape[0]
        if logcnt.shape[0] != layers or log2phy.shape[:2] != logcnt.shape:
            raise PlacementError(
                f"ExpertPlacement: expected phy2log [L, R], log2phy [L, E, M], logcnt [L, E] with equal L and E, found "
                f"{tuple(phy2log.shape)}, {tuple(log2phy.shape)}, {tuple(logcnt.shape)}"
            )
        p, c = _check_maps(phy2log, logcnt)
        width = int(c.max()) if c.numel() else 0
        l2p = log2phy.cpu().to(torch.int64)
        if l2p.shape[2] < width or not torch.equal(l2p[..., :width], build_log2phy(p, c)) or bool(
            (l2p[..., width:] != -1).any()
        ):
            raise PlacementError("ExpertPlacement.log2phy: does not list each expert's phy2log slots in ascending order")

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_maps(cls, phy2log: Tensor, logcnt: Tensor) -> ExpertPlacement:
        """Build log2phy from phy2log / logcnt."""
        phy2log = _int_tensor("phy2log", phy2log, 2).to("cpu", torch.int64)
        logcnt = _int_tensor("logcnt", logcnt, 2).to("cpu", torch.int64)
        _check_maps(phy2log, logcnt)
        return cls(phy2log=phy2log, log2phy=build_log2phy(phy2log, logcnt), logcnt=logcnt)

    @classmethod
    def initial(cls, *, num_layers: int, num_experts: int, num_physical: int) -> ExpertPlacement:
        """Start-up layout before any statistics: slot s < num_experts holds expert s, the redundant slots hold
        copies of experts 0, 1, 2, ... (docs/parallel.md, "EPLB")."""
        if num_physical < num_experts or num_experts < 1 or num_layers < 1:
            raise PlacementError(
                f"ExpertPlacement.initial: expected num_layers >= 1 and num_physical >= num_experts >= 1, found "
                f"num_layers={num_layers}, num_experts={num_experts}, num_physical={num_physical}"
            )
        phy2log = (torch.arange(num_physical) % num_experts).expand(num_layers, -1).contiguous()
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(
            1, phy2log, torch.ones_like(phy2log)
        )
        return cls.from_maps(phy2log, logcnt)

    # -- shape facts ----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def max_replicas(self) -> int:
        return self.log2phy.shape[2]

    def slots_per_rank(self, ep_size: int) -> int:
        if not isinstance(ep_size, int) or ep_size < 1 or self.num_physical % ep_size != 0:
            raise PlacementError(
                f"ep_size: expected a divisor of num_physical={self.num_physical}, found {ep_size!r}"
            )
        return self.num_physical // ep_size

    def local_slots(self, ep_rank: int, ep_size: int) -> range:
        """Physical slots owned by `ep_rank`."""
        s = self.slots_per_rank(ep_size)
        if not 0 <= ep_rank < ep_size:
            raise PlacementError(f"ep_rank: expected 0 <= ep_rank < {ep_size}, found {ep_rank}")
        return range(ep_rank * s, (ep_rank + 1) * s)

    def local_experts(self, layer: int, ep_rank: int, ep_size: int) -> Tensor:
        """Logical expert of each local slot of `ep_rank` in `layer`: `[slots_per_rank] int64` (what to load)."""
        r = self.local_slots(ep_rank, ep_size)
        return self.phy2log[layer, r.start : r.stop]

    def to(self, device: torch.device | str) -> ExpertPlacement:
        return ExpertPlacement(
            phy2log=self.phy2log.to(device), log2phy=self.log2phy.to(device), logcnt=self.logcnt.to(device)
        )

    # -- routing --------------------------------------------------------------------------------------------------
    def map_to_physical(
        self, layer: int, topk_ids: Tensor, *, token_index: Tensor | None = None, ep_rank: int = 0
    ) -> Tensor:
        """Physical slot for every routed (token, logical expert) pair of one layer.

        topk_ids: `[num_tokens, top_k] int64` logical expert ids, -1 = not routed (stays -1).
        token_index: `[num_tokens] int64`, default `arange(num_tokens)` (the token's row in this rank's step).
        Replica choice: `(ep_rank + token_index * REPLICA_HASH_PRIME) mod logcnt[id]`, so it depends only on the
        rank, the token's row and the placement (not on the rest of the batch), and consecutive tokens cycle over
        an expert's replicas. Returns `[num_tokens, top_k] int64` on the device of `topk_ids`; no host sync.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise PlacementError(f"layer: expected 0 <= layer < {self.num_layers}, found {layer!r}")
        if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise PlacementError(
                f"topk_ids: expected a [num_tokens, top_k] integer tensor, found {tuple(topk_ids.shape)} {topk_ids.dtype}"
            )
        num_tokens = topk_ids.shape[0]
        device = topk_ids.device
        if token_index is None:
            token_index = torch.arange(num_tokens, device=device)
        elif token_index.shape != (num_tokens,):
            raise PlacementError(
                f"token_index: expected shape ({num_tokens},) (one per topk_ids row), found {tuple(token_index.shape)}"
            )
        ids = topk_ids.to(torch.int64)
        valid = ids >= 0
        safe = ids.clamp(min=0)
        counts = self.logcnt[layer].to(device)[safe]  # [T, K]
        replica = (ep_rank + token_index.to(device=device, dtype=torch.int64) * REPLICA_HASH_PRIME)[:, None] % counts
        slots = self.log2phy[layer].to(device)[safe, replica]
        return torch.where(valid, slots, torch.full_like(slots, -1))

    def rank_of_slot(self, slots: Tensor, ep_size: int) -> Tensor:
        """EP rank owning each physical slot (-1 stays -1): same shape as `slots`, int64."""
        s = self.slots_per_rank(ep_size)
        slots = slots.to(torch.int64)
        return torch.where(slots >= 0, slots // s, torch.full_like(slots, -1))

    def logical_load(self, physical_counts: Tensor) -> Tensor:
        """Fold per-slot token counts `[layers, num_physical]` into per-logical-expert counts `[layers, num_logical]`
        (the statistics a dispatch kernel produces are per physical slot, docs/parallel.md, "EPLB")."""
        if physical_counts.shape != self.phy2log.shape:
            raise PlacementError(
                f"physical_counts: expected shape {tuple(self.phy2log.shape)}, found {tuple(physical_counts.shape)}"
            )
        out = torch.zeros(
            self.num_layers, self.num_logical, dtype=physical_counts.dtype, device=physical_counts.device
        )
        return out.scatter_add_(1, self.phy2log.to(physical_counts.device), physical_counts)
