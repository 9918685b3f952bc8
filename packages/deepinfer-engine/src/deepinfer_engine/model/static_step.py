"""Fixed-shape decode steps: the inputs and gather plans of a step of B sequences x Q new tokens, with every
tensor at a size that depends only on (B, Q, L), so that the forward can be captured once in a CUDA graph and
replayed for any batch of at most B sequences feeding 1..Q tokens each whose lengths stay below L
(docs/cuda_graphs.md). Q = 1 is a plain decode step; Q > 1 a speculative verify step (each sequence: its last
token and up to Q - 1 drafts).

`StaticDecodeStep` owns static device buffers (token ids, positions, per-sequence ints, block tables and the
host-built gather plans: ring plans, a uniform step's window rows, visible entry counts) and a pinned host twin of
each; the paged plans, the new entries' rows and positions, a ragged step's window rows and the Engram row ids are
computed inside the forward by device ops from those buffers (docs/cuda_graphs.md, docs/async_scheduling.md).
`fill(...)` writes one step's facts into the host twins and copies them into the device buffers (one non-blocking
copy per buffer; once `freeze`d into one arena, one copy in all plus one per memoised plan that changed); the
captured kernels read the device buffers in place. Row j of sequence i is row i * Q + j, at position ctx_i + j.
Sequences past the real ones are padding: slot = the cache's scratch slot, positions 0 .. Q - 1, token 0; their ring
writes land in the scratch slot and their compressed entries in the scratch page, which no request owns. Rows j >=
n_i of a real sequence feeding n_i < Q tokens are padding too (token 0 at the next positions): they write ring rows
past the sequence's end, as rejected drafts do (overwritten when the sequence gets there; the cache's rollback slack
covers Q - 1 rows), no compressed entry (entries only its real tokens complete are written), and their logits are
dropped. A step made with `write_padding=False` (the DSpark context insertion) sends the ring writes of those rows
to the scratch slot instead, so that it writes exactly the rows the exact forward writes.

A ragged step (`rows=T`: the verify steps of speculative decoding) lays the real rows out back to back instead:
sequence i owns rows start_i .. start_i + n_i - 1 (start_i = n_0 + ... + n_(i-1), n_i <= Q), and rows sum n_i .. T - 1
belong to one extra padding sequence (index B, on the scratch slot, every row at position 0, within any rotary
table whatever T), so that no real sequence owns a padding row and the step costs T rows, not B * Q, whatever the
longest chunk. Its ring plans write exactly the real rows (the last min(n_i, R) of each sequence), so the
sequences' lengths after the step (not ctx_i + Q) must fit the length bucket; `seq_of_token`, `qlen` and `start`
are per-step buffers.

Plans differ from the exact ones of `ForwardContext` (cache.py) only in size, never in the rows a real query
attends to:
- ring plans read `max_back` history rows for every sequence (stale rows of positions < 0 are never selected:
  window masks drop positions < 0, compressors only read positions of the entry they complete);
- paged plans give every sequence `ceil(L / ratio)` entry slots (rows past its count read the scratch page and
  are masked by the causal masks) and `ceil(Q / ratio)` new-entry rows: entries ctx_i // ratio + k, written
  to their page when the sequence's real tokens complete them, else (in progress, or completed only by
  padding rows) to the scratch page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from deepinfer_kernels.paged_rows import PagedRowsConstants, paged_rows, paged_rows_constants
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
    ring_rows_disjoint,
)
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext, StepHost

__all__ = ["DecodeFacts", "StaticDecodeStep", "static_paged_plan"]


@dataclass(frozen=True, kw_only=True)
class DecodeFacts:
    """Host facts of the real sequences of one fixed-shape step (S <= B sequences, n_i >= 1 new tokens each).

    ctx: [S] int64 first position of each sequence's new tokens; slots: [S] int64 cache slots; input_ids:
    [sum n_i] int64, sequence-major; block_tables: [S, P] int32/int64 page ids (-1 = unused); query_lens: [S]
    int64 n_i, or None: one token each (a plain decode step).
    """

    ctx: np.ndarray
    slots: np.ndarray
    input_ids: np.ndarray
    block_tables: np.ndarray
    query_lens: np.ndarray | None = None

    @property
    def lens(self) -> np.ndarray:
        """[S] int64 new tokens per sequence."""
        if self.query_lens is None:
            return np.ones(self.ctx.shape[0], dtype=np.int64)
        return np.asarray(self.query_lens, dtype=np.int64)

    @classmethod
    def of(cls, batch: ForwardBatch, tokens: int = 1) -> DecodeFacts:
        """From a batch of at most `tokens` new tokens per sequence carrying its host facts (the runner's do)."""
        host = batch.host if batch.host is not None else StepHost.read(batch)
        if any(n > tokens for n in batch.query_lens):
            raise InputError(f"decode facts: found {max(batch.query_lens)} tokens for a sequence, expected at most "
                             f"{tokens} each")  # fmt: skip
        return cls(
            ctx=np.asarray(host.ctx_lens, dtype=np.int64), slots=np.asarray(batch.slots, dtype=np.int64),
            input_ids=np.asarray(host.input_ids, dtype=np.int64), block_tables=np.asarray(host.block_tables),
            query_lens=None if tokens == 1 else np.asarray(batch.query_lens, dtype=np.int64),
        )  # fmt: skip


def static_paged_plan(
    ratio: int, page_size: int, block_tables: Tensor, ctx: Tensor, lens: Tensor, width: int, scratch_row: int, *,
    tokens: int = 1, consts: PagedRowsConstants | None = None, backend: str = "auto",
) -> PagedPlan:
    """The fixed-size PagedPlan of S sequences of `tokens` (Q) rows each, computed on the device (a captured forward
    recomputes it at every replay from the step's buffers, so the host builds nothing when positions or tables
    change): read_rows [S * width], write_rows / new_w / new_seq [S * K] with K = ceil(Q / ratio) new-entry rows
    per sequence, offsets_t [S].

    block_tables: [S, P] int64 page ids (-1 = none; P pages cover at least `width` entries); ctx: [S] int64 first
    position (>= 0) of each sequence's new tokens; lens: [S] int64 real tokens n_i of each sequence (0 = a padding
    sequence; rows past n_i are padding). The rows are `deepinfer_kernels.paged_rows`': entry slot w of sequence
    i reads its page row while w < count_i = (ctx_i + n_i) // ratio, else `scratch_row`; new-entry row k of i is
    entry ctx_i // ratio + k, its page row when that entry is below count_i (completed by the sequence's real
    tokens), else `scratch_row` (an entry in progress, or one only padding rows complete, is computed and dropped
    there). Rows are equal to the exact plan's (`cache.build_paged_plan`) on every entry a real query reads or a
    real token completes.
    consts: the shape-only tensors (`paged_rows_constants`; made here when None). A captured step makes its own
    before the capture. backend: the kernel backend (one Triton launch per ratio on CUDA, else the torch reference:
    16 launches per ratio for one-token steps, 19 for verify steps; with the shape-only tensors made inside the
    plan, 30, and a B = 1 decode step of V4.1 at real width took 80 us longer than with host-built plans)."""
    r, S = int(ratio), int(ctx.shape[0])
    per_page = page_size // r
    npages = -(-width // per_page)
    if block_tables.shape != (S, block_tables.shape[1]) or block_tables.shape[1] < npages:
        raise InputError(f"static paged plan: block tables {tuple(block_tables.shape)}, expected [{S}, >= {npages}]")
    K = -(-int(tokens) // r)
    c = consts if consts is not None else paged_rows_constants(r, page_size, S, width, tokens, ctx.device)
    if c.slots.shape != (width,) or c.new_seq.shape != (S * K,):
        raise InputError(f"static paged plan: constants for {c.slots.shape[0]} slots and {c.new_seq.shape[0]} new "
                         f"entries, expected {width} and {S * K}")  # fmt: skip
    read_rows, write_rows, new_w = paged_rows(block_tables, ctx, lens, ratio=r, page_size=page_size, width=width,
                                              tokens=tokens, scratch_row=scratch_row, consts=c, backend=backend)
    return PagedPlan(
        ratio=r, read_rows=read_rows, write_rows=write_rows, new_w=new_w, new_seq=c.new_seq, num_new=S * K,
        offsets=tuple(range(0, S * width, width)), counts=(width,) * S, offsets_t=c.offsets_t,
    )  # fmt: skip


class _Buffer:
    """A pinned host array and a device tensor of the same shape (on CPU one tensor serves as both); or rows
    [lo, hi) of another _Buffer (`part`)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(shape, dtype=torch.int64, device=device) if cuda else self.host
        self.np = self.host.numpy()

    def part(self, lo: int, hi: int) -> _Buffer:
        out = _Buffer.__new__(_Buffer)
        out.host, out.np = self.host[lo:hi], self.np[lo:hi]
        out.dev = out.host if self.dev is self.host else self.dev[lo:hi]
        return out

    def send(self) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)


@dataclass
class _Plan:
    """One registered plan: its buffer (parts of `sizes` rows), how to rebuild its host arrays, the plan object
    over the device views, and `memo` (None: rebuilt every step): bytes that determine the arrays, so that a
    step whose memo equals the last build's skips the rebuild and the copy (the device buffer holds them)."""

    buf: _Buffer
    sizes: list[int]
    build: Callable[[], list[np.ndarray]]
    make: Callable[[list[Tensor]], object]
    obj: object
    memo: Callable[[], bytes] | None = None
    last: bytes | None = None


class StaticDecodeStep:
    """Static inputs + plans of a step of `batch_size` sequences x `tokens` rows whose sequences end before
    position `max_len` (tokens = 1: a plain decode step; > 1: a speculative verify step).

    write_padding: whether the ring rows of a real sequence's padding rows (j >= n_i) go to the sequence's
    own slot (True: the verify step, where they roll back like rejected drafts) or to the scratch slot (False:
    ring plans then write exactly the rows of each sequence's real tokens; only ring writes are affected).

    The forward run with `static=this` (Transformer.forward_features) takes every plan from here; plans are
    registered on first request (the warm-up run before capture) and rebuilt by every later `fill`.
    """

    def __init__(self, cache: object, batch_size: int, max_len: int, device: torch.device | str, *,
                 tokens: int = 1, write_padding: bool = True, rows: int | None = None) -> None:  # fmt: skip
        if batch_size < 1 or max_len < 1 or tokens < 1:
            raise InputError(f"static decode step: batch_size {batch_size}, max_len {max_len}, tokens {tokens}; "
                             "expected >= 1")  # fmt: skip
        if rows is not None and not batch_size <= rows <= batch_size * tokens:
            raise InputError(f"static decode step: rows {rows} for {batch_size} sequences of at most {tokens} "
                             f"tokens; expected {batch_size} .. {batch_size * tokens}")  # fmt: skip
        self.cache = cache
        self.batch_size, self.max_len, self.tokens = int(batch_size), int(max_len), int(tokens)
        self.write_padding = bool(write_padding)
        self.ragged = rows is not None
        self.device = torch.device(device)
        B, Q = self.batch_size, self.tokens
        T = self.num_rows = int(rows) if self.ragged else B * Q
        # a ragged step's padding rows belong to one more sequence (module docstring)
        S = self.num_seqs = B + 1 if self.ragged else B
        # the page columns every sequence's block table is padded to: enough for max_len tokens and for the entry
        # slots of every compressed ratio (`static_paged_plan`)
        page = int(cache.page_size)
        self._pages = max([1, -(-self.max_len // page)]
                          + [-(-self.entries_width(r) // (page // r)) for r in set(cache.ratios.values())])
        # one buffer, one copy per step: input ids | positions | real rows [T each] | ctx | qlen | start | slot [S
        # each] (| sequence of each row [T]: ragged steps) | real tokens per sequence [S] | block tables [S * pages]
        self._sizes = [T, T, T, S, S, S, S] + ([T] if self.ragged else []) + [S, S * self._pages]
        self._seq = _Buffer((sum(self._sizes),), self.device)
        self._plans: dict[tuple, _Plan] = {}
        # recorded after each fill's copies: the next fill rewrites the pinned sources only once they ran
        self._event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copied = False
        self._ones = np.ones(B, dtype=np.int64)
        self._dynamic: _Buffer | None = None  # after freeze(): the arena part copied every step
        a = self._seq.np
        if not self.ragged:  # qlen and start never change (every sequence has Q rows)
            a[3 * T + B : 3 * T + 2 * B] = Q
            a[3 * T + 2 * B : 3 * T + 3 * B] = np.arange(B, dtype=np.int64) * Q
        self._arange = np.arange(max(S, T), dtype=np.int64)
        # a uniform step's row -> sequence map never changes; a ragged step's is a per-step buffer (`_sizes`)
        self._seq_of_token = None if self.ragged else torch.arange(B, device=self.device).repeat_interleave(Q)
        # made here, before any capture, so that a captured forward replays only the plan ops that read buffers
        self._plan_consts = {r: paged_rows_constants(r, page, S, self.entries_width(r), Q, self.device)
                             for r in sorted(set(cache.ratios.values()))}
        self._bind_seq()
        self.fill(DecodeFacts(ctx=np.zeros(0, np.int64), slots=np.zeros(0, np.int64),
                              input_ids=np.zeros(0, np.int64), block_tables=np.full((0, 1), -1, np.int64)))

    def _bind_seq(self) -> None:
        """The batch, sequence tensors and host views over the current `_seq` buffer."""
        B, Q, T = self.batch_size, self.tokens, self.num_rows
        ids, pos, rows, ctx, qlen, start, slot, *sot, lens, bt = torch.split(self._seq.dev, self._sizes)
        a = self._seq.np
        ends = np.cumsum(self._sizes)
        self._views = [a[e - n : e] for e, n in zip(ends.tolist(), self._sizes)]
        # real tokens per sequence (0 on padding sequences) and block tables, on the host and the device
        self._lens, self._lens_t = self._views[-2], lens
        self._bt, self._bt_t = self._views[-1].reshape(self.num_seqs, self._pages), bt.view(self.num_seqs, self._pages)
        self.seq_t = SeqTensors(ctx=ctx, qlen=qlen, start=start, slot=slot)
        # [T] int64: the rows of the real tokens in batch order (`rows_of`), then 0s: rows [:sum n_i] of a step's
        # outputs are its real rows, gathered on the device without another copy
        self.real_rows = rows
        self.batch = ForwardBatch(
            input_ids=ids, positions=pos,
            # placeholders (the lengths and slots live in seq_t; the scratch slot repeats)
            query_lens=(1,) * (B - 1) + (T - B + 1,) if self.ragged else (Q,) * B, slots=tuple(range(B)),
            block_tables=torch.full((B, 1), -1, dtype=torch.int32, device=self.device),
            logits_indices=torch.arange(T, dtype=torch.int64, device=self.device), seq=self.seq_t,
            seq_of_token=sot[0] if self.ragged else self._seq_of_token,
        )  # fmt: skip

    def freeze(self) -> None:
        """Move the step's buffers into one arena, [sequence ints | plans rebuilt every step | memoised plans], so
        that a fill sends one copy (plus one per memoised plan that changed) instead of one per buffer. Call it
        after a warm-up forward registered every plan and before capturing: it replaces the device tensors (and
        the batch, sequence tensors and plan objects over them), so nothing captured earlier may hold the old
        ones. Later plan requests raise. Idempotent."""
        if self._dynamic is not None:
            return
        plans = list(self._plans.values())
        bufs = [self._seq, *(p.buf for p in plans if p.memo is None), *(p.buf for p in plans if p.memo is not None)]
        lens = [int(b.np.shape[0]) for b in bufs]
        arena = _Buffer((sum(lens),), self.device)
        parts, o = [], 0
        for b, n in zip(bufs, lens):
            part = arena.part(o, o + n)
            part.np[:] = b.np
            if part.dev is not part.host:
                part.dev.copy_(b.dev)  # stream-ordered after any pending copy into the old buffer
            parts.append(part)
            o += n
        dynamic = sum(lens[: 1 + sum(p.memo is None for p in plans)])
        self._seq = parts[0]
        for p, part in zip([p for p in plans if p.memo is None] + [p for p in plans if p.memo is not None], parts[1:]):
            p.buf = part
            p.obj = p.make(list(torch.split(part.dev, p.sizes)))
        self._bind_seq()
        self._dynamic = arena.part(0, dynamic)

    # ------------------------------------------------------------------------------------ per step
    def _host_views(self) -> list[np.ndarray]:
        """[ids, positions, real rows, ctx, qlen, start, slot(, sequence of each row)]: views of the pinned host
        buffer (made once)."""
        return self._views

    @property
    def seq_host(self) -> SeqHost:
        _, _, _, ctx, qlen, start, slot = self._host_views()[:7]
        return SeqHost(ctx=ctx, qlen=qlen, start=start, slot=slot)

    def rows_of(self, query_lens: np.ndarray | tuple[int, ...]) -> np.ndarray:
        """[sum n_i] int64 rows of this step holding the real tokens of sequences with query_lens n_i, in
        batch (sequence-major) order: row i * tokens + j for j < n_i (ragged steps: rows 0 .. sum n_i - 1)."""
        n = np.asarray(query_lens, dtype=np.int64)
        if self.ragged:
            return np.arange(int(n.sum()), dtype=np.int64)
        starts = np.arange(n.shape[0], dtype=np.int64) * self.tokens
        return np.repeat(starts, n) + (np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n))

    def fill(self, facts: DecodeFacts) -> None:
        """Write one step's facts (S <= batch_size real sequences, the rest padding) and rebuild every plan.

        Waits (normally a query) for the previous step's copies before overwriting their pinned sources."""
        S, B, Q = int(facts.ctx.shape[0]), self.batch_size, self.tokens
        if S > B:
            raise CapacityError(f"static decode step of {B} rows: found {S} sequences")
        if facts.query_lens is None:  # one token per sequence
            lens = self._ones[:S]
            if int(facts.input_ids.shape[0]) != S:
                raise InputError(f"decode facts: found {facts.input_ids.shape[0]} input ids, expected {S}")
        else:
            lens = facts.lens
            if S and (int(lens.min()) < 1 or int(lens.max()) > Q):
                raise CapacityError(f"static decode step of {Q} tokens per sequence: found query lengths "
                                    f"{lens.tolist()}")  # fmt: skip
            if int(facts.input_ids.shape[0]) != int(lens.sum()):
                raise InputError(f"decode facts: found {facts.input_ids.shape[0]} input ids, expected "
                                 f"{int(lens.sum())}")  # fmt: skip
        if self.ragged and int(lens.sum()) > self.num_rows:
            raise CapacityError(f"static decode step of {self.num_rows} rows: found {int(lens.sum())} tokens")
        reach = 0 if not S else int((facts.ctx + lens).max()) if self.ragged else int(facts.ctx.max()) + Q
        if S and reach > self.max_len:
            raise CapacityError(f"static decode step up to length {self.max_len}: a sequence reaches {reach}")
        if self._copied:
            if not self._event.query():
                self._event.synchronize()
            self._copied = False
        ids, pos, real_rows, ctx, qlen, start, slot = self._views[:7]
        ctx[:S], ctx[S:] = facts.ctx, 0
        if self.ragged:  # sequence i: rows start_i .. start_i + n_i - 1; the padding sequence B: the rest
            n = int(lens.sum())
            sot = self._views[7]
            qlen[:S], qlen[S:] = lens, 0
            qlen[B] = self.num_rows - n
            start[:S], start[S:] = np.cumsum(lens) - lens, n
            sot[:n], sot[n:] = np.repeat(self._arange[:S], lens), B
            pos[:n] = ctx[sot[:n]] + self._arange[:n] - start[sot[:n]]
            pos[n:] = 0
            ids[:n], ids[n:] = facts.input_ids, 0
            real_rows[:n], real_rows[n:] = self._arange[:n], 0
        elif Q == 1:  # row i = sequence i at position ctx_i
            ids[:S], ids[S:] = facts.input_ids, 0
            real_rows[:S], real_rows[S:] = self._arange[:S], 0
            pos[:] = ctx
        else:
            rows = self.rows_of(lens)
            ids[:] = 0
            ids[rows] = facts.input_ids
            real_rows[: rows.shape[0]], real_rows[rows.shape[0] :] = rows, 0
            pos[:] = (ctx[:, None] + self._arange[:Q][None, :]).reshape(-1)
        slot[:S], slot[S:] = facts.slots, self.cache.scratch_slot
        self._lens[:S], self._lens[S:] = lens, 0
        # columns past `_pages` hold pages of positions >= max_len, which no entry of this step reaches
        bt = np.asarray(facts.block_tables)[:, : self._pages]
        self._bt[:S, : bt.shape[1]], self._bt[:S, bt.shape[1] :], self._bt[S:] = bt, -1, -1
        frozen = self._dynamic is not None  # then the sequence ints and every-step plans go in one copy
        if not frozen:
            self._seq.send()
        for plan in self._plans.values():
            memo = plan.memo() if plan.memo is not None else None
            if memo is None or memo != plan.last:
                self._write(plan.buf, plan.sizes, plan.build(), send=not frozen or memo is not None)
                plan.last = memo
        if frozen:
            self._dynamic.send()
        if self._event is not None:
            self._event.record()
            self._copied = True

    @staticmethod
    def _write(buf: _Buffer, sizes: list[int], parts: list[np.ndarray], *, send: bool = True) -> None:
        o = 0
        for n, p in zip(sizes, parts):
            if p.shape[0] != n:
                raise CapacityError(f"static plan part of {n} rows rebuilt with {p.shape[0]}")
            buf.np[o : o + n] = p
            o += n
        if send:
            buf.send()

    def _register(self, key: tuple, build: Callable[[], list[np.ndarray]], make: Callable,
                  memo: Callable[[], bytes] | None = None) -> object:
        plan = self._plans.get(key)
        if plan is None:
            parts = build()
            sizes = [int(p.shape[0]) for p in parts]
            buf = _Buffer((sum(sizes),), self.device)
            self._write(buf, sizes, parts)
            if self._dynamic is not None:
                raise InputError(f"static decode step: plan {key} asked for after freeze(); every plan must be "
                                 "registered by the warm-up forward before the step is frozen")
            plan = _Plan(buf=buf, sizes=sizes, build=build, make=make, obj=make(list(torch.split(buf.dev, sizes))),
                         memo=memo, last=memo() if memo is not None else None)
            self._plans[key] = plan
        return plan.obj

    # ------------------------------------------------------------------------------------ plans
    def ring_plan(self, ring_rows: int, max_back: int, *, write: bool) -> RingPlan:
        B, Q, R = self.num_seqs, self.tokens, ring_rows
        key = ("ring", ring_rows, max_back, write)
        if key not in self._plans:  # the exact builder checks the ring holds max_back rows (CapacityError)
            ring_plan_arrays(R, (max_back,) * B, self.seq_host, write=write, clip=False)
        # ring_plan_arrays(clip=False) of this step's sequences: every sequence reads max_back rows and (qlen = Q,
        # start = i * Q) writes its last k = min(Q, R) rows, so only ctx and slot vary; the rest is built once
        # (tests/model/test_static_step.py checks the two builders agree). A ragged step writes the last k of its
        # n_i rows (start_i + n_i - k ..; those before start_i go to the scratch slot)
        seg = np.repeat(np.arange(B, dtype=np.int64), max_back)
        j = np.tile(np.arange(max_back, dtype=np.int64), B)
        hist_off = np.arange(B, dtype=np.int64) * max_back
        k = min(Q, R)
        kseg = np.repeat(np.arange(B, dtype=np.int64), k)
        kj = np.tile(np.arange(k, dtype=np.int64), B) + (Q - k)
        write_src = kseg * Q + kj
        scratch = int(self.cache.scratch_slot)
        last = self.num_rows - 1

        def build() -> list[np.ndarray]:
            _, _, _, ctx, _, start, slot = self._host_views()[:7]
            first = ctx - max_back
            parts = [slot[seg] * R + (first[seg] + j) % R, hist_off, first]
            if write and self.ragged:
                jj = kj - Q + self._lens[kseg]  # the last k rows of n_i: n_i - k .. n_i - 1
                dst = np.where(jj >= 0, slot[kseg], scratch)
                parts += [dst * R + (ctx[kseg] + jj) % R, np.clip(start[kseg] + jj, 0, last)]
            elif write:
                dst = slot[kseg] if self.write_padding else np.where(kj < self._lens[kseg], slot[kseg], scratch)
                parts += [dst * R + (ctx[kseg] + kj) % R, write_src]
            return parts

        pool_len = B * max_back + self.num_rows
        # every sequence reads max_back rows and writes its Q (padding sequences: one position of the scratch slot)
        disjoint = ring_rows_disjoint(ring_rows, np.array([max_back]), np.array([self.tokens]))
        return self._register(key, build,
                              lambda v: ring_plan_from(ring_rows, v, pool_len=pool_len, disjoint=disjoint),
                              )  # type: ignore[return-value]

    def window_rows(self, plan: RingPlan, window: int) -> Tensor:
        """[B * Q, window] int64 causal window rows into the pool of `plan` (one of this step's ring plans), -1 =
        none: ForwardContext.window_rows of a fixed-shape step, built on the host with the other plans (the
        forward then spends no device op on it). Row k of the query at position p = ctx_i + j is position
        q = p - window + 1 + k: a history row (q < ctx_i) or the sequence's fresh row q - ctx_i, -1 for q < 0.
        Uniform steps only: a ragged step's forward computes its window rows on the device (its row layout changes
        with the drafts verified, and with it this plan)."""
        if self.ragged:
            raise InputError("static decode step: a ragged step's window rows are computed on the device "
                             "(ForwardContext.window_rows), not host-built")
        T = self.num_rows
        back = plan.num_hist // self.num_seqs  # every sequence reads max_back history rows (ring_plan)
        pool_len = plan.num_hist + T

        def build() -> list[np.ndarray]:
            _, p, _, ctx, _, start, _ = self._host_views()[:7]
            i = np.repeat(self._arange[: self.batch_size], self.tokens)[:, None]  # row -> sequence (uniform)
            c = ctx[i]
            q = p[:, None] - window + 1 + np.arange(window, dtype=np.int64)[None, :]
            rows = np.where(q < c, i * back + q - (c - back), plan.num_hist + start[i] + q - c)
            return [np.where(q >= 0, rows.clip(0, pool_len - 1), -1).reshape(-1)]

        def memo() -> bytes:  # rows q - ctx_i do not depend on ctx_i; only the q >= 0 mask does, up to ctx_i = window
            return np.minimum(self._host_views()[3], window).tobytes()

        key = ("win", plan.ring_rows, back, window)
        return self._register(key, build, lambda v: v[0].view(T, window), memo)  # type: ignore[return-value]

    def visible_counts(self, ratio: int) -> Tensor:
        """[B * Q] int64 floor((position + 1) / ratio) of every row (padding rows too): ForwardContext.visible_counts
        of a fixed-shape step, from the host positions."""
        return self._register(("vis", ratio), lambda: [(self._host_views()[1] + 1) // ratio],
                              lambda v: v[0])  # type: ignore[return-value]

    def entries_width(self, ratio: int) -> int:
        return -(-self.max_len // ratio)

    def paged_plan(self, ratio: int, *, backend: str = "device") -> PagedPlan:
        """The step's PagedPlan of `ratio`, computed by device ops from its buffers (`static_paged_plan`): call it
        inside the forward (the capture records the ops, every replay recomputes the rows). Rebuilding it on the
        host (an earlier version) cost a pass over [B, width] entries whenever a position crossed an entry or a
        table gained a page, i.e. nearly every verify step."""
        cache = self.cache
        return static_paged_plan(ratio, cache.page_size, self._bt_t, self.seq_t.ctx, self._lens_t,
                                 self.entries_width(ratio), cache.scratch_page * (cache.page_size // ratio),
                                 tokens=self.tokens, consts=self._plan_consts[ratio], backend=backend)

    def check_tables(self, facts: DecodeFacts) -> None:
        """Block-table coverage of the real sequences (host; CapacityError as the exact plans raise)."""
        ratios = sorted(set(self.cache.ratios.values()))
        check_block_tables(facts.block_tables, self.cache.page_size, ratios, tuple(facts.ctx.tolist()),
                           tuple(facts.lens.tolist()))  # fmt: skip

    def context(self, cache: object, **kw: object) -> ForwardContext:
        """The ForwardContext of a fixed-shape forward: its batch, sequence tensors and plans are this step's."""
        B, Q = self.num_seqs, self.tokens
        zeros = np.zeros(self.num_rows, dtype=np.int64)
        return ForwardContext(
            batch=self.batch, cache=cache,
            host=StepHost(ctx_lens=(0,) * B, input_ids=zeros, block_tables=self._bt),  # placeholders
            seq_host=self.seq_host, seq_starts=tuple(range(0, B * Q, Q)), query_lens=(Q,) * B, ctx_lens=(0,) * B,
            seq_of_token=self.batch.seq_of_token, seq_t=self.seq_t, static=self, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
