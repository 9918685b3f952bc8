"""ParallelState: the single-process state, joining a torchrun-style world from env vars, typed errors."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.launch import _HOST
from deepinfer_parallel.state import ParallelState


def test_single():
    s = ParallelState.single()
    assert (s.world_size, s.rank, s.ep_size, s.ep_rank, s.backend, s.is_distributed) == (1, 0, 1, 0, "none", False)
    assert s.dp_size == 1 and s.is_driver and s.ep_global_rank(0) == 0
    with s:
        pass  # destroy is a no-op without a process group
    with pytest.raises(ParallelConfigError, match="ep_rank"):
        s.ep_global_rank(1)


def test_from_env_names_missing_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ParallelConfigError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        ParallelState.from_env()


def test_initialize_errors():
    with pytest.raises(ParallelConfigError, match="dp_size"):
        ParallelState.initialize(rank=0, world_size=2, config=ParallelConfig(dp_size=4, ep_size=4), init_method="x")
    with pytest.raises(ParallelConfigError, match="exactly one"):
        ParallelState.initialize(rank=0, world_size=1)
    with pytest.raises(ParallelConfigError, match="backend"):
        ParallelState.initialize(rank=0, world_size=1, init_method="env://", backend="mpi")


def _torchrun_rank(rank: int, port: int, q) -> None:
    # what torchrun exports; its agent hosts the store, so ranks join it as clients
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR=_HOST, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    with ParallelState.from_env(backend="gloo", timeout_s=30) as state:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=state.ep_group)
        q.put((rank, state.world_size, state.backend, float(t), state.owns_process_group))
    q.put((rank, dist.is_initialized()))


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_from_env_joins_a_torchrun_world():
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)  # stands in for torchrun's agent
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, store.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=40) for _ in range(4))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == [(0, False), (0, 2, "gloo", 3.0, True), (1, False), (1, 2, "gloo", 3.0, True)]
    assert all(p.exitcode == 0 for p in procs)


def test_destroy_frees_the_process_groups_and_later_reads_raise():
    # a gloo group that outlives destroy keeps worker threads that can abort the process at interpreter exit
    import gc
    import weakref

    state = ParallelState.initialize(rank=0, world_size=1, store=dist.HashStore(), backend="gloo", timeout_s=30)
    try:
        assert state.is_distributed and state.ep_group is state.world_group is state.cpu_group
        t = torch.ones(2)
        dist.all_reduce(t, group=state.ep_group)
        freed = weakref.ref(state.world_group)
    finally:
        state.destroy()
    gc.collect()
    assert freed() is None and not dist.is_initialized()
    state.destroy()  # idempotent
    for name in ("world_group", "ep_group", "cpu_group"):
        with pytest.raises(ParallelConfigError, match=f"{name}.*destroy"):
            getattr(state, name)
    with pytest.raises(ParallelConfigError, match="destroy"):
        _ = state.is_distributed
