"""ParallelState: the process groups and rank facts of one rank, created once and passed explicitly (no globals).

One process per device, no tensor parallelism: every rank is one attention data-parallel (DP) rank and the expert
parallel (EP) groups are contiguous blocks of DP ranks (EP group = all DP ranks when ep_size == dp_size), see
docs/parallel.md. Backend: NCCL for CUDA devices (plus a gloo group for host-side votes), gloo on the CPU.

Creation: `ParallelState.single()` (one process, no process group), `ParallelState.initialize(...)` (explicit
rank / world / store, what `launch.spawn_ranks` calls in each child) and `ParallelState.from_env()` (join a
`torchrun` world through RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT). `destroy()` tears the groups
down; the state is also a context manager.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "ParallelState", "ProcessGroups"]

# Collective timeout: a rank blocked on a dead peer raises after this long instead of hanging (gloo honours it;
# NCCL honours it with async error handling, which torch enables by default).
DEFAULT_TIMEOUT_S = 300.0
# how long `destroy` waits for the other ranks to arrive before tearing the process group down anyway
TEARDOWN_BARRIER_S = 30.0


def _device_for(backend: str, local_rank: int, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if backend == "nccl":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _resolve_backend(backend: str | None, device: torch.device | str | None) -> str:
    if backend is None:
        if device is not None:
            return "nccl" if torch.device(device).type == "cuda" else "gloo"
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ParallelConfigError(f"backend: expected 'nccl', 'gloo' or None (auto), found {backend!r}")
    return backend


class ProcessGroups:
    """The process groups one ParallelState uses, held in one place so that `destroy` can let go of them.

    Why a holder: `dist.destroy_process_group` forgets the groups but does not free them while anyone still refers
    to them, and a live gloo group keeps its worker threads. Freed at interpreter exit instead, such a worker that
    finishes its last operation then needs the GIL to drop a Python tensor, and Python's finalisation ends that
    thread through a C++ frame that must not unwind: the process aborts ("terminate called without an active
    exception") after its work is done. Dropping the last references in `destroy` joins the workers while the
    interpreter is alive. Reading a group after that raises instead of acting as a one-process state.
    """

    __slots__ = ("_groups", "_released")

    def __init__(self, world: dist.ProcessGroup | None = None, ep: dist.ProcessGroup | None = None,
                 cpu: dist.ProcessGroup | None = None) -> None:
        self._groups = {"world": world, "ep": ep, "cpu": cpu}
        self._released = False

    def get(self, name: str) -> dist.ProcessGroup | None:
        if self._released:
            raise ParallelConfigError(
                f"ParallelState.{name}_group: expected a live process group, found one released by destroy(); "
                "create a new ParallelState (and the objects built on it) to communicate again"
            )
        return self._groups[name]

    def release(self) -> None:
        self._groups = {k: None for k in self._groups}
        self._released = True

    @property
    def released(self) -> bool:
        return self._released


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """Rank facts and process groups of this process.

    world_size / rank: the torch.distributed world (= DP size / DP rank: one DP rank per process);
    local_rank: rank on this host (selects the CUDA device); ep_size / ep_rank: size of this rank's EP group and the
    rank inside it; device: where this rank's tensors live; backend: "nccl", "gloo" or "none" (single process).
    world_group: default group (None when no process group exists); ep_group: this rank's EP group (the world
    group when ep_size == world_size); cpu_group: a gloo group over the world for host-side control (votes,
    object broadcasts) - the world group itself on gloo.
    """

    world_size: int
    rank: int
    local_rank: int
    ep_size: int
    ep_rank: int
    device: torch.device
    backend: str
    groups: ProcessGroups = field(default_factory=ProcessGroups, repr=False)
    owns_process_group: bool = False

    # -- process groups (see ProcessGroups) -----------------------------------------------------------------------
    @property
    def world_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("world")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("ep")

    @property
    def cpu_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("cpu")

    # -- facts --------------------------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def is_distributed(self) -> bool:
        return self.world_group is not None

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that logs and reports for the world."""
        return self.rank == 0

    def ep_global_rank(self, ep_rank: int) -> int:
        """World rank of `ep_rank` in this rank's EP group (EP groups are contiguous blocks)."""
        if not 0 <= ep_rank < self.ep_size:
            raise ParallelConfigError(f"ep_rank: expected 0 <= ep_rank < {self.ep_size}, found {ep_rank}")
        return (self.rank // self.ep_size) * self.ep_size + ep_rank

    # -- creation -----------------------------------------------------------------------------------------------
    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """One process, no process group: EP collectives degrade to local copies."""
        return cls(world_size=1, rank=0, local_rank=0, ep_size=1, ep_rank=0, device=torch.device(device),
                   backend="none")

    @classmethod
    def initialize(
        cls,
        *,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        config: ParallelConfig | None = None,
        store: dist.Store | None = None,
        init_method: str | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ParallelState:
        """Join (and own) the default process group, then create the EP and CPU groups.

        config: dp_size must equal world_size (default: ParallelConfig(dp_size=world_size, ep_size=world_size)).
        store / init_method: the rendezvous (exactly one; init_method "env://" reads MASTER_ADDR / MASTER_PORT).
        backend: None = NCCL when `device` (or, without one, this host) has CUDA, else gloo.
        Every rank of the world must call this with the same config (group creation is collective).
        """
        if config is None:
            config = ParallelConfig(dp_size=world_size, ep_size=world_size)
        if config.world_size != world_size:
            raise ParallelConfigError(
                f"ParallelConfig.dp_size: expected the world size {world_size} (one DP rank per process), "
                f"found {config.dp_size}"
            )
        if not 0 <= rank < world_size:
            raise ParallelConfigError(f"rank: expected 0 <= rank < {world_size}, found {rank}")
        if (store is None) == (init_method is None):
            raise ParallelConfigError("rendezvous: expected exactly one of store / init_method")
        if dist.is_initialized():
            raise ParallelConfigError(
                "torch.distributed: a default process group already exists in this process; destroy it first or "
                "use it through ParallelState.from_existing()"
            )
        local_rank = rank if local_rank is None else local_rank
        backend = _resolve_backend(backend, device)
        dev = _device_for(backend, local_rank, device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = timedelta(seconds=timeout_s)
        kwargs = {"store": store} if store is not None else {"init_method": init_method}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        return cls._with_groups(config, local_rank=local_rank, device=dev, backend=backend, timeout=timeout,
                                owns=True)

    @classmethod
    def from_env(
        cls,
        config: ParallelConfig | None = None,
        *,
        backend: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ParallelState:
        """Join a `torchrun` world: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment.

        Multi-node runs go through torchrun (its agent restarts or tears down the world when a rank dies); a rank
        blocked on a dead peer raises after timeout_s.
        """
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ParallelConfigError(
                f"environment: expected torchrun's variables, missing {', '.join(missing)}; start the program with "
                "`torchrun --nproc-per-node N ...` or use launch.spawn_ranks"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return cls.initialize(rank=rank, world_size=world, local_rank=local_rank, config=config,
                              init_method="env://", backend=backend, device=device, timeout_s=timeout_s)

    @classmethod
    def from_existing(
        cls, config: ParallelConfig | None = None, *, device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ParallelState:
        """Use a default process group someone else created (not destroyed by `destroy`)."""
        if not dist.is_initialized():
            raise ParallelConfigError("torch.distributed: expected an initialised default process group, found none")
        world = dist.get_world_size()
        config = config or ParallelConfig(dp_size=world, ep_size=world)
        backend = dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        dev = _device_for(backend, local_rank, device)
        return cls._with_groups(config, local_rank=local_rank, device=dev, backend=backend,
                                timeout=timedelta(seconds=timeout_s), owns=False)

    @classmethod
    def _with_groups(cls, config: ParallelConfig, *, local_rank: int, device: torch.device, backend: str,
                     timeout: timedelta, owns: bool) -> ParallelState:
        world, rank = dist.get_world_size(), dist.get_rank()
        if config.world_size != world:
            raise ParallelConfigError(
                f"ParallelConfig.dp_size: expected the world size {world}, found {config.dp_size}"
            )
        world_group = dist.group.WORLD
        if config.ep_size == world:
            ep_group = world_group
        else:
            # new_group is collective over the whole world: every rank creates every block, keeps its own.
            ep_group = None
            for g in range(config.num_ep_groups):
                ranks = list(range(g * config.ep_size, (g + 1) * config.ep_size))
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    ep_group = pg
        cpu_group = world_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(world_size=world, rank=rank, local_rank=local_rank, ep_size=config.ep_size,
                   ep_rank=config.ep_rank_of(rank), device=device, backend=backend,
                   groups=ProcessGroups(world_group, ep_group, cpu_group), owns_process_group=owns)

    # -- teardown -----------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Destroy the process groups this state created and free them (idempotent; a no-op for `single` /
        `from_existing`). Objects built on this state (an EPDispatcher, a rank core) must not communicate after."""
        if not self.owns_process_group or self.groups.released:
            return
        if dist.is_initialized():
            if self.world_size > 1 and self.cpu_group is not None:
                # every rank leaves its last collective before any rank closes its connections: a rank that tears
                # its gloo pairs down while a peer still exchanges the last step's flags can abort that peer at exit
                try:
                    dist.monitored_barrier(group=self.cpu_group, timeout=timedelta(seconds=TEARDOWN_BARRIER_S))
                except RuntimeError:  # a peer is already gone: nothing left to wait for
                    pass
            dist.destroy_process_group()
        self.groups.release()

    def __enter__(self) -> ParallelState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
