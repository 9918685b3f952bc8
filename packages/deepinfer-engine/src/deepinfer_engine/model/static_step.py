"""Fixed-shape decode steps: the inputs and gather plans of a step of B sequences x 1 new token, with every
tensor at a size that depends only on (B, L), so that the forward can be captured once in a CUDA graph and
replayed for any batch of at most B decoding sequences whose lengths stay below L (docs/cuda_graphs.md).

`StaticDecodeStep` owns static device buffers (token ids, positions, per-sequence ints and every gather plan a
forward asks for) and a pinned host twin of each; Engram row ids are computed inside the step from the token ids
and the cache's device token ring (docs/async_scheduling.md). `fill(...)` writes one step's facts into the host
twins and copies them into the device buffers (one non-blocking copy per buffer); the captured kernels read the
device buffers in place. Rows past the real sequences are padding: slot = the cache's scratch slot,
position 0, token 0; their ring writes land in the scratch slot and their compressed entries in the scratch
page, which no request owns.

Plans differ from the exact ones of `ForwardContext` (cache.py) only in size, never in the rows a real query
attends to:
- ring plans read `max_back` history rows for every sequence (stale rows of positions < 0 are never selected:
  window masks drop positions < 0, compressors only read positions of the entry they complete);
- paged plans give every sequence `ceil(L / ratio)` entry slots (rows past its count read the scratch page and
  are masked by the causal masks) and one new-entry row: the entry its token completes, or, when it completes
  none, the entry in progress, written to the scratch page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer_engine.errors import CapacityError, InputError
from deepinfer_engine.model.cache import (
    PagedPlan,
    RingPlan,
    SeqHost,
    SeqTensors,
    check_block_tables,
    ring_plan_arrays,
    ring_plan_from,
)
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext, StepHost

__all__ = ["DecodeFacts", "StaticDecodeStep", "static_paged_arrays"]


@dataclass(frozen=True, kw_only=True)
class DecodeFacts:
    """Host facts of the real sequences of one decode step (S <= B, one new token each).

    ctx: [S] int64 first position (= the position of the new token); slots: [S] int64 cache slots;
    input_ids: [S] int64; block_tables: [S, P] int32/int64 page ids (-1 = unused).
    """

    ctx: np.ndarray
    slots: np.ndarray
    input_ids: np.ndarray
    block_tables: np.ndarray

    @classmethod
    def of(cls, batch: ForwardBatch) -> DecodeFacts:
        """From a one-token-per-sequence batch carrying its host facts (the runner's batches do)."""
        host = batch.host if batch.host is not None else StepHost.read(batch)
        if batch.num_tokens != batch.num_seqs:
            raise InputError(f"decode facts: found {batch.num_tokens} tokens for {batch.num_seqs} sequences, "
                             "expected one each")  # fmt: skip
        return cls(
            ctx=np.asarray(host.ctx_lens, dtype=np.int64), slots=np.asarray(batch.slots, dtype=np.int64),
            input_ids=np.asarray(host.input_ids, dtype=np.int64), block_tables=np.asarray(host.block_tables),
        )  # fmt: skip


def static_paged_arrays(
    ratio: int, page_size: int, block_tables: np.ndarray, seqs: SeqHost, real: np.ndarray, width: int,
    scratch_row: int,
) -> list[np.ndarray]:
    """Host arrays of a fixed-size PagedPlan for B one-token sequences: [read_rows [B*width], write_rows [B],
    new_w [B], new_seq [B], offsets [B]].

    real: [B] bool (False = padding row). Entry slot w of sequence i reads its page row while w < count_i =
    (ctx_i + 1) // ratio, else `scratch_row`. The new-entry row of i is its completed entry ctx_i // ratio when
    (ctx_i + 1) % ratio == 0, else `scratch_row` (the entry in progress is computed and dropped there)."""
    r, P = ratio, page_size
    per_page = P // r
    B = seqs.ctx.shape[0]
    bt = np.asarray(block_tables, dtype=np.int64)
    width_pages = bt.shape[1]

    def rows(seq: np.ndarray, w: np.ndarray, ok: np.ndarray) -> np.ndarray:
        tok = w * r
        page = np.where(ok, tok // P, 0).clip(0, max(0, width_pages - 1))
        pid = bt[seq, page] if width_pages else np.full(seq.shape, -1, dtype=np.int64)
        ok = ok & (pid >= 0)
        return np.where(ok, pid * per_page + (tok % P) // r, scratch_row)

    counts = np.where(real, (seqs.ctx + 1) // r, 0)
    if int(counts.max(initial=0)) > width:
        raise CapacityError(f"fixed-shape step of {width} entries per sequence: a sequence has {int(counts.max())}")
    # entry w lives in page table[w // per_page], row w % per_page of it: one broadcast over the table, no gather
    npages = -(-width // per_page)
    table = np.full((B, npages), -1, dtype=np.int64)
    k = min(npages, width_pages)
    table[:, :k] = bt[:, :k]
    grid = (table[:, :, None] * per_page + np.arange(per_page, dtype=np.int64)).reshape(B, -1)[:, :width]
    valid = (np.arange(width, dtype=np.int64) < counts[:, None]) & (grid >= 0)
    read_rows = np.where(valid, grid, scratch_row).reshape(-1)
    new_w = seqs.ctx // r
    done = real & ((seqs.ctx + 1) % r == 0)
    write_rows = rows(np.arange(B, dtype=np.int64), new_w, done)
    offsets = np.arange(B, dtype=np.int64) * width
    return [read_rows, write_rows, new_w, np.arange(B, dtype=np.int64), offsets]


class _Buffer:
    """A pinned host array and a device tensor of the same shape (on CPU one tensor serves as both)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(shape, dtype=torch.int64, device=device) if cuda else self.host
        self.np = self.host.numpy()

    def send(self) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)


class StaticDecodeStep:
    """Static inputs + plans of a decode step of `batch_size` rows whose sequences end before position `max_len`.

    The forward run with `static=this` (Transformer.forward_features) takes every plan from here; plans are
    registered on first request (the warm-up run before capture) and rebuilt by every later `fill`.
    """

    def __init__(self, cache: object, batch_size: int, max_len: int, device: torch.device | str) -> None:
        if batch_size < 1 or max_len < 1:
            raise InputError(f"static decode step: batch_size {batch_size}, max_len {max_len}; expected >= 1")
        self.cache = cache
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.device = torch.device(device)
        B = self.batch_size
        self._seq = _Buffer((5, B), self.device)  # input ids | ctx (= positions) | qlen | start | slot
        self._plans: dict[tuple, tuple[_Buffer, list[int], Callable[[], list[np.ndarray]], object]] = {}
        self._copied: torch.cuda.Event | None = None
        self._bt = np.full((B, 1), -1, dtype=np.int64)
        self._real = np.zeros(B, dtype=bool)
        dev = self._seq.dev
        self.seq_t = SeqTensors(ctx=dev[1], qlen=dev[2], start=dev[3], slot=dev[4])
        arange = torch.arange(B, dtype=torch.int64, device=self.device)
        self.batch = ForwardBatch(
            input_ids=dev[0], positions=dev[1], query_lens=(1,) * B,
            slots=tuple(range(B)),  # placeholders: the slots live in seq_t (the scratch slot repeats)
            block_tables=torch.full((B, 1), -1, dtype=torch.int32, device=self.device),
            logits_indices=arange, seq=self.seq_t, seq_of_token=arange,
        )  # fmt: skip
        self.fill(DecodeFacts(ctx=np.zeros(0, np.int64), slots=np.zeros(0, np.int64),
                              input_ids=np.zeros(0, np.int64), block_tables=np.full((0, 1), -1, np.int64)))

    # ------------------------------------------------------------------------------------ per step
    @property
    def seq_host(self) -> SeqHost:
        s = self._seq.np
        return SeqHost(ctx=s[1], qlen=s[2], start=s[3], slot=s[4])

    def fill(self, facts: DecodeFacts) -> None:
        """Write one step's facts (S <= batch_size real sequences, the rest padding) and rebuild every plan.

        Waits (normally a query) for the previous step's copies before overwriting their pinned sources."""
        S, B = int(facts.ctx.shape[0]), self.batch_size
        if S > B:
            raise CapacityError(f"static decode step of {B} rows: found {S} sequences")
        if S and int(facts.ctx.max()) + 1 > self.max_len:
            raise CapacityError(f"static decode step up to length {self.max_len}: a sequence reaches "
                                f"{int(facts.ctx.max()) + 1}")  # fmt: skip
        if self._copied is not None:
            if not self._copied.query():
                self._copied.synchronize()
            self._copied = None
        scratch = self.cache.scratch_slot
        s = self._seq.np
        s[0, :S], s[0, S:] = facts.input_ids, 0
        s[1, :S], s[1, S:] = facts.ctx, 0
        s[2] = 1
        s[3] = np.arange(B)
        s[4, :S], s[4, S:] = facts.slots, scratch
        self._real[:S], self._real[S:] = True, False
        bt = np.asarray(facts.block_tables, dtype=np.int64)
        self._bt = np.full((B, max(1, bt.shape[1])), -1, dtype=np.int64)
        self._bt[:S, : bt.shape[1]] = bt
        self._seq.send()
        for buf, sizes, build, _ in self._plans.values():
            self._write(buf, sizes, build())
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    @staticmethod
    def _write(buf: _Buffer, sizes: list[int], parts: list[np.ndarray]) -> None:
        o = 0
        for n, p in zip(sizes, parts):
            if p.shape[0] != n:
                raise CapacityError(f"static plan part of {n} rows rebuilt with {p.shape[0]}")
            buf.np[o : o + n] = p
            o += n
        buf.send()

    def _register(self, key: tuple, build: Callable[[], list[np.ndarray]], make: Callable) -> object:
        entry = self._plans.get(key)
        if entry is None:
            parts = build()
            sizes = [int(p.shape[0]) for p in parts]
            buf = _Buffer((sum(sizes),), self.device)
            self._write(buf, sizes, parts)
            views = list(torch.split(buf.dev, sizes))
            entry = (buf, sizes, build, make(views))
            self._plans[key] = entry
        return entry[3]

    # ------------------------------------------------------------------------------------ plans
    def ring_plan(self, ring_rows: int, max_back: int, *, write: bool) -> RingPlan:
        B = self.batch_size

        def build() -> list[np.ndarray]:
            return ring_plan_arrays(ring_rows, (max_back,) * B, self.seq_host, write=write, clip=False)

        pool_len = B * max_back + B
        return self._register(("ring", ring_rows, max_back, write), build,
                              lambda v: ring_plan_from(ring_rows, v, pool_len=pool_len))  # type: ignore[return-value]

    def window_rows(self, plan: RingPlan, window: int) -> Tensor:
        """[B, window] int64 causal window rows into the pool of `plan` (one of this step's ring plans), -1 =
        none: ForwardContext.window_rows of a one-token step, built on the host with the other plans (the
        forward then spends no device op on it). Row k of sequence i is position q = ctx_i - window + 1 + k: a
        history row (q < ctx_i) or the sequence's fresh row (q = ctx_i), -1 for q < 0."""
        B = self.batch_size
        back = plan.num_hist // B  # every sequence reads max_back history rows (ring_plan)
        pool_len = plan.num_hist + B

        def build() -> list[np.ndarray]:
            ctx = self.seq_host.ctx[:, None]
            i = np.arange(B, dtype=np.int64)[:, None]
            q = ctx - window + 1 + np.arange(window, dtype=np.int64)[None, :]
            rows = np.where(q < ctx, i * back + q - (ctx - back), plan.num_hist + i + q - ctx).clip(0, pool_len - 1)
            return [np.where(q >= 0, rows, -1).reshape(-1)]

        key = ("win", plan.ring_rows, back, window)
        return self._register(key, build, lambda v: v[0].view(B, window))  # type: ignore[return-value]

    def entries_width(self, ratio: int) -> int:
        return -(-self.max_len // ratio)

    def paged_plan(self, ratio: int) -> PagedPlan:
        cache, B = self.cache, self.batch_size
        width = self.entries_width(ratio)
        scratch_row = cache.scratch_page * (cache.page_size // ratio)

        def build() -> list[np.ndarray]:
            return static_paged_arrays(ratio, cache.page_size, self._bt, self.seq_host, self._real, width,
                                       scratch_row)  # fmt: skip

        def make(v: list[Tensor]) -> PagedPlan:
            return PagedPlan(
                ratio=ratio, read_rows=v[0], write_rows=v[1], new_w=v[2], new_seq=v[3], num_new=B,
                offsets=tuple(range(0, B * width, width)), counts=(width,) * B, offsets_t=v[4],
            )  # fmt: skip

        return self._register(("paged", ratio), build, make)  # type: ignore[return-value]

    def check_tables(self, facts: DecodeFacts) -> None:
        """Block-table coverage of the real sequences (host; CapacityError as the exact plans raise)."""
        ratios = sorted(set(self.cache.ratios.values()))
        S = int(facts.ctx.shape[0])
        check_block_tables(facts.block_tables, self.cache.page_size, ratios, tuple(facts.ctx.tolist()), (1,) * S)

    def context(self, cache: object, **kw: object) -> ForwardContext:
        """The ForwardContext of a fixed-shape forward: its batch, sequence tensors and plans are this step's."""
        B = self.batch_size
        zeros = np.zeros(B, dtype=np.int64)
        return ForwardContext(
            batch=self.batch, cache=cache,
            host=StepHost(ctx_lens=(0,) * B, input_ids=zeros, block_tables=self._bt),  # placeholders
            seq_host=self.seq_host, seq_starts=tuple(range(B)), query_lens=(1,) * B, ctx_lens=(0,) * B,
            seq_of_token=self.batch.seq_of_token, seq_t=self.seq_t, static=self, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
