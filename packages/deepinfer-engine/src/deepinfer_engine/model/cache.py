"""Model-side cache storage (docs/caches.md §7): named per-layer tensors of every family, addressed by position.

Which layer owns what comes from ONE derivation, `core.kv_cache_spec.layer_cache_spec(args, plan)`; the
storage below is private to this module's methods (layers call `window_pool`, `state_pool`, `write_entries`,
`entry_source`, ... with the forward's plans, never index the dicts).

Slot families (one row block per running sequence, `slot` index from the ForwardBatch):
  swa[l]           [num_slots, ring, head_dim]            window K=V ring, row = position mod ring (ring = W + slack)
  comp_state[l,n]  [num_slots, state_ring, 2, width] f32  raw compressor rows (A, Z incl. ape) per position,
                                                          row = position mod state_ring; n = "main" | "indexer"
  token_ring       [num_slots, hist_ring] int64            input token ids by position (Engram n-gram history, read
                                                          and written on the device: token_ring.py)
Paged families (grow with the sequence; block table per sequence in units of page_size tokens):
  compressed_kv[l] [num_pages, page_size // ratio, head_dim]        rotated compressed entries C_w
  index_keys[l]    [num_pages, page_size // ratio, index_head_dim]  indexer keys KI_w
  entry w of ratio r lives in page block_table[w*r // page_size], row (w*r % page_size) // r.
Everything is indexed by absolute position, so a rejected speculative tail is simply overwritten later; the
rings keep `slack` extra rows so that rows needed after a rollback of <= slack+1 tokens are still intact.

Storage formats (`kv_cache_dtype`): "bfloat16" keeps every family in the cache dtype; "auto" stores the deployed
V4.1 records (docs/kv_cache.md): window K/V as MXFP8 (e4m3 + UE8M0 per 32), compressed main KV as NVFP4 (e2m1 +
e4m3 per 16), index keys as MXFP4 (e2m1 + UE8M0 per 32), each row one uint8 record (codes, then scale bytes).
The values a layer gets back in the step that wrote them are the decoded records too, so a full forward and
an incremental one see the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from deepinfer_kernels.ring_pool import ring_pool
from torch import Tensor

from deepinfer_engine.core.kv_cache_spec import LayerCacheSpec, layer_cache_spec
from deepinfer_engine.errors import CapacityError, ConfigError

__all__ = [
    "KV_CACHE_DTYPES",
    "ModelCache",
    "RecordFormat",
    "comp_state_spec",
    "paged_read",
    "paged_write",
    "ring_history",
    "kv_storage",
    "stores_records",
    "upload",
]

DEFAULT_SLACK = 8
KV_CACHE_DTYPES = ("bfloat16", "auto")


@dataclass(frozen=True)
class RecordFormat:
    """Rows of `dim` values stored as one uint8 record each: block-scaled codes followed by the scale bytes
    (deepinfer_kernels.quant.kv_formats formats)."""

    fmt: object  # deepinfer_kernels.quant.kv_formats.KVFormat
    dim: int

    @property
    def nbytes(self) -> int:
        return self.fmt.record_bytes(self.dim)

    def encode(self, x: Tensor, backend: str = "auto") -> Tensor:
        """x [rows, dim] float -> [rows, nbytes] uint8 (one kernel launch where the backend has it)."""
        from deepinfer_kernels.kv_records import encode

        return encode(x.reshape(-1, self.dim), self.fmt, backend=backend)

    def decode(self, rec: Tensor, dtype: torch.dtype, backend: str = "auto") -> Tensor:
        """[rows, nbytes] uint8 -> [rows, dim] in dtype."""
        from deepinfer_kernels.kv_records import decode

        return decode(rec, self.fmt, dtype, backend=backend)


def stores_records(args: object) -> bool:
    """Whether `kv_cache_dtype="auto"` can store compact records for this model (V4.1 with every record width a
    multiple of its format's block); otherwise the deployed numerics run over a plain cache."""
    try:
        return bool(_record_formats(args, "auto"))
    except ConfigError:
        return False


def kv_storage(args: object, kv_cache_dtype: str) -> str:
    """What the cache stores for the `kv_cache_dtype` option: "auto" (the deployed records) where `stores_records`,
    else "bfloat16" (with "auto", the deployed numerics then round through the formats into a plain cache)."""
    return "auto" if kv_cache_dtype == "auto" and stores_records(args) else "bfloat16"


def _record_formats(args: object, kv_cache_dtype: str) -> dict[str, RecordFormat]:
    """{"window" | "entries" | "index_keys": RecordFormat} of a storage mode ({} = plain cache dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype: found {kv_cache_dtype!r}, expected one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "bfloat16":
        return {}
    if args.arch != "v41":
        raise ConfigError(
            f"kv_cache_dtype='auto': the deployed record formats are V4.1's; found arch {args.arch!r}, "
            "use kv_cache_dtype='bfloat16'"
        )
    from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1

    out = {}
    for family, fmt, field_name in (
        ("window", MXFP8_E4M3, "head_dim"), ("entries", NVFP4_E2M1, "head_dim"),
        ("index_keys", MXFP4_E2M1, "index_head_dim"),
    ):  # fmt: skip
        dim = int(getattr(args, field_name))
        if dim % fmt.block:
            raise ConfigError(
                f"kv_cache_dtype='auto': {field_name} = {dim} is not a multiple of the {fmt.block}-channel block "
                f"of {fmt.name} ({family} records); use kv_cache_dtype='bfloat16'"
            )
        out[family] = RecordFormat(fmt, dim)
    return out


def comp_state_spec(args: object, plan: object) -> list[tuple[str, int, int]]:
    """(name, width, rows-needed) of the raw compressor state rings of one layer (from its LayerCacheSpec)."""
    return [(r.name, r.width, r.rows) for r in layer_cache_spec(args, plan).state_rings]


def upload(a: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on `device` without a host synchronization: staged in pinned memory and copied
    with non_blocking=True on CUDA (the caching host allocator keeps the staging block alive until the copy ran);
    on CPU the array's own memory."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


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
    token_ring: Tensor | None  # [num_slots + 1, R] int64 (token_ring.py); None: model without Engram
    specs: dict[int, LayerCacheSpec] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32  # values handed back to layers (decoded records)
    formats: dict[str, RecordFormat] = field(default_factory=dict)  # family -> record format ({}: plain)
    # per slot: end position (exclusive) of the last backbone forward; host ints, for the rollback guard
    high_water: list[int] = field(default_factory=list)
    # prefix cache (docs/prefix_cache.md), per slot, host ints: window rows below window_floor are invisible
    # (approximate replay), compressed entries of tokens below write_floor are not written (shared pages);
    # captures armed for the next forward: slot -> [(position, state slot)]
    window_floor: list[int] = field(default_factory=list)
    write_floor: list[int] = field(default_factory=list)
    captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # the captures the last backbone forward was armed with, armed again for the draft layers' ring write of the
    # same step (the drafter writes their rows after the target forward: docs/prefix_cache.md)
    draft_captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # [num_slots + 1, hc_mult, dim]: the target's final streams of each slot's last computed position (V4's MTP
    # drafter: the block's entry at a resume position reads them); None until the drafter allocates it
    last_stream: Tensor | None = None
    host_pages: dict[tuple[str, int], Tensor] = field(default_factory=dict)  # host tier, per paged store
    copy_stream: object | None = None  # CUDA stream of the host-tier transfers (worker.cache_ops)

    # The device storage holds one slot and one page more than `num_slots` / `num_pages`: the scratch slot and
    # page that the padded rows of a fixed-shape (CUDA-graph) decode step write into and read from. No request
    # is ever given them (the scheduler sees num_slots / num_pages), so what lands there is never read as data.
    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    def __post_init__(self) -> None:
        if not self.high_water:
            self.high_water = [0] * self.num_slots
        if not self.window_floor:
            self.window_floor = [0] * self.num_slots
        if not self.write_floor:
            self.write_floor = [0] * self.num_slots

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

    # ------------------------------------------------------------------------------------------- layer API
    # Layers address their own state through these (plans come from the ForwardContext); the storage tensors
    # and their formats stay this module's business.
    def window_rows(self, layer_id: int) -> int:
        """Rows of layer `layer_id`'s window ring (sliding window + slack)."""
        return self.swa[layer_id].shape[1]

    def window_pool(self, layer_id: int, plan: RingPlan, kv: Tensor, *, write: bool = True,
                    backend: str = "auto") -> Tensor:  # fmt: skip
        """Window pool [history + T, head_dim] of the step (see RingPlan.gather); stores kv if `write`.
        With window records (`window_format` not None) the pool is the records themselves, [history + T, record
        bytes] uint8 (the step's own rows encoded), for the attention to decode in its gather: the values it
        sees are the decoded records, in this step as in later ones."""
        f = self.formats.get("window")
        return plan.gather(self.swa[layer_id], kv if f is None else f.encode(kv, backend), write=write, backend=backend)

    def window_format(self) -> object | None:
        """The KVFormat of the window records the pool holds (None: plain values in the cache dtype)."""
        f = self.formats.get("window")
        return None if f is None else f.fmt

    def entry_format(self) -> object | None:
        """The KVFormat of the compressed-entry records `entry_source` hands out (None: plain values)."""
        f = self.formats.get("entries")
        return None if f is None else f.fmt

    def has_state(self, layer_id: int, name: str = "main") -> bool:
        return (layer_id, name) in self.comp_state

    def state_rows(self, layer_id: int, name: str = "main") -> int:
        """Rows of a compressor state ring (CapacityError-free lookup: callers check has_state first)."""
        return self.comp_state[(layer_id, name)].shape[1]

    def state_pool(self, layer_id: int, name: str, plan: RingPlan, fresh: Tensor, *, backend: str = "auto"
                   ) -> Tensor:  # fmt: skip
        """Raw compressor rows [history + T, 2, width] f32 of the step; stores this step's rows."""
        return plan.gather(self.comp_state[(layer_id, name)], fresh, backend=backend)

    def _write(self, family: str, store: Tensor, plan: PagedPlan, values: Tensor, backend: str) -> None:
        f = self.formats.get(family)
        plan.write(store, values if f is None or not plan.num_new else f.encode(values, backend))

    def _read(self, family: str, store: Tensor, plan: PagedPlan, backend: str) -> Tensor:
        f = self.formats.get(family)
        rows = plan.read(store)
        return rows if f is None else f.decode(rows, self.dtype, backend)

    def write_entries(self, layer_id: int, plan: PagedPlan, values: Tensor, *, backend: str = "auto") -> None:
        """Store the compressed entries completed this step (values [M, head_dim], plan.new_w order)."""
        self._write("entries", self.compressed_kv[layer_id], plan, values, backend)

    def entry_source(self, layer_id: int, plan: PagedPlan) -> tuple[Tensor, Tensor]:
        """(store [N, width], rows [E] int64): where the attention reads the layer's entries, in place: the paged
        cache viewed flat and each entry's store row. width = head_dim values, or with entry records
        (`entry_format` not None) the record bytes (uint8), decoded by the attention in its gather."""
        store = self.compressed_kv[layer_id]
        return store.view(-1, store.shape[-1]), plan.read_rows

    def write_index_keys(self, layer_id: int, plan: PagedPlan, values: Tensor, *, backend: str = "auto") -> None:
        self._write("index_keys", self.index_keys[layer_id], plan, values, backend)

    def read_index_keys(self, layer_id: int, plan: PagedPlan, *, backend: str = "auto") -> Tensor:
        return self._read("index_keys", self.index_keys[layer_id], plan, backend)

    # ------------------------------------------------------------------------------------- prefix cache ops
    # The copies the cache manager's CacheOps ask for (docs/prefix_cache.md); worker.cache_ops applies them.
    def _paged_stores(self) -> list[tuple[tuple[str, int], Tensor]]:
        return [(("kv", l), t) for l, t in self.compressed_kv.items()] + [
            (("ik", l), t) for l, t in self.index_keys.items()]

    def _slot_stores(self) -> list[Tensor]:
        return list(self.swa.values()) + list(self.comp_state.values())

    def allocate_host_pages(self, num_host_pages: int) -> None:
        """The host tier: `num_host_pages` pages of every paged store in (pinned, on CUDA) host memory."""
        pin = any(t.is_cuda for _, t in self._paged_stores())
        if pin:
            self.copy_stream = torch.cuda.Stream(next(t for _, t in self._paged_stores()).device)
        self.host_pages = {k: torch.zeros((num_host_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                           for k, t in self._paged_stores()}

    def host_tier_bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for _, t in self._paged_stores())

    def offload_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device page, host page): copy evicted cached pages to the host tier (non-blocking into pinned memory
        on CUDA: ordered on the stream before any later write of the page)."""
        for key, store in self._paged_stores():
            host = self.host_pages[key]
            for page, hp in pairs:
                host[hp].copy_(store[page], non_blocking=True)

    def load_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host page, device page): bring cached pages back from the host tier (non-blocking from pinned)."""
        for key, store in self._paged_stores():
            host = self.host_pages[key]
            for hp, page in pairs:
                store[page].copy_(host[hp], non_blocking=True)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(src page, dst page) of every paged store."""
        for _, store in self._paged_stores():
            for src, dst in pairs:
                store[dst].copy_(store[src])

    def clone_slot(self, src: int, dst: int, position: int) -> None:
        """Copy every slot family (window rings, compressor state, token ring) of `src` into `dst`, valid for a
        sequence resuming at `position` (restores a state block, or forks a running sequence)."""
        for t in self._slot_stores():
            t[dst].copy_(t[src])
        if self.last_stream is not None:
            self.last_stream[dst].copy_(self.last_stream[src])
        if self.token_ring is not None:
            self.token_ring[dst].copy_(self.token_ring[src])
        self.high_water[dst] = position

    def set_token_history(self, slot: int, position: int, ids: Sequence[int]) -> None:
        """The ids before `position` of the sequence in `slot` (it resumes there without having computed them
        in this slot); marks the slot's state valid up to `position`."""
        self.high_water[slot] = position
        ring = self.token_ring
        if ring is None:
            return
        R = ring.shape[1]
        need = min(position, R - self.slack - 1)  # the n-gram history the next step reads (max_ngram - 1)
        if len(ids) < need:
            raise CapacityError(f"token history: {len(ids)} ids given, the Engram ring of slot {slot} needs {need}")
        k = min(len(ids), R)
        if k == 0:
            return
        # one small upload: ring rows, then the ids (the ring lives on the device: token_ring.py)
        rows_ids = np.concatenate([np.arange(position - k, position) % R, np.asarray(ids[len(ids) - k :], np.int64)])
        rows, vals = upload(rows_ids, ring.device).split(k)
        ring[slot].index_copy_(0, rows, vals)

    def needs_exact_plans(self, slots: Sequence[int], ctx_lens: Sequence[int]) -> bool:
        """Whether a step over these sequences needs the exact (not fixed-shape) forward: a replay floor still
        applies to one of them or a state-block capture is armed (prefix cache)."""
        if self.captures:
            return True
        R = max((t.shape[1] for t in self.swa.values()), default=0)
        return any((0 < self.window_floor[s] and c - self.window_floor[s] < R) or self.write_floor[s] > c
                   for s, c in zip(slots, ctx_lens))

    def set_floors(self, slot: int, window_floor: int, write_floor: int) -> None:
        self.window_floor[slot] = int(window_floor)
        self.write_floor[slot] = int(write_floor)

    def arm_capture(self, slot: int, position: int, dest: int) -> None:
        """Copy the rows a step starting at `position` reads from slot `slot`'s rings into `dest` during the
        next forward that computes `position - 1` for that slot."""
        self.captures.setdefault(slot, []).append((int(position), int(dest)))

    def take_captures(self, slots: Sequence[int], ctx_lens: Sequence[int], query_lens: Sequence[int]
                      ) -> list[tuple[int, int, int]]:
        """(sequence index, position, dest slot) of the armed captures this forward can serve (position in
        (ctx, ctx + n]). Captures are armed for the next backbone forward only: all are disarmed here."""
        out: list[tuple[int, int, int]] = []
        armed, self.captures = self.captures, {}
        self.draft_captures = armed  # the drafter's ring write of this step serves them again
        for i, (slot, c, n) in enumerate(zip(slots, ctx_lens, query_lens)):
            out.extend((i, pos, dest) for pos, dest in armed.get(slot, ()) if c < pos <= c + n)
        return out

    def take_draft_captures(self, slots: Sequence[int], ctx_lens: Sequence[int], query_lens: Sequence[int]
                            ) -> list[tuple[int, int, int]]:
        """take_captures for the forward that writes the draft layers' rings after the backbone forward of the
        step (DSpark context, V4's MTP block): position in [ctx, ctx + n] (the MTP block's rows start one
        position after the target's). All are disarmed here."""
        out: list[tuple[int, int, int]] = []
        for i, (slot, c, n) in enumerate(zip(slots, ctx_lens, query_lens)):
            out.extend((i, pos, dest) for pos, dest in self.draft_captures.get(slot, ()) if c <= pos <= c + n)
        self.draft_captures = {}
        return out

    def capture_history(self, layer_ids: Sequence[int], seqs: SeqHost) -> None:
        """The ring rows of positions before each sequence's step that its captures need (up to a ring back),
        copied ring to ring into the state slots: for writes that read no history (DSpark context), so their
        plans capture the step's own rows only. Runs before the step writes the rings."""
        for lid in layer_ids:
            ring = self.swa[lid]
            R = ring.shape[1]
            dst, src = [], []
            for i, pos, dest in seqs.captures:
                c = int(seqs.ctx[i])
                q = np.arange(max(0, pos - R), c, dtype=np.int64)
                dst.append(dest * R + q % R)
                src.append(int(seqs.slot[i]) * R + q % R)
            n = sum(d.size for d in dst)
            if n:
                d, s_ = upload(np.concatenate(dst + src), ring.device).split([n, n])
                flat = ring.view(-1, ring.shape[-1])
                flat.index_copy_(0, d, flat.index_select(0, s_))

    def allocate_last_stream(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """`last_stream` [num_slots + 1, *shape] for a drafter that needs it (V4's MTP block: shape = one
        position's final streams [hc_mult, dim]); kept if already there."""
        if self.last_stream is None:
            device = next(iter(self.swa.values())).device
            self.last_stream = torch.zeros(self.num_slots + 1, *shape, dtype=dtype, device=device)

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
        kv_cache_dtype: str = "bfloat16",
    ) -> ModelCache:
        """kv_cache_dtype: "bfloat16" stores every family in `dtype` (the name follows the engine option; the
        dtype is the model's), "auto" the deployed V4.1 records (module docstring)."""
        formats = _record_formats(args, kv_cache_dtype)
        if num_slots < 1 or num_pages < 0:
            raise ConfigError(f"cache: num_slots={num_slots}, num_pages={num_pages}; expected >= 1 and >= 0")
        if slack < 0:
            raise ConfigError(f"cache slack: found {slack}, expected >= 0")
        specs = {p.layer_id: layer_cache_spec(args, p) for p in args.layer_plans}
        for s in specs.values():
            if s.ratio > 0 and page_size % s.ratio != 0:
                raise ConfigError(
                    f"page_size: found {page_size}, expected a multiple of every compress ratio "
                    f"(layer {s.layer_id} has ratio {s.ratio})"
                )
        ring = args.sliding_window + slack
        swa: dict[int, Tensor] = {}
        comp_state: dict[tuple[int, str], Tensor] = {}
        compressed_kv: dict[int, Tensor] = {}
        index_keys: dict[int, Tensor] = {}
        ratios: dict[int, int] = {}
        def store(family: str, lead: tuple[int, ...], width: int) -> Tensor:
            f = formats.get(family)
            if f is None:
                return torch.zeros(*lead, width, dtype=dtype, device=device)
            return torch.zeros(*lead, f.nbytes, dtype=torch.uint8, device=device)

        slot_rows, page_rows = num_slots + 1, num_pages + 1  # + the scratch slot / page (ModelCache.scratch_slot)
        for lid, s in specs.items():
            swa[lid] = store("window", (slot_rows, ring), s.head_dim)
            for st in s.state_rings:
                comp_state[(lid, st.name)] = torch.zeros(
                    slot_rows, st.rows + slack, 2, st.width, dtype=torch.float32, device=device
                )
            if s.owns_entries:
                ratios[lid] = s.ratio
                compressed_kv[lid] = store("entries", (page_rows, page_size // s.ratio), s.kv_width)
                if s.owns_index_keys:
                    index_keys[lid] = store("index_keys", (page_rows, page_size // s.ratio), s.index_width)
        token_ring = None
        if getattr(args, "engram_layer_ids", None):
            # max_ngram - 1 history rows + slack + 1: a rolled-back tail of slack + 1 tokens (check_resume) may
            # overwrite slack + 1 rows, and the n-gram reads max_ngram - 1 rows before the resume position
            token_ring = torch.full((slot_rows, args.engram_max_ngram_size + slack), -1, dtype=torch.int64,
                                    device=device)
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
            specs=specs,
            dtype=dtype,
            formats=formats,
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
        kv_cache_dtype: str = "bfloat16",
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
            args, num_slots=len(pages), num_pages=nxt, page_size=page_size, dtype=dtype, device=device, slack=slack,
            kv_cache_dtype=kv_cache_dtype,
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
# are built once per forward (ForwardContext caches them) on the HOST from the step's host facts (first
# positions, lengths, slots, block tables: python ints / numpy) and reach the device in one non-blocking copy
# each, so the layers run one gather / one index_copy_ per cache family and the forward never syncs.


@dataclass(frozen=True, kw_only=True)
class SeqHost:
    """Per-sequence facts of one step on the host (numpy int64 [S] each)."""

    ctx: np.ndarray  # first position of each sequence's new tokens
    qlen: np.ndarray  # new tokens
    start: np.ndarray  # first row in T
    slot: np.ndarray  # cache slot
    write_floor: np.ndarray | None = None  # compressed entries of tokens below it are not written (prefix cache)
    captures: tuple[tuple[int, int, int], ...] = ()  # (sequence, position, dest slot): state blocks to capture


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
    # state-block captures (prefix cache): rows of ring.view(-1, *C) of the state slots <- pool rows
    capture_dst: Tensor | None = None
    capture_src: Tensor | None = None
    # fixed-shape plans (static_step.py) also serve positions outside the pool (the padded entry of a sequence
    # that completes none this step): pool_rows clamps to [0, pool_len); None = exact plans, no clamp
    pool_len: int | None = None
    # no ring row written is a row read (`ring_rows_disjoint`): the gather and the writes may run as one launch
    disjoint: bool = False

    def capture(self, flat: Tensor, pool: Tensor) -> None:
        """Copy the captured pool rows into their state slots' ring rows (flat = ring.view(-1, *C))."""
        if self.capture_dst is not None:
            flat.index_copy_(0, self.capture_dst, pool.index_select(0, self.capture_src).to(flat.dtype))

    def gather(self, ring: Tensor, fresh: Tensor, *, write: bool = True, backend: str = "auto") -> Tensor:
        """Pool [num_hist + T, *C] in fresh's dtype; then (if planned and write) stores this step's rows.
        backend: the kernel backend of `ring_pool` (one launch for the gather and the writes when the plan's
        rows are disjoint and nothing is captured)."""
        if ring.shape[1] != self.ring_rows:
            raise CapacityError(f"ring plan for {self.ring_rows} rows used on a ring of {ring.shape[1]} rows")
        flat = ring.view(-1, *ring.shape[2:])
        if not (write and self.capture_dst is not None):
            w = write and self.write_dst is not None
            return ring_pool(flat, self.hist_src, fresh, self.write_dst if w else None, self.write_src if w else None,
                             disjoint=self.disjoint or not w, backend=backend)  # fmt: skip
        if self.num_hist:
            hist = flat.index_select(0, self.hist_src).to(fresh.dtype)
            pool = torch.cat([hist, fresh], 0)
        else:
            pool = fresh
        if write and self.capture_dst is not None:
            self.capture(flat, pool)
        if write and self.write_dst is not None:
            # the history was copied above, so chunks longer than the ring overwrite rows only after the read
            flat.index_copy_(0, self.write_dst, fresh.index_select(0, self.write_src).to(flat.dtype))
        return pool

    def pool_rows(self, seq: Tensor, pos: Tensor, st: SeqTensors) -> Tensor:
        """Pool rows of positions `pos` of sequences `seq` (same shape, int64); caller masks invalid ones."""
        c = st.ctx[seq]
        hist = self.hist_off[seq] + pos - self.hist_first[seq]
        fresh = self.num_hist + st.start[seq] + pos - c
        rows = torch.where(pos < c, hist, fresh)
        return rows if self.pool_len is None else rows.clamp(0, self.pool_len - 1)


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment id [N], index within the segment [N]) for segments of the given lengths (host)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offs = np.cumsum(lengths) - lengths
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return seg, np.arange(seg.shape[0], dtype=np.int64) - offs[seg]


def _split(t: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    return list(torch.split(t, list(sizes))) if sizes else []


def ring_plan_arrays(
    ring_rows: int, backs: Sequence[int], seqs: SeqHost, *, write: bool, clip: bool = True
) -> list[np.ndarray]:
    """Host arrays of a RingPlan: [hist_src, hist_off, hist_first(, write_dst, write_src(, capture_dst,
    capture_src))] (captures: the SeqHost's armed state-block captures, written plans only).

    clip=True reads b_i = min(backs[i], ctx_i) history rows (exact); clip=False reads backs[i] rows whatever
    ctx_i (fixed sizes for a captured step: rows of positions < 0 are stale ring rows that nothing reads)."""
    R = ring_rows
    b = np.asarray(backs, dtype=np.int64)
    if clip:
        b = np.minimum(b, seqs.ctx)
    over = np.nonzero(b > R)[0]
    if over.size:
        i = int(over[0])
        raise CapacityError(
            f"sequence {i}: ring of {R} rows cannot hold {int(b[i])} history positions; raise the cache slack"
        )
    seg, j = _segments(b)
    first = seqs.ctx - b
    hist_src = seqs.slot[seg] * R + (first[seg] + j) % R
    hist_off = np.cumsum(b) - b
    parts = [hist_src, hist_off, first]
    if write:
        k = np.minimum(seqs.qlen, R)
        kseg, kj = _segments(k)
        skip = seqs.qlen - k  # only the last min(n, R) rows land (distinct ring rows, no duplicate writes)
        parts += [seqs.slot[kseg] * R + (seqs.ctx[kseg] + skip[kseg] + kj) % R, seqs.start[kseg] + skip[kseg] + kj]
        if seqs.captures:
            parts += _capture_rows(R, first, hist_off, int(b.sum()), seqs)
    return parts


def _capture_rows(R: int, first: np.ndarray, hist_off: np.ndarray, num_hist: int, seqs: SeqHost
                  ) -> list[np.ndarray]:
    """(dst rows in the state slots, pool rows) of every capture: the up-to-R positions before the capture
    point that this step's pool holds (history + fresh rows). They cover what a step starting there reads:
    the window (W - 1 rows) and the compressor's open (and, overlapping, previous) group."""
    dst, src = [], []
    for i, pos, dest in seqs.captures:
        q = np.arange(max(int(first[i]), pos - R), pos, dtype=np.int64)
        c = int(seqs.ctx[i])
        rows = np.where(q < c, hist_off[i] + q - first[i], num_hist + seqs.start[i] + q - c)
        dst.append(dest * R + q % R)
        src.append(rows)
    return [np.concatenate(dst), np.concatenate(src)]


def ring_rows_disjoint(ring_rows: int, backs: np.ndarray, qlen: np.ndarray) -> bool:
    """Whether a written plan of ring_plan_arrays reads no ring row that it writes: sequence i reads positions
    c_i - b_i .. c_i - 1 and writes its last min(n_i, R) of c_i .. c_i + n_i - 1, disjoint modulo R exactly when
    b_i = 0 or b_i + n_i <= R (sequences own distinct slots; padding sequences of a fixed-shape step share the
    scratch slot at one position, so they read and write the same rows as each other)."""
    b, n = np.asarray(backs, dtype=np.int64), np.asarray(qlen, dtype=np.int64)
    return bool(np.all((b == 0) | (b + n <= ring_rows)))


def ring_plan_from(ring_rows: int, parts: Sequence[Tensor], *, pool_len: int | None = None,
                   disjoint: bool = False) -> RingPlan:  # fmt: skip
    """RingPlan over device tensors laid out as ring_plan_arrays returns them (disjoint: `ring_rows_disjoint`)."""
    write, cap = len(parts) >= 5, len(parts) == 7  # 7: with state-block captures (prefix cache)
    return RingPlan(
        ring_rows=ring_rows, num_hist=int(parts[0].shape[0]), hist_src=parts[0], hist_off=parts[1],
        hist_first=parts[2], write_dst=parts[3] if write else None, write_src=parts[4] if write else None,
        capture_dst=parts[5] if cap else None, capture_src=parts[6] if cap else None, pool_len=pool_len,
        disjoint=disjoint,
    )  # fmt: skip


def build_ring_plan(
    ring_rows: int, backs: Sequence[int], seqs: SeqHost, *, write: bool, device: torch.device
) -> RingPlan:
    """Plan for reading b_i = min(backs[i], ctx_i) history rows per sequence (and writing its last rows)."""
    parts = ring_plan_arrays(ring_rows, backs, seqs, write=write)
    sizes = [p.shape[0] for p in parts]
    b = np.minimum(np.asarray(backs, dtype=np.int64), seqs.ctx)  # the rows ring_plan_arrays reads (clip=True)
    return ring_plan_from(ring_rows, _split(upload(np.concatenate(parts), device), sizes),  # one copy
                          disjoint=ring_rows_disjoint(ring_rows, b, seqs.qlen))  # fmt: skip


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
    ratio: int, page_size: int, block_tables: np.ndarray, seqs: SeqHost, *, device: torch.device
) -> PagedPlan:
    """block_tables: [S, max_pages] host page ids. Coverage is the caller's check (check_block_tables, once per
    forward)."""
    r, P = ratio, page_size
    bt = np.asarray(block_tables, dtype=np.int64)
    per_page = P // r

    def rows(seq: np.ndarray, w: np.ndarray) -> np.ndarray:
        tok = w * r
        return bt[seq, tok // P] * per_page + (tok % P) // r

    counts = (seqs.ctx + seqs.qlen) // r
    seg, w = _segments(counts)
    lo = seqs.ctx // r
    if seqs.write_floor is not None:  # entries of tokens below the floor live in shared pages: not written
        lo = np.minimum(np.maximum(lo, -(-seqs.write_floor // r)), counts)
    nseg, nj = _segments(counts - lo)
    new_w = lo[nseg] + nj
    offsets = np.cumsum(counts) - counts
    parts = [rows(seg, w), rows(nseg, new_w), new_w, nseg, offsets]
    sizes = [p.shape[0] for p in parts]
    out = _split(upload(np.concatenate(parts), device), sizes)
    return PagedPlan(
        ratio=r, read_rows=out[0], write_rows=out[1], new_w=out[2], new_seq=out[3], num_new=int(sizes[1]),
        offsets=tuple(int(x) for x in offsets), counts=tuple(int(x) for x in counts), offsets_t=out[4],
    )  # fmt: skip


def check_block_tables(
    block_tables: np.ndarray | Tensor,
    page_size: int,
    ratios: Sequence[int],
    ctx_lens: Sequence[int],
    query_lens: Sequence[int],
) -> None:
    """CapacityError unless every page holding an entry that exists after this step is mapped (host facts only).

    Sequence i needs the pages of tokens [0, max_r floor(end_i / r) * r) (the union of its entries' tokens).
    """
    if not ratios:
        return
    if isinstance(block_tables, Tensor):
        block_tables = block_tables.cpu().numpy()
    # every sequence at once (a check per sequence was a millisecond of a 256-sequence step); the error names the
    # first sequence that fails, as a check in order would
    end = np.asarray(ctx_lens, dtype=np.int64) + np.asarray(query_lens, dtype=np.int64)
    need = np.max([end // r * r for r in ratios], axis=0)
    pages = -(-need // page_size)
    width = block_tables.shape[1]
    over = pages > width
    unmapped = ((np.asarray(block_tables) < 0) & (np.arange(width) < pages[:, None])).any(1) & ~over
    bad = np.flatnonzero(over | unmapped)
    if bad.size:
        i = int(bad[0])
        if over[i]:
            raise CapacityError(f"sequence {i}: block table has {width} pages, entry needs page {int(pages[i]) - 1}")
        raise CapacityError(f"sequence {i}: block table has no page (-1) for a needed compressed entry")
