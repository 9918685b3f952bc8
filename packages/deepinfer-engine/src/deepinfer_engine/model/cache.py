"""Model-side cache storage (architecture.md §7): named per-layer tensors of every family, addressed by position.

Slot families (one row block per running sequence, `slot` index from the ForwardBatch):
  swa[l]           [num_slots, ring, head_dim]            window K=V ring, row = position mod ring (ring = W + slack)
  comp_state[l,n]  [num_slots, state_ring, 2, width] f32  raw compressor rows (A, Z incl. ape) per position,
                                                          row = position mod state_ring; n = "main" | "indexer"
  token_ring       [num_slots, hist_ring] int64           input token ids by position (Engram n-gram history)
Paged families (grow with the sequence; block table per sequence in units of page_size tokens):
  compressed_kv[l] [num_pages, page_size // ratio, head_dim]        rotated compressed entries C_w
  index_keys[l]    [num_pages, page_size // ratio, index_head_dim]  indexer keys KI_w
  entry w of ratio r lives in page block_table[w*r // page_size], row (w*r % page_size) // r.
Everything is indexed by absolute position, so a rejected speculative tail is simply overwritten later; the
rings keep `slack` extra rows so that rows needed after a rollback of <= slack+1 tokens are still intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from deepinfer_engine.errors import CapacityError, ConfigError

__all__ = [
    "ModelCache",
    "comp_state_spec",
    "paged_read",
    "paged_write",
    "ring_history",
]

DEFAULT_SLACK = 8


def comp_state_spec(args: object, plan: object) -> list[tuple[str, int, int]]:
    """(name, width, rows-needed) of the raw compressor state rings of one layer (empty if none).

    rows-needed = how many positions before the current one the pooling may read: ratio (open window) and, for the
    V4 overlapping CSA compressor, another ratio for the previous window.
    """
    ratio = int(plan.ratio)
    if not plan.has_compressor or ratio <= 1:
        return []
    overlap = args.arch == "v4" and ratio == 4
    mult = 2 if overlap else 1
    out = [("main", mult * args.head_dim, mult * ratio)]
    if args.arch == "v4" and plan.kind == "csa":
        out.append(("indexer", mult * args.index_head_dim, mult * ratio))
    return out


def _has_index_keys(args: object, plan: object) -> bool:
    if args.arch == "v4":
        return plan.kind == "csa"
    return bool(plan.has_indexer_k)


@dataclass(kw_only=True)
class ModelCache:
    """All cached state of one model instance (see module docstring for the families and their addressing)."""

    page_size: int
    num_slots: int
    num_pages: int
    slack: int
    swa: dict[int, Tensor]
    comp_state: dict[tuple[int, str], Tensor]
    compressed_kv: dict[int, Tensor]
    index_keys: dict[int, Tensor]
    ratios: dict[int, int]
    token_ring: Tensor | None
    # per slot: end position (exclusive) of the last backbone forward; host ints, for the rollback guard
    high_water: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.high_water:
            self.high_water = [0] * self.num_slots

    def check_resume(self, slot: int, ctx_len: int) -> None:
        """Raise CapacityError if resuming `slot` at `ctx_len` rolls back more tokens than the rings can undo.

        A rejected tail of k tokens overwrote ring rows of positions k - ring back; the rows the next step reads
        are intact while k <= slack + 1. ctx_len == 0 (a new sequence in the slot) is always fine.
        """
        back = self.high_water[slot] - ctx_len
        if ctx_len > 0 and back > self.slack + 1:
            raise CapacityError(
                f"slot {slot}: resuming at position {ctx_len} after positions up to {self.high_water[slot] - 1} "
                f"were written: a rollback of {back} tokens exceeds the cache slack ({self.slack}) + 1; "
                "allocate the cache with a larger slack"
            )

    @classmethod
    def allocate(
        cls,
        args: object,
        *,
        num_slots: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        slack: int = DEFAULT_SLACK,
    ) -> ModelCache:
        if num_slots < 1 or num_pages < 0:
            raise ConfigError(f"cache: num_slots={num_slots}, num_pages={num_pages}; expected >= 1 and >= 0")
        if slack < 0:
            raise ConfigError(f"cache slack: found {slack}, expected >= 0")
        plans = args.layer_plans
        for p in plans:
            if p.ratio > 0 and page_size % p.ratio != 0:
                raise ConfigError(
                    f"page_size: found {page_size}, expected a multiple of every compress ratio "
                    f"(layer {p.layer_id} has ratio {p.ratio})"
                )
        ring = args.sliding_window + slack
        swa: dict[int, Tensor] = {}
        comp_state: dict[tuple[int, str], Tensor] = {}
        compressed_kv: dict[int, Tensor] = {}
        index_keys: dict[int, Tensor] = {}
        ratios: dict[int, int] = {}
        for p in plans:
            swa[p.layer_id] = torch.zeros(num_slots, ring, args.head_dim, dtype=dtype, device=device)
            for name, width, rows in comp_state_spec(args, p):
                comp_state[(p.layer_id, name)] = torch.zeros(
                    num_slots, rows + slack, 2, width, dtype=torch.float32, device=device
                )
            if p.has_compressor:
                ratios[p.layer_id] = p.ratio
                compressed_kv[p.layer_id] = torch.zeros(
                    num_pages, page_size // p.ratio, args.head_dim, dtype=dtype, device=device
                )
                if _has_index_keys(args, p):
                    index_keys[p.layer_id] = torch.zeros(
                        num_pages, page_size // p.ratio, args.index_head_dim, dtype=dtype, device=device
                    )
        token_ring = None
        if getattr(args, "engram_layer_ids", None):
            token_ring = torch.full(
                (num_slots, args.engram_max_ngram_size - 1 + slack), -1, dtype=torch.int64, device=device
            )
        return cls(
            page_size=page_size,
            num_slots=num_slots,
            num_pages=num_pages,
            slack=slack,
            swa=swa,
            comp_state=comp_state,
            compressed_kv=compressed_kv,
            index_keys=index_keys,
            ratios=ratios,
            token_ring=token_ring,
        )

    @classmethod
    def allocate_dense(
        cls,
        args: object,
        max_lens: Sequence[int],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        slack: int = DEFAULT_SLACK,
    ) -> tuple[ModelCache, Tensor]:
        """A cache for len(max_lens) sequences (slots 0..S-1) with contiguous pages; returns (cache, block_tables)."""
        if page_size is None:
            page_size = 1
            for p in args.layer_plans:
                if p.ratio > 0:
                    page_size = page_size * p.ratio // _gcd(page_size, p.ratio)
            page_size = max(page_size, 16)
        pages = [max(1, -(-int(n) // page_size)) for n in max_lens]
        bt = torch.full((len(pages), max(pages)), -1, dtype=torch.int32)
        nxt = 0
        for i, k in enumerate(pages):
            bt[i, :k] = torch.arange(nxt, nxt + k, dtype=torch.int32)
            nxt += k
        cache = cls.allocate(
            args, num_slots=len(pages), num_pages=nxt, page_size=page_size, dtype=dtype, device=device, slack=slack
        )
        # block tables live with the cache: paged reads index them with device tensors
        return cache, (bt if torch.device(device).type == "meta" else bt.to(device))

    def reset_slot(self, slot: int) -> None:
        """Forget a finished sequence's slot state (not required for correctness: positions overwrite)."""
        for t in self.swa.values():
            t[slot].zero_()
        for t in self.comp_state.values():
            t[slot].zero_()
        if self.token_ring is not None:
            self.token_ring[slot].fill_(-1)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def ring_history(ring: Tensor, slot: int, ctx_len: int, fresh: Tensor, back: int, *, write: bool = True) -> Tensor:
    """Rows for positions [ctx_len - b, ctx_len + n) of one sequence, b = min(back, ctx_len).

    ring:  [num_slots, R, *C] (row = position mod R);  fresh: [n, *C] rows of positions ctx_len .. ctx_len+n-1.
    The history part is read BEFORE this step's rows are written, so chunks longer than the ring work.
    With write=True the last min(n, R) fresh rows are stored afterwards.
    """
    R = ring.shape[1]
    b = min(back, ctx_len)
    if b > R:
        raise CapacityError(f"ring of {R} rows cannot hold {b} history positions; raise the cache slack")
    n = fresh.shape[0]
    if b > 0:
        pos = torch.arange(ctx_len - b, ctx_len, device=ring.device) % R
        hist = ring[slot, pos].to(fresh.dtype)
        out = torch.cat([hist, fresh], dim=0)
    else:
        out = fresh
    if write and n > 0:
        k = min(n, R)
        pos = torch.arange(ctx_len + n - k, ctx_len + n, device=ring.device) % R
        ring[slot, pos] = fresh[n - k :].to(ring.dtype)
    return out


