"""Spawned ranks: results come back; a raising or SIGKILLed rank ends every rank and the caller within a timeout
with RankFailedError naming the rank; no child outlives the call."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.errors import RankFailedError
from deepinfer_parallel.launch import SpawnedRanks
from parallel_testing import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _facts(state):
    t = torch.tensor([state.rank + 1.0])
    dist.all_reduce(t, group=state.ep_group)
    return (state.rank, state.world_size, state.ep_rank, state.ep_size, state.backend, float(t))


@pytest.mark.parametrize("world", [2, 4])
def test_results_by_rank(world):
    out = run_ranks(_facts, world)
    total = world * (world + 1) / 2
    assert out == [(r, world, r, world, "gloo", total) for r in range(world)]


def test_ep_subgroups():
    out = run_ranks(_facts, 4, config=ParallelConfig(dp_size=4, ep_size=2))
    assert [o[2:4] for o in out] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [o[5] for o in out] == [3.0, 3.0, 7.0, 7.0]  # sums inside each EP block


def _raise_on_1(state):
    if state.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1
    time.sleep(120)


def _kill_1(state):
    if state.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    time.sleep(120)


@pytest.mark.parametrize("fn, match", [(_raise_on_1, "boom on purpose"), (_kill_1, "signal 9")])
def test_failing_rank_ends_everything(fn, match):
    t0 = time.monotonic()
    ranks = SpawnedRanks(fn, 3, backend="gloo", start_method="fork", timeout_s=30)
    pids = ranks.pids
    with pytest.raises(RankFailedError, match=match) as info:
        ranks.join()
    assert info.value.rank == 1
    assert time.monotonic() - t0 < 20
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _hang(state):
    time.sleep(120)


def test_timeout_names_running_ranks_and_kills_them():
    with SpawnedRanks(_hang, 2, backend="gloo", start_method="fork", timeout_s=30) as ranks:
        pids = ranks.pids
        with pytest.raises(RankFailedError, match=r"still running after the timeout"):
            ranks.join(timeout_s=2)
    assert not any(_alive(p) for p in pids)


def test_close_without_join_kills_ranks():
    ranks = SpawnedRanks(_hang, 2, backend="gloo", start_method="fork", timeout_s=30)
    pids = ranks.pids
    del ranks  # the finalizer terminates the children
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


_CALLER = """
import sys, time
from deepinfer_parallel.launch import SpawnedRanks
def hang(state):
    time.sleep(120)
ranks = SpawnedRanks(hang, 2, backend="gloo", start_method="fork", timeout_s=60)
print(" ".join(map(str, ranks.pids)), flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # the caller subprocess imports torch: ~5-20 s on a loaded 2-core machine
def test_ranks_die_with_a_killed_caller():
    import subprocess
    import sys

    caller = subprocess.Popen([sys.executable, "-c", _CALLER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        caller.kill()
