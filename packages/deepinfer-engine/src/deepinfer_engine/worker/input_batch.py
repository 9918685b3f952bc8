"""The runner's persistent input batch: per-request block tables kept across steps and updated from the
scheduler's diffs, host (pinned) staging buffers and static device buffers for the step's inputs.

Per step the runner hands `prepare(chunks)` the scheduled chunks; it writes token ids, positions, logit rows,
the per-sequence ints and the block tables of the batch into one pinned host buffer (int64 arrays, then the
int32 tables at an 8-byte aligned offset), issues ONE non-blocking copy into a static device buffer (the
ForwardBatch tensors are typed views of it), and returns the host copy of the same facts (`StepHost`) so that the
forward never reads them back. Shapes grow by doubling when a step needs more
(outside a captured graph; CUDA graphs would size them once for the largest bucket).

Buffer reuse: the copies of step k read the pinned buffers asynchronously; step k + 1 waits for an event recorded
after them before overwriting the buffers. Every step that samples ends with a host read of the sampled ids, so
that event has normally completed and the wait is a query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from deepinfer_engine.core.sched_output import ScheduledChunk, SchedulerOutput
from deepinfer_engine.errors import InputError
from deepinfer_engine.model.cache import SeqTensors
from deepinfer_engine.model.forward_batch import StepHost

__all__ = ["InputBatch", "StepInputs"]


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """Device views (rows [:T] / [:S, :P] of the static buffers) and the host facts of one step.

    input_ids / positions: [T] int64;  block_tables: [S, P] int32;  logits_indices: [N] int64;
    seq: the per-sequence [S] int64 tensors (ctx = first positions, qlen, start = query_start_loc[:-1], slot).
    """

    input_ids: Tensor
    positions: Tensor
    block_tables: Tensor
    logits_indices: Tensor
    seq: SeqTensors  # [S] int64 first positions, lengths, first rows (query_start_loc), slots
    seq_of_token: Tensor  # [T] int64 sequence of each token
    query_lens: tuple[int, ...]
    slots: tuple[int, ...]
    host: StepHost


class _Buffers:
    """A flat pinned host byte buffer and a static device buffer of the same size (on CPU the host buffer is the
    input itself). Typed views of byte ranges are the step's tensors (contiguous, any 2-D shape)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = self.host if device.type == "cpu" else torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.np = self.host.numpy()

    @property
    def size(self) -> int:
        return self.np.shape[0]

    def send(self, nbytes: int) -> None:
        """Copy host[:nbytes] into dev[:nbytes] (non-blocking)."""
        if self.dev is not self.host:
            self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def view(self, lo: int, n: int, dtype: torch.dtype, np_dtype: type) -> tuple[np.ndarray, Tensor]:
        """(host, device) views of n elements of `dtype` from byte `lo` on."""
        hi = lo + n * np.dtype(np_dtype).itemsize
        return self.np[lo:hi].view(np_dtype), self.dev[lo:hi].view(dtype)


