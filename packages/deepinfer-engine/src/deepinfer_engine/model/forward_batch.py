"""What the model needs per step (`ForwardBatch`, contracts.md §3) and the per-forward `ForwardContext`.

`ForwardBatch` is built by the runner; `ForwardContext` is built by `Transformer.forward` from the batch and the
cache and passed explicitly to every layer (no global forward context). It carries the per-sequence bookkeeping
plus the state that one layer publishes for later layers of the same forward (V4.1 CSA2: compressed-KV source
views, top-k indices of index sources, candidate-block masks; DSpark: captured target features).

Shapes: T = tokens of this step (flattened varlen, sequence-major), S = sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from deepinfer_kernels.indexer import store_rows, visible_counts
from torch import Tensor

from deepinfer_engine.errors import InputError
from deepinfer_engine.model.cache import (
    PagedPlan,
    RingPlan,
    SeqHost,
    SeqTensors,
    build_paged_plan,
    build_ring_plan,
    check_block_tables,
    upload,
)
from deepinfer_engine.model.overlap import Overlapped, SideStreams

__all__ = ["CompressedSelection", "CompressedView", "ForwardBatch", "ForwardContext", "StepHost"]


@dataclass(frozen=True, kw_only=True)
class StepHost:
    """The host's copy of what a ForwardBatch carries on the device, so that the forward never reads it back.

    ctx_lens:     per sequence, the first position of its new tokens (positions are ctx_i, ctx_i + 1, ...)
    input_ids:    [T] int64 numpy, the step's token ids (Engram hashing runs on the host)
    block_tables: [S, max_pages] int32 numpy page ids (-1 = unused)
    The model runner fills it from its persistent input batch; `ForwardBatch.single` from its arguments;
    `StepHost.read(batch)` reads a batch built without one back from the device (direct model users only).
    """

    ctx_lens: tuple[int, ...]
    input_ids: np.ndarray
    block_tables: np.ndarray

    @classmethod
    def read(cls, batch: ForwardBatch) -> StepHost:
        """Read the host facts back from a batch's tensors, checking that positions are consecutive (direct
        model users: tests and tools; the runner never gets here)."""
        ids = batch.input_ids.cpu().numpy()
        pos = batch.positions.cpu().numpy()
        starts = np.cumsum((0,) + batch.query_lens[:-1]) if batch.query_lens else np.zeros(0, dtype=np.int64)
        for i, (st, n) in enumerate(zip(starts.tolist(), batch.query_lens)):
            p = pos[st : st + n]
            if n > 1 and not (np.diff(p) == 1).all():
                raise InputError(f"positions of sequence {i}: found {p.tolist()[:8]}..., expected consecutive")
        li = batch.logits_indices.cpu().numpy()
        if li.size and (li.min() < 0 or li.max() >= batch.num_tokens):
            raise InputError(
                f"logits_indices: found {int(li.min())}..{int(li.max())}, expected in [0, {batch.num_tokens})"
            )
        return cls(
            ctx_lens=tuple(int(pos[s]) for s in starts.tolist()),
            input_ids=ids,
            block_tables=batch.block_tables.cpu().numpy(),
        )


@dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    """One model step over several sequences (contracts.md §3).

    input_ids:      [T] int64 token ids (raw ids, also for image positions: MoE `bias_vl` needs them)
    positions:      [T] int64 absolute positions; sequence i's new tokens are ctx_i, ctx_i+1, ... (consecutive)
    query_lens:     new tokens per sequence, sequence-major order, sum == T
    slots:          per-sequence slot index into the "slot" cache families (SWA rings, compressor state, history)
    block_tables:   [S, max_pages] int32 page ids for the paged families; -1 = unused
    logits_indices: [N] int64 rows of T whose logits are returned
    known_lens:     per sequence, the tokens its request knows (prompt + tokens generated so far), or None. Read
                    only by prefill truncation (docs/prefill_truncation.md): rows at positions < known_len - KEEP
                    skip the decoder layers; 0 keeps every row of that sequence (prompt logprobs), None every
                    row of the batch. The rows of logits_indices must be kept rows.
    """

    input_ids: Tensor
    positions: Tensor
    query_lens: tuple[int, ...]
    slots: tuple[int, ...]
    block_tables: Tensor
    logits_indices: Tensor
    host: StepHost | None = None  # the host copy of the above (None: read back once, for direct model users)
    # device copies of the per-sequence ints and the token -> sequence map when the caller already staged them
    # (the runner's input batch, in its one copy); None: ForwardContext.build uploads them from `host`
    seq: SeqTensors | None = None
    seq_of_token: Tensor | None = None
    known_lens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1 or self.input_ids.dtype != torch.int64:
            raise InputError(
                f"ForwardBatch.input_ids: found shape {tuple(self.input_ids.shape)} dtype {self.input_ids.dtype}, "
                "expected [T] int64"
            )
        if self.positions.shape != self.input_ids.shape or self.positions.dtype != torch.int64:
            raise InputError(
                f"ForwardBatch.positions: found shape {tuple(self.positions.shape)} dtype {self.positions.dtype}, "
                f"expected [{self.input_ids.shape[0]}] int64"
            )
        if len(self.query_lens) != len(self.slots):
            raise InputError(
                f"ForwardBatch: {len(self.query_lens)} query_lens but {len(self.slots)} slots, expected equal"
            )
        if any(n < 1 for n in self.query_lens) or sum(self.query_lens) != self.input_ids.shape[0]:
            raise InputError(
                f"ForwardBatch.query_lens: found {self.query_lens}, expected positive lengths summing to "
                f"T={self.input_ids.shape[0]}"
            )
        if len(set(self.slots)) != len(self.slots):
            raise InputError(f"ForwardBatch.slots: found duplicates in {self.slots}, expected distinct slots")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != len(self.query_lens):
            raise InputError(
                f"ForwardBatch.block_tables: found shape {tuple(self.block_tables.shape)}, expected "
                f"[{len(self.query_lens)}, max_pages]"
            )
        if self.logits_indices.dim() != 1 or self.logits_indices.dtype != torch.int64:
            raise InputError(
                f"ForwardBatch.logits_indices: found shape {tuple(self.logits_indices.shape)} dtype "
                f"{self.logits_indices.dtype}, expected [N] int64"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def single(
        cls,
        input_ids: Tensor,
        *,
        start_pos: int = 0,
        slot: int = 0,
        block_table: Tensor | None = None,
        all_logits: bool = True,
    ) -> ForwardBatch:
        """One sequence, tokens at positions start_pos..start_pos+n-1 (a convenience for tests and tools)."""
        ids = input_ids.reshape(-1).to(torch.int64)
        n = int(ids.shape[0])
        bt = block_table if block_table is not None else torch.full((1, 1), -1, dtype=torch.int32)
        bt = bt.reshape(1, -1).to(torch.int32)
        # host facts from the arguments (a copy of the ids / table when they live on a device: a tool
        # convenience before the forward, never inside it)
        host = StepHost(ctx_lens=(int(start_pos),), input_ids=ids.cpu().numpy(), block_tables=bt.cpu().numpy())
        bt = bt.to(ids.device)  # on the ids' device, like every other batch tensor
        return cls(
            input_ids=ids,
            positions=torch.arange(start_pos, start_pos + n, dtype=torch.int64, device=ids.device),
            query_lens=(n,),
            slots=(slot,),
            block_tables=bt,
            logits_indices=torch.arange(n if all_logits else 1, dtype=torch.int64, device=ids.device)
            + (0 if all_logits else n - 1),
            host=host,
        )


@dataclass(frozen=True, kw_only=True)
class CompressedView:
    """Compressed entries of one kv-source layer for this forward (all sequences), read IN PLACE from the cache.

    store:       [N, head_dim] the source's paged cache viewed flat (rotated entries, the cache's dtype), or
                 [N, record bytes] uint8 records of `kv_format` (kv_cache_dtype="auto")
    rows:        [E_total] int64 store row of each entry, sequence-major (entry w of sequence i at seq_offsets[i] + w)
    index_keys:  [E_total, index_head_dim] gathered indexer keys, or None (V4 HCA / sources without keys)
    seq_offsets: per sequence, first position in `rows` of its entry w = 0
    seq_counts:  per sequence, number of entries that exist after this step (floor((ctx+n)/ratio))
    ratio:       compression ratio of the source
    """

    store: Tensor
    rows: Tensor
    index_keys: Tensor | None
    seq_offsets: tuple[int, ...]
    seq_counts: tuple[int, ...]
    ratio: int
    kv_format: object | None = None  # deepinfer_kernels.quant.kv_formats.KVFormat of the store's records

    @property
    def kv(self) -> Tensor:
        """[E_total, head_dim] the entries gathered (tests and tools; attention reads `store` through rows),
        records decoded to float32."""
        rows = self.store.index_select(0, self.rows)
        if self.kv_format is None:
            return rows
        from deepinfer_kernels.quant.kv_formats import decode_records

        return decode_records(rows, self.kv_format)

    def store_rows(self, sel: Tensor, seq_of_token: Tensor, seq_offsets: Tensor, *, backend: str = "auto") -> Tensor:
        """[T, K] store rows of per-sequence entry ids `sel` (-1 = none); seq_of_token [T] and seq_offsets [S] (the
        paged plan's offsets_t) on the device. No host read (`deepinfer_kernels.indexer.store_rows`)."""
        return store_rows(sel, seq_of_token, seq_offsets, self.rows, backend=backend)


@dataclass(frozen=True, kw_only=True)
class CompressedSelection:
    """What a layer's compressed path hands to the attention core.

    kv:      [N, head_dim] the kv source's store (CompressedView.store), read in place by the attention kernel
             (uint8 records of `kv_format` when it is set)
    indices: [T, K] int64 rows of `kv` each query attends to in addition to its window; -1 = none.
             Must respect causality (entry w visible to query t iff w < floor((t+1)/ratio)).
    """

    kv: Tensor
    indices: Tensor
    kv_format: object | None = None


@dataclass(kw_only=True)
class ForwardContext:
    """Per-forward state passed explicitly to every layer (mutable: layers publish into the dicts).

    Sequence bookkeeping (host ints, known without reading the device; `host` / `seq_host` the same as numpy):
      seq_starts[i]  first row of sequence i in T;  query_lens[i] its new tokens;  ctx_lens[i] = its first position
      seq_of_token:  [T] int64 sequence index per token;  seq_t: the same per-sequence ints as [S] device tensors
    Gather plans (`plans`, built on first use by ring_plan / window_rows / paged_plan and shared by every layer):
      index tensors on the batch's device, so layers read and write the caches of all sequences in one op each.
    Published state (key = layer id of the publisher):
      compressed[l]:  CompressedView of kv-source layer l (written by l, read by Reuse/Reindex layers)
      topk[l]:        [T, K] int64 selected entry ids w (per-sequence local, -1 = none) of index-source layer l
      candidates[l]:  [T, num_blocks] bool candidate-block mask published by the candidate source layer l
      features[l]:    [T, d] captured hc-stream means for DSpark (input of l for V4.1, output of l for V4)
    engram_rows:      [T, num_engram_layers, (max_ngram-1)*n_heads] int64 hashed row ids (computed on the device from
                      batch.input_ids and the cache's device token ring, once per forward: engram_hash_device.py)
    image_mask:       [T] bool positions carrying image-sentinel ids
    side_streams:     overlap.SideStreams of a decode-sized CUDA step (work beside the main stream), or None
    engram_kv:        Engram projections started one layer ahead on a side stream (key = engram layer id)
    window_floor:     per sequence, the lowest position a ring may be read at (prefill truncation: the decoder
                      rings hold nothing below a request's first kept position; approximate prefix replay: nothing
                      below the replay start was cached), or None: ring plans read no history row below it and
                      windows mask it
    block_noncausal:  DSpark draft mode: new tokens of a sequence see each other non-causally, and the context
                      window is positions [max(0, p0-W), p0) with p0 the sequence's first new position; the new
                      tokens' window kv is NOT written into the ring.
    """

    batch: ForwardBatch
    cache: object  # ModelCache (typed loosely to avoid an import cycle)
    host: StepHost
    seq_host: SeqHost
    seq_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    seq_of_token: Tensor
    block_noncausal: bool = False
    window_floor: tuple[int, ...] | None = None
    engram_rows: Tensor | None = None  # [T, num_engram_layers, lookups] int64 rows into each engram.embed
    image_mask: Tensor | None = None  # [T] bool image-sentinel positions (Engram gate 0)
    side_streams: SideStreams | None = None
    # the model's kernel backend (`Transformer.kernel_backend`) for plans computed by kernels (a fixed-shape step's
    # paged rows)
    kernel_backend: str = "device"
    engram_kv: dict[int, Overlapped] = field(default_factory=dict)
    compressed: dict[int, CompressedView] = field(default_factory=dict)
    topk: dict[int, Tensor] = field(default_factory=dict)
    candidates: dict[int, Tensor] = field(default_factory=dict)
    features: dict[int, Tensor] = field(default_factory=dict)
    capture_layers: tuple[int, ...] = ()
    rope_cache: dict[tuple, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)  # Rope.cos_sin tables
    # per-sequence [S] tensors and the per-forward gather plans (built on first use, shared by all layers)
    seq_t: SeqTensors | None = None
    plans: dict[tuple, object] = field(default_factory=dict)
    # a fixed-shape step (static_step.StaticDecodeStep, CUDA graphs): every plan comes from its static buffers
    static: object | None = None

    @classmethod
    def build(
        cls, batch: ForwardBatch, cache: object, *, host: StepHost | None = None, state_captures: bool = False,
        draft_captures: bool = False, **kw: object,
    ) -> ForwardContext:
        """host: the step's host facts (default batch.host, else read back once from the batch).
        state_captures: this is the backbone forward that serves the cache's armed state-block captures
        (prefix cache); other forwards (drafts) leave them alone.
        draft_captures: this forward writes the draft layers' rings of the step and serves the same captures."""
        if host is None:
            host = batch.host if batch.host is not None else StepHost.read(batch)
        S, T = batch.num_seqs, batch.num_tokens
        qlen = np.asarray(batch.query_lens, dtype=np.int64)
        starts = np.cumsum(qlen) - qlen
        slot = np.asarray(batch.slots, dtype=np.int64)
        ctx_np = np.asarray(host.ctx_lens, dtype=np.int64).reshape(S)
        # prefix cache state of the slots (docs/prefix_cache.md): floors of replayed hits, armed captures
        wf = getattr(cache, "write_floor", None)
        write_floor = np.asarray([wf[s] for s in batch.slots], dtype=np.int64) if wf else None
        win = getattr(cache, "window_floor", None)
        window_floor = [win[s] for s in batch.slots] if win else []
        take = getattr(cache, "take_captures" if state_captures else "take_draft_captures", None) \
            if state_captures or draft_captures else None
        captures = tuple(take(batch.slots, host.ctx_lens, batch.query_lens)) if take is not None else ()
        seq_host = SeqHost(
            ctx=ctx_np, qlen=qlen, start=starts, slot=slot,
            write_floor=write_floor if write_floor is not None and (write_floor > ctx_np).any() else None,
            captures=captures,
        )  # fmt: skip
        if batch.seq is not None and batch.seq_of_token is not None:
            seq_t, seq_of_token = batch.seq, batch.seq_of_token
        else:  # one host -> device copy for all per-sequence ints and the token -> sequence map
            packed = upload(
                np.concatenate(
                    [seq_host.ctx, qlen, starts, seq_host.slot, np.repeat(np.arange(S, dtype=np.int64), qlen)]
                ),
                batch.input_ids.device,
            )
            ctx_t, qlen_t, start_t, slot_t, seq_of_token = torch.split(packed, [S, S, S, S, T])
            seq_t = SeqTensors(ctx=ctx_t, qlen=qlen_t, start=start_t, slot=slot_t)
        # approximate prefix replay: the window rows before the replay start were never cached (window_floor)
        ring = max((t.shape[1] for t in getattr(cache, "swa", {}).values()), default=0)
        floors = tuple(window_floor) if any(f > 0 and c - f < ring for f, c in zip(window_floor, host.ctx_lens)) \
            else None
        return cls(
            batch=batch,
            cache=cache,
            host=host,
            seq_host=seq_host,
            window_floor=floors,
            seq_starts=tuple(int(x) for x in starts),
            query_lens=batch.query_lens,
            ctx_lens=tuple(host.ctx_lens),
            seq_of_token=seq_of_token,
            seq_t=seq_t,
            **kw,  # type: ignore[arg-type]
        )

    # ---------------------------------------------------------------------------------------------- plans
    def ring_plan(
        self, ring_rows: int, backs: tuple[int, ...], *, write: bool, max_back: int | None = None
    ) -> RingPlan:
        """Cached RingPlan for a ring of `ring_rows` rows read with backs[i] history rows per sequence.

        max_back: the most history rows this call site can ask for at any position (a fixed-shape step reads
        that many for every sequence instead of backs)."""
        if self.static is not None:
            if max_back is None:
                raise InputError("ring_plan: a fixed-shape (static) forward needs the call site's max_back")
            return self.static.ring_plan(ring_rows, max_back, write=write)
        if self.window_floor is not None:  # rows below the floor were never written: not even read
            backs = tuple(min(b, max(c - f, 0)) for b, c, f in zip(backs, self.ctx_lens, self.window_floor))
        key = ("ring", ring_rows, backs, write)
        plan = self.plans.get(key)
        if plan is None:
            plan = build_ring_plan(ring_rows, backs, self.seq_host, write=write, device=self.seq_t.ctx.device)
            self.plans[key] = plan
        return plan  # type: ignore[return-value]

    def paged_plan(self, ratio: int) -> PagedPlan:
        """Cached PagedPlan of the ratio-`ratio` paged families (entries and this step's new entries)."""
        key = ("paged", ratio)
        plan = self.plans.get(key)
        if plan is None and self.static is not None:  # block tables checked by the static step's caller, on the host
            plan = self.plans[key] = self.static.paged_plan(ratio, backend=self.kernel_backend)  # once per forward
        if plan is None:
            if "checked" not in self.plans:  # block-table coverage: once per forward, for every paged ratio
                ratios = sorted(set(self.cache.ratios.values()))
                check_block_tables(
                    self.host.block_tables, self.cache.page_size, ratios, self.ctx_lens, self.query_lens
                )
                self.plans["checked"] = True
            plan = build_paged_plan(
                ratio, self.cache.page_size, self.host.block_tables, self.seq_host, device=self.seq_t.ctx.device
            )
            self.plans[key] = plan
        return plan  # type: ignore[return-value]

    def visible_counts(self, ratio: int) -> Tensor:
        """[T] int64 compressed entries of ratio `ratio` visible to each query, floor((position + 1) / ratio)
        (`deepinfer_kernels.indexer.visible_counts`); once per forward and ratio, host-built in a fixed-shape step."""
        key = ("vis", ratio)
        vis = self.plans.get(key)
        if vis is None:
            if self.static is not None:
                vis = self.static.visible_counts(ratio)
            else:
                vis = visible_counts(self.batch.positions, ratio)
            self.plans[key] = vis
        return vis  # type: ignore[return-value]

    def entry_positions(self, paged: PagedPlan) -> Tensor:
        """[M] int64 first token position of each new entry of `paged` (new_w * ratio: where the entry's RoPE
        is applied)."""
        key = ("entry_pos", paged.ratio)
        pos = self.plans.get(key)
        if pos is None:
            pos = self.plans[key] = paged.new_w * paged.ratio
        return pos  # type: ignore[return-value]

    def entry_rows(self, plan: RingPlan, paged: PagedPlan) -> Tensor:
        """[M, r] int64 pool rows (see RingPlan.gather) of the r token positions of each new entry of `paged`
        (entry w of sequence new_seq: positions r*w .. r*w + r - 1). A fixed-shape step's plans clamp into the
        pool (`RingPlan.pool_len`): the entries a padding row completes read some row and are dropped."""
        key = ("entry", id(plan), paged.ratio)  # plans live in self.plans for the whole forward
        rows = self.plans.get(key)
        if rows is not None:
            return rows  # type: ignore[return-value]
        r = paged.ratio
        seq = paged.new_seq[:, None].expand(-1, r)
        pos = paged.new_w[:, None] * r + torch.arange(r, device=paged.new_w.device)[None, :]
        rows = self.plans[key] = plan.pool_rows(seq, pos, self.seq_t)
        return rows

    def window_rows(self, plan: RingPlan, window: int, *, noncausal: bool) -> Tensor:
        """[T, K] int64 pool rows (see RingPlan.gather) of each query's window, -1 = none.

        causal: positions p-window+1 .. p (K = window); noncausal (DSpark draft block): positions
        [c_i - window, c_i + n_i) of the query's sequence (K = window + max n_i).
        """
        key = ("win", id(plan), window, noncausal)  # plans live in self.plans for the whole forward
        idx = self.plans.get(key)
        if idx is not None:
            return idx  # type: ignore[return-value]
        # a fixed-shape step builds them on the host with its other plans, where they are rebuilt only when the step's
        # layout changes; a ragged step's layout (each sequence's rows) changes whenever the policy verifies other
        # draft counts, which on the H200's host cost more than these few device ops inside the captured graph
        if self.static is not None and not noncausal and self.window_floor is None and not self.static.ragged:
            idx = self.plans[key] = self.static.window_rows(plan, window)
            return idx
        st, seq, pos = self.seq_t, self.seq_of_token, self.batch.positions
        if noncausal:
            k = window + max(self.query_lens, default=0)
            lo = st.ctx[seq] - window
            hi = st.ctx[seq] + st.qlen[seq] - 1
        else:
            k = window
            lo = pos - window + 1
            hi = pos
        q = lo[:, None] + torch.arange(k, device=pos.device)[None, :]  # [T, K] positions
        valid = (q >= 0) & (q <= hi[:, None])
        if self.window_floor is not None:
            floor = self.plans.get("floor")
            if floor is None:
                floor = self.plans["floor"] = upload(np.asarray(self.window_floor, dtype=np.int64), pos.device)
            valid &= q >= floor[seq][:, None]
        rows = plan.pool_rows(seq[:, None].expand_as(q), q, st)
        idx = torch.where(valid, rows, torch.full_like(rows, -1))
        self.plans[key] = idx
        return idx

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def seq_rows(self, i: int) -> slice:
        """Rows of T that belong to sequence i."""
        return slice(self.seq_starts[i], self.seq_starts[i] + self.query_lens[i])

    def end_len(self, i: int) -> int:
        """Sequence i's length after this step (ctx + new)."""
        return self.ctx_lens[i] + self.query_lens[i]