def _page_rows(block_row: Tensor, ratio: int, page_size: int, w: Tensor, seq: int) -> tuple[Tensor, Tensor]:
    tok = w * ratio
    page_idx = tok // page_size
    if page_idx.numel() and int(page_idx.max()) >= block_row.shape[0]:
        raise CapacityError(
            f"sequence {seq}: block table has {block_row.shape[0]} pages, entry needs page {int(page_idx.max())}"
        )
    pages = block_row.to(device=page_idx.device, dtype=torch.int64)[page_idx]
    if pages.numel() and int(pages.min()) < 0:
        raise CapacityError(f"sequence {seq}: block table has no page (-1) for a needed compressed entry")
    rows = (tok % page_size) // ratio
    return pages, rows


def paged_write(
    store: Tensor, block_row: Tensor, ratio: int, page_size: int, w: Tensor, values: Tensor, *, seq: int = 0
) -> None:
    """store[page(w), row(w)] = values.  store: [num_pages, page_size//ratio, C]; w: [m] int64; values: [m, C]."""
    if w.numel() == 0:
        return
    pages, rows = _page_rows(block_row, ratio, page_size, w, seq)
    store[pages, rows] = values.to(store.dtype)


def paged_read(store: Tensor, block_row: Tensor, ratio: int, page_size: int, count: int, *, seq: int = 0) -> Tensor:
    """Entries w = 0..count-1 of one sequence: [count, C] in the store's dtype."""
    w = torch.arange(count, device=store.device)
    if count == 0:
        return store.new_zeros((0, store.shape[-1]))
    pages, rows = _page_rows(block_row, ratio, page_size, w, seq)
    return store[pages, rows]