class InputBatch:
    """Block tables of the running requests (host, one row each) plus the per-step staging buffers."""

    def __init__(self, device: torch.device | str, *, max_num_tokens: int = 256, max_table: int = 256) -> None:
        self.device = torch.device(device)
        self._tables: dict[str, list[int]] = {}  # req_id -> its block table (the concatenated page diffs)
        # ids | positions | logit rows | per-sequence ints | token -> sequence (int64), then [S, P] int32 tables
        self._buf = _Buffers(8 * 3 * max_num_tokens + 4 * max_table, self.device)
        self._event = torch.cuda.Event() if self.device.type == "cuda" else None  # recorded after each copy
        self._copied = False

    # ------------------------------------------------------------------------------------ diffs
    def update(self, sched: SchedulerOutput) -> None:
        """Apply one scheduler output's diff: forget finished / preempted requests, start the tables of new
        (or resumed) requests, append each chunk's new pages."""
        for rid in sched.finished_req_ids:
            self._tables.pop(rid, None)
        for rid in sched.preempted_req_ids:
            self._tables.pop(rid, None)
        for nr in sched.new_requests:
            self._tables[nr.req_id] = []  # a resumed request's pages were freed: its diff resends all of them
        for c in sched.chunks:
            table = self._tables.get(c.req_id)
            if table is None:
                raise InputError(
                    f"scheduler output: chunk of request {c.req_id!r}, which the runner was never sent; expected "
                    "its NewRequestData in this or an earlier step"
                )
            table.extend(c.new_page_ids)

    def block_table(self, req_id: str) -> tuple[int, ...]:
        return tuple(self._tables[req_id])

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    # ------------------------------------------------------------------------------------ one step
    def _grow(self, nbytes: int) -> None:
        if nbytes > self._buf.size:
            self._buf = _Buffers(_pow2(nbytes), self.device)

    def prepare(self, chunks: Sequence[ScheduledChunk], logit_rows: Sequence[int]) -> StepInputs:
        """Inputs of the step that feeds `chunks` (batch order) and returns the logits of rows `logit_rows`."""
        # one pass per field over the chunks, then numpy: these Python lists are the per-request cost of a step
        S = len(chunks)
        token_ids = [c.token_ids for c in chunks]
        qlens = tuple(map(len, token_ids))
        T, N = sum(qlens), len(logit_rows)
        tables = [self._tables[c.req_id] for c in chunks]
        table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=S)
        P = max(1, int(table_lens.max()) if S else 1)
        if self._copied:
            if not self._event.query():  # the previous step's copy still reads the pinned buffer
                self._event.synchronize()
            self._copied = False
        ints = 3 * T + N + 4 * S  # ids, positions, logit rows, per-sequence ints, token -> sequence
        self._grow(8 * ints + 4 * S * P)
        tok, packed = self._buf.view(0, ints, torch.int64, np.int64)
        ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=T)
        tok[:T] = ids
        ctx_lens = tuple(int(c.start_position) for c in chunks)
        slots = tuple(c.slot for c in chunks)
        starts = np.asarray(ctx_lens, dtype=np.int64)
        q = np.asarray(qlens, dtype=np.int64)
        offs = np.cumsum(q) - q
        tok[T : 2 * T] = np.repeat(starts - offs, q) + np.arange(T, dtype=np.int64)  # consecutive per sequence
        tok[2 * T : 2 * T + N] = logit_rows
        o = 2 * T + N  # per-sequence ints, then the token -> sequence map
        tok[o : o + S] = starts
        tok[o + S : o + 2 * S] = q
        tok[o + 2 * S : o + 3 * S] = offs
        tok[o + 3 * S : o + 4 * S] = slots
        tok[o + 4 * S : o + 4 * S + T] = np.repeat(np.arange(S, dtype=np.int64), q)
        bt_np, bt_dev = self._buf.view(8 * ints, S * P, torch.int32, np.int32)
        bt = bt_np.reshape(S, P)
        bt.fill(-1)
        # every table at once: row i holds table i in its first table_lens[i] columns
        pages = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum()))
        bt[np.repeat(np.arange(S), table_lens),
           np.arange(pages.size) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)] = pages
        host = StepHost(ctx_lens=ctx_lens, input_ids=ids, block_tables=bt.copy())
        self._buf.send(8 * ints + 4 * S * P)  # ONE copy for every int of the step, tables included
        seq = packed[o:]
        inputs = StepInputs(
            input_ids=packed[:T],
            positions=packed[T : 2 * T],
            logits_indices=packed[2 * T : o],
            seq=SeqTensors(ctx=seq[:S], qlen=seq[S : 2 * S], start=seq[2 * S : 3 * S], slot=seq[3 * S : 4 * S]),
            seq_of_token=seq[4 * S :],
            block_tables=bt_dev.view(S, P),
            query_lens=qlens,
            slots=slots,
            host=host,
        )
        if self._event is not None:
            self._event.record()
            self._copied = True
        return inputs


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
