"""Spawn N local ranks, each with its own ParallelState, and supervise them (the single-host launcher).

`SpawnedRanks(fn, world_size, ...)` starts one process per rank. Rendezvous: the caller hosts a `TCPStore` on a port
the OS picks (port 0), so there is no free-port race. Every child runs `fn(state, *args)` and sends its return value
(or its traceback) back through a pipe. The caller supervises the children: the first rank that raises, dies (any
signal, SIGKILL included) or exits without a result makes the caller terminate every other rank and raise
`RankFailedError` naming that rank; `join(timeout_s)` bounds the whole run. Children die with the caller
(PR_SET_PDEATHSIG on Linux, plus a parent-pid watchdog thread), and `close()` / the context manager / a finalizer
kill what is left, so no rank outlives its owner. Multi-host worlds use `torchrun` + `ParallelState.from_env`.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.errors import ParallelConfigError, RankFailedError
from deepinfer_parallel.state import DEFAULT_TIMEOUT_S, ParallelState

__all__ = ["SpawnedRanks", "spawn_ranks"]

_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
_TERM_GRACE_S = 2.0
_SETTLE_S = 1.0
# Messages of errors a rank gets because a *peer* failed (gloo, NCCL, c10d timeouts).
_PEER_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "timed out", "Timed out",
                "NCCL communicator was aborted", "remote process exited", "ProcessGroupGloo", "DistNetworkError")


def _die_with_parent(parent_pid: int) -> None:
    """Make this child exit when the process that spawned it goes away (killed included)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    # PDEATHSIG fires when the spawning *thread* exits and is Linux-only: the watchdog covers the rest.
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="deepinfer-parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the watch started
        os._exit(1)


def _rank_main(
    rank: int, world_size: int, parent_pid: int, config: ParallelConfig | None, backend: str | None,
    devices: Sequence[str] | None, timeout_s: float, threads: int, fn: Callable[..., Any], args: tuple,
    conn: Connection,
) -> None:
    _die_with_parent(parent_pid)
    import torch

    # Forked children must not reuse the parent's OpenMP pool; small per-rank work wants few threads anyway.
    torch.set_num_threads(threads)
    state = None
    try:
        # The caller starts the rendezvous store only after every rank is forked (forking while the store's server
        # thread holds a lock can deadlock the child), then sends its port.
        if not conn.poll(timeout_s):
            raise TimeoutError(f"no rendezvous port from the caller within {timeout_s} s")
        port = conn.recv()
        store = dist.TCPStore(_HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout_s))
        state = ParallelState.initialize(
            rank=rank, world_size=world_size, local_rank=rank, config=config, store=store, backend=backend,
            device=None if devices is None else devices[rank], timeout_s=timeout_s,
        )
        result = fn(state, *args)
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller with its traceback
        try:
            conn.send(("error", "".join(traceback.format_exception(exc))))
        finally:
            conn.close()
            os._exit(1)  # skip atexit / group teardown that could block on dead peers
    try:
        state.destroy()
    finally:
        conn.close()


def _kill_all(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)