# ---------------------------------------------------------------------------------------------- batched plans
# One forward touches every sequence of the batch in every layer through the same index pattern; the plans below
# are built once per forward (ForwardContext caches them) from host-side ints plus a few [S] tensors on the batch's
# device, so the layers run one gather / one index_copy_ per cache family and never sync with the device.


@dataclass(frozen=True, kw_only=True)
class SeqTensors:
    """Per-sequence bookkeeping of one forward as [S] int64 tensors on the batch's device (built in one copy)."""

    ctx: Tensor  # first position of each sequence's new tokens
    qlen: Tensor  # new tokens
    start: Tensor  # first row in T
    slot: Tensor  # cache slot


@dataclass(frozen=True, kw_only=True)
class RingPlan:
    """Gather/scatter indices for a slot ring [num_slots, R, *C] read with `back` history rows per sequence.

    The pool a layer builds is `cat([ring_flat[hist_src], fresh])`: all sequences' history rows (sequence-major,
    positions c_i - b_i .. c_i - 1) first, then the step's fresh rows [T, *C]. `pool_rows(seq, pos)` maps
    (sequence, position) pairs of this step's window into that pool.
    """

    ring_rows: int  # R
    num_hist: int
    hist_src: Tensor  # [num_hist] int64 rows of ring.view(-1, *C)
    hist_off: Tensor  # [S] int64 first pool row of sequence i's history
    hist_first: Tensor  # [S] int64 position of that row (c_i - b_i)
    write_dst: Tensor | None  # [m] int64 rows of ring.view(-1, *C) receiving fresh rows (None: no write)
    write_src: Tensor | None  # [m] int64 rows of fresh

    def gather(self, ring: Tensor, fresh: Tensor, *, write: bool = True) -> Tensor:
        """Pool [num_hist + T, *C] in fresh's dtype; then (if planned and write) stores this step's rows."""
        if ring.shape[1] != self.ring_rows:
            raise CapacityError(f"ring plan for {self.ring_rows} rows used on a ring of {ring.shape[1]} rows")
        flat = ring.view(-1, *ring.shape[2:])
        hist = flat.index_select(0, self.hist_src).to(fresh.dtype)
        pool = torch.cat([hist, fresh], 0) if self.num_hist else fresh
        if write and self.write_dst is not None:
            # the history was copied above, so chunks longer than the ring overwrite rows only after the read
            flat.index_copy_(0, self.write_dst, fresh.index_select(0, self.write_src).to(flat.dtype))
        return pool

    def pool_rows(self, seq: Tensor, pos: Tensor, st: SeqTensors) -> Tensor:
        """Pool rows of positions `pos` of sequences `seq` (same shape, int64); caller masks invalid ones."""
        c = st.ctx[seq]
        hist = self.hist_off[seq] + pos - self.hist_first[seq]
        fresh = self.num_hist + st.start[seq] + pos - c
        return torch.where(pos < c, hist, fresh)


def _segments(lengths: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(segment id [N], index within the segment [N], N) for segments of the given host lengths."""
    total = int(sum(lengths))
    lens = torch.tensor(list(lengths), dtype=torch.int64, device=device)
    offs = torch.cumsum(lens, 0) - lens
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens, output_size=total)
    return seg, torch.arange(total, device=device) - offs[seg], total


def build_ring_plan(
    ring_rows: int, backs: Sequence[int], ctx_lens: Sequence[int], query_lens: Sequence[int], st: SeqTensors,
    *, write: bool,
) -> RingPlan:
    """Plan for reading b_i = min(backs[i], ctx_i) history rows per sequence (and writing its last rows)."""
    R = ring_rows
    b = [min(int(k), c) for k, c in zip(backs, ctx_lens)]
    for i, bi in enumerate(b):
        if bi > R:
            raise CapacityError(f"sequence {i}: ring of {R} rows cannot hold {bi} history positions; raise the cache slack")
    dev = st.ctx.device
    b_t = torch.tensor(b, dtype=torch.int64, device=dev)
    seg, j, nh = _segments(b, dev)
    first = st.ctx - b_t
    hist_src = st.slot[seg] * R + (first[seg] + j) % R
    hist_off = torch.cumsum(b_t, 0) - b_t
    wdst = wsrc = None
    if write:
        k = [min(n, R) for n in query_lens]
        kseg, kj, _ = _segments(k, dev)
        k_t = torch.tensor(k, dtype=torch.int64, device=dev)
        skip = st.qlen - k_t  # only the last min(n, R) rows land (distinct ring rows, no duplicate writes)
        wsrc = st.start[kseg] + skip[kseg] + kj
        wdst = st.slot[kseg] * R + (st.ctx[kseg] + skip[kseg] + kj) % R
    return RingPlan(
        ring_rows=R, num_hist=nh, hist_src=hist_src, hist_off=hist_off, hist_first=first, write_dst=wdst,
        write_src=wsrc,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PagedPlan:
    """Flat row indices into a paged store [num_pages, page_size // ratio, C] (viewed as [-1, C]) for one ratio.

    read_rows:  [E] entries w = 0..count_i-1 of every sequence, sequence-major (the CompressedView order)
    write_rows: [M] entries completed by this step, w = ctx_i // r .. end_i // r - 1, sequence-major
    new_w:      [M] int64 their entry ids w;  new_seq: [M] int64 their sequence
    offsets / counts: host tuples (CompressedView.seq_offsets / seq_counts); offsets_t: [S] int64 of offsets
    """

    ratio: int
    read_rows: Tensor
    write_rows: Tensor
    new_w: Tensor
    new_seq: Tensor
    num_new: int
    offsets: tuple[int, ...]
    counts: tuple[int, ...]
    offsets_t: Tensor

    def read(self, store: Tensor) -> Tensor:
        return store.view(-1, store.shape[-1]).index_select(0, self.read_rows)

    def write(self, store: Tensor, values: Tensor) -> None:
        """values [M, C] of the entries new_w (in plan order)."""
        if self.num_new:
            store.view(-1, store.shape[-1]).index_copy_(0, self.write_rows, values.to(store.dtype))


def build_paged_plan(
    ratio: int, page_size: int, block_tables: Tensor, ctx_lens: Sequence[int], query_lens: Sequence[int],
    *, device: torch.device | None = None,
) -> PagedPlan:
    """Block-table coverage is the caller's check (check_block_tables, once per forward). device: where the
    index tensors go (the batch's device; default the block tables')."""
    r, P = ratio, page_size
    dev = block_tables.device if device is None else torch.device(device)
    bt = block_tables.to(device=dev, dtype=torch.int64)
    per_page = P // r

    def rows(seq: Tensor, w: Tensor) -> Tensor:
        tok = w * r
        return bt[seq, tok // P] * per_page + (tok % P) // r

    counts = [(c + n) // r for c, n in zip(ctx_lens, query_lens)]
    seg, w, _ = _segments(counts, dev)
    lo = [c // r for c in ctx_lens]
    new = [hi - l0 for hi, l0 in zip(counts, lo)]
    nseg, nj, m = _segments(new, dev)
    new_w = torch.tensor(lo, dtype=torch.int64, device=dev)[nseg] + nj
    offsets, total = [], 0
    for k in counts:
        offsets.append(total)
        total += k
    return PagedPlan(
        ratio=r, read_rows=rows(seg, w), write_rows=rows(nseg, new_w), new_w=new_w, new_seq=nseg, num_new=m,
        offsets=tuple(offsets), counts=tuple(counts),
        offsets_t=torch.tensor(offsets, dtype=torch.int64, device=dev),
    )  # fmt: skip


def check_block_tables(
    block_tables: Tensor, page_size: int, ratios: Sequence[int], ctx_lens: Sequence[int], query_lens: Sequence[int]
) -> None:
    """CapacityError unless every page holding an entry that exists after this step is mapped (one host read).

    Sequence i needs the pages of tokens [0, max_r floor(end_i / r) * r) (the union of its entries' tokens).
    """
    if not ratios:
        return
    need = [max((c + n) // r * r for r in ratios) for c, n in zip(ctx_lens, query_lens)]
    pages = [-(-k // page_size) for k in need]
    width = block_tables.shape[1]
    for i, k in enumerate(pages):
        if k > width:
            raise CapacityError(f"sequence {i}: block table has {width} pages, entry needs page {k - 1}")
    if max(pages, default=0) == 0:
        return
    cols = torch.arange(width, device=block_tables.device)[None, :]
    limit = torch.tensor(pages, device=block_tables.device)[:, None]
    bad = ((block_tables < 0) & (cols < limit)).any(dim=1).tolist()  # the one host sync of this check
    if any(bad):
        i = bad.index(True)
        raise CapacityError(f"sequence {i}: block table has no page (-1) for a needed compressed entry")