class SpawnedRanks:
    """N supervised local ranks running `fn(state: ParallelState, *args) -> picklable result`.

    start_method: "spawn" (default; required once CUDA is initialised in the caller; `fn` must be importable by
    module and name) or "fork" (Linux, CPU only: starts in milliseconds, `fn` may be any callable).
    devices: per-rank device strings (default: cuda:<rank> with NCCL, cpu with gloo).
    timeout_s: the default of `join` and the collective timeout inside every rank.
    Use as a context manager, or call `close()`; a finalizer kills leftover ranks if the object is dropped.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        config: ParallelConfig | None = None,
        backend: str | None = None,
        devices: Sequence[str] | None = None,
        start_method: str = "spawn",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        threads: int = 1,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ParallelConfigError(f"world_size: expected an int >= 1, found {world_size!r}")
        # Not "forkserver": its children are the server's, so they could not watch (or die with) the caller.
        if start_method not in ("spawn", "fork"):
            raise ParallelConfigError(f"start_method: expected 'spawn' or 'fork', found {start_method!r}")
        if devices is not None and len(devices) != world_size:
            raise ParallelConfigError(f"devices: expected {world_size} entries, found {len(devices)}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._store: dist.TCPStore | None = None
        ctx = mp.get_context(start_method)
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._results: dict[int, Any] = {}
        self._failed: set[int] = set()
        self._closed = False
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_rank_main,
                    args=(rank, world_size, os.getpid(), config, backend, devices, timeout_s,
                          threads, fn, args, child_end),
                    name=f"deepinfer-rank{rank}", daemon=True,
                )
                p.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(p)
            self._store = dist.TCPStore(_HOST, 0, world_size=None, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s))
            for conn in self._conns:
                conn.send(self._store.port)
        except BaseException:
            _kill_all(self._procs)
            raise
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def _collect(self) -> dict[int, tuple[int | None, str]]:
        """Read every ready pipe and exited process; return the failures seen so far (rank -> (code, detail))."""
        failures: dict[int, tuple[int | None, str]] = {}
        for rank, p in enumerate(self._procs):
            if rank in self._results or rank in self._failed:
                continue
            conn = self._conns[rank]
            if not conn.closed and conn.poll():
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "eof", None
                if kind == "ok":
                    self._results[rank] = payload
                    continue
                if kind == "error":
                    p.join(1.0)
                    failures[rank] = (p.exitcode, f"raised:\n{payload}")
                    self._failed.add(rank)
                    continue
            if p.exitcode is not None and rank not in self._results:
                code = p.exitcode
                reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code} without a result"
                failures[rank] = (code, reason)
                self._failed.add(rank)
        return failures

    def _raise_failure(self, failures: dict[int, tuple[int | None, str]]) -> None:
        # Once one rank dies its peers fail too (connection reset, collective timeout): give them a moment to
        # report, then blame the root cause: a killed / silent rank first, then a rank whose error is not a
        # communication error, then the lowest rank.
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline and len(failures) + len(self._results) < self.world_size:
            time.sleep(0.05)
            failures.update(self._collect())
        self.close()

        def blame(item: tuple[int, tuple[int | None, str]]) -> tuple[int, int]:
            rank, (code, detail) = item
            if not detail.startswith("raised:"):
                return (0, rank)
            return (2 if any(m in detail for m in _PEER_ERRORS) else 1, rank)

        rank, (code, detail) = min(failures.items(), key=blame)
        others = sorted(r for r in failures if r != rank)
        if others:
            detail += f"\n(ranks {others} failed after it)"
        raise RankFailedError(rank, code, detail)

    def poll(self) -> bool:
        """Collect finished ranks without blocking; raise RankFailedError if one failed. True once all returned."""
        if self._closed and len(self._results) < self.world_size:
            raise RankFailedError(-1, None, "ranks were closed before they finished")
        failures = self._collect()
        if failures:
            self._raise_failure(failures)
        return len(self._results) == self.world_size

    def join(self, timeout_s: float | None = None) -> list[Any]:
        """Wait for every rank; return their results by rank. Raises RankFailedError on the first failure or, naming
        the ranks still running, when timeout_s (default: the constructor's) passes. Ranks are gone afterwards."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not self.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r in range(self.world_size) if r not in self._results]
                self.close()
                raise RankFailedError(running[0], None, f"ranks {running} still running after the timeout")
            pending = [self._conns[r] for r in range(self.world_size) if r not in self._results]
            pending += [self._procs[r].sentinel for r in range(self.world_size) if r not in self._results]
            wait(pending, timeout=min(left, 1.0))
        for p in self._procs:
            p.join(5.0)
        self.close()
        return [self._results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Terminate (then kill) every rank still running and release the rendezvous store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        for conn in self._conns:
            conn.close()
        self._store = None

    def __enter__(self) -> SpawnedRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                **kwargs: Any) -> list[Any]:
    """Run `fn(state, *args)` on `world_size` local ranks and return the results by rank (see `SpawnedRanks`)."""
    with SpawnedRanks(fn, world_size, *args, timeout_s=timeout_s, **kwargs) as ranks:
        return ranks.join(timeout_s)
