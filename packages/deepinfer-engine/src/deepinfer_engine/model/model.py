"""The DeepSeek-V4 / V4.1 text model (docs/model.md §A.1-§A.9, docs/model.md §C.1-§C.2), module by module as the reference.

Parameter names equal the official checkpoint names (`embed.weight`, `layers.{l}.attn.wq_a.weight`, `mtp.{k}.…`).
V4: mHC with the learned hc_head, SWA / CSA / HCA, hash-routed MoE in the first `num_hash_layers`, MTP block.
V4.1: delayed mHC (pre from the previous sub-layer, no hc_head), CSA2 (csa2.py), Engram (engram.py), DSpark
stages (dspark.py). Runs on CPU through the torch references of deepinfer-kernels.

Shapes: T tokens of the step (flattened varlen), n = hc_mult streams, d hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from deepinfer_kernels.embed import embed_streams
from torch import Tensor, nn

from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.attention import Attention, RMSNorm
from deepinfer_engine.model.block import Block, MTPBlock
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.engram_hash_device import DeviceEngramHasher
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext, StepHost
from deepinfer_engine.model.image_ids import image_positions, max_input_id
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.mhc import add_hc_head_params, apply_hc_head, hc_pre
from deepinfer_engine.model.overlap import OVERLAP_MAX_TOKENS, SideStreams
from deepinfer_engine.model.static_step import StaticDecodeStep
from deepinfer_engine.model.token_ring import ring_step
from deepinfer_engine.model.truncation import plan_truncation

__all__ = ["ModelOutput", "Transformer"]


@dataclass(kw_only=True)
class ModelOutput:
    """logits [N, V] f32 (rows batch.logits_indices); hidden: final streams [T, n, d] before the head collapse;
    pre_last: V4.1 pre of the last FFN mixes [T, n] (None for V4); features: captured [T, d] per layer id.
    kept_batch: under prefill truncation, the sub-batch of the rows hidden / pre_last / features cover (each
    sequence's last rows; truncation.py); None: they cover every row of the step's batch."""

    logits: Tensor
    hidden: Tensor
    pre_last: Tensor | None
    features: dict[int, Tensor] = field(default_factory=dict)
    kept_batch: ForwardBatch | None = None


class Transformer(nn.Module):
    """`embed` → layers → head collapse (V4 hc_head / V4.1 last pre-mix) → `norm` → `head` (fp32 logits).

    quantized: hold every tensor the checkpoint stores quantized in that format (FP8 / FP4 + scales, decoded in
    the GEMMs; what load_model builds); False: dense weights in `dtype` (random-init tests). quantize_activations
    (with quantized): FP8 Linears quantize their inputs to e4m3 per 1 x block channels (deployed numerics).
    deployed_numerics: round every KV write / indexer operand through the checkpoint's cache record formats
    (engine option ``kv_cache_dtype="auto"``, kv_numerics.py); False keeps full-precision KV.
    """

    pdl = False  # programmatic dependent launch off until set_pdl (the engine's `pdl` option turns it on)

    def __init__(
        self,
        args: object,
        dtype: torch.dtype = torch.float32,
        *,
        with_draft: bool = True,
        quantized: bool = False,
        quantize_activations: bool = False,
        deployed_numerics: bool = False,
    ) -> None:
        super().__init__()
        if quantize_activations and not quantized:
            raise ModelConfigError("quantize_activations needs quantized=True (FP8 weights in memory)")
        self.args = args
        self.with_draft = with_draft
        self.dtype = dtype
        d, V = args.hidden_size, args.vocab_size
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(V, d, dtype=dtype))
        backbone = [p for p in args.layer_plans if not p.is_draft]
        self.layers = nn.ModuleList(Block(args, p, dtype) for p in backbone)
        self.norm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.head = Linear(d, V, dtype)
        if args.has_hc_head:
            add_hc_head_params(self, args)
        # Engram row ids depend only on token ids: the hasher's constants (needs the token map; engram_hash.py) and
        # their device copy, made on first use on the batch's device (engram_hash_device.py)
        self.engram_hasher: object | None = None
        self._engram_device: DeviceEngramHasher | None = None
        drafts = [p for p in args.layer_plans if p.is_draft]
        self.mtp: nn.ModuleList | None = None
        if drafts and with_draft:
            if args.has_dspark:
                from deepinfer_engine.model import dspark  # DSpark stages

                self.mtp = dspark.build_stages(args, dtype)
            else:
                self.mtp = nn.ModuleList(MTPBlock(args, p, dtype) for p in drafts)
        self.quantized = quantized
        if quantized:
            from deepinfer_engine.model.weight_formats import apply_checkpoint_formats

            apply_checkpoint_formats(self, args, quantize_activations=quantize_activations)
        self.set_deployed_numerics(deployed_numerics)
        # the kernel backend is decided once, here (DEEPINFER_KERNEL_BACKEND read once), and handed to every module
        from deepinfer_kernels import backend_from_env

        self.set_kernel_backend(backend_from_env())
        self.decoder_split = None  # prefill truncation off (set_prefill_truncation)
        self.overlap = True  # side streams in decode-sized CUDA steps (set_overlap)
        self._streams: SideStreams | None = None  # made on first use on the step's device

    def set_prefill_truncation(self, mode: str, keep: int = 140) -> None:
        """Decoder truncation in prefill (truncation.py): "off" runs every row through every layer; "compact"
        runs the decoder layers on the last `keep` rows of each request (ConfigError on a model without an
        encoder/decoder split or a keep below window + 6)."""
        from deepinfer_engine.errors import ConfigError
        from deepinfer_engine.model.truncation import PREFILL_TRUNCATION_MODES, decoder_split

        if mode not in PREFILL_TRUNCATION_MODES:
            raise ConfigError(f"prefill_truncation: found {mode!r}, expected one of {', '.join(PREFILL_TRUNCATION_MODES)}")
        self.decoder_split = decoder_split(self.args, keep) if mode == "compact" else None

    def set_kernel_backend(self, backend: str) -> None:
        """Give every module the kernel backend its ops run with: "device" (Triton where the op supports the
        inputs on CUDA), "torch" (the references), "triton-where-supported", or a plain op backend."""
        self.kernel_backend = backend
        for m in self.modules():
            m.kernel_backend = backend

    def set_pdl(self, on: bool) -> None:
        """Give every module the programmatic dependent launch switch (docs/pdl.md) its kernels are called with: the
        FP8 linears (`Linear`, `linear_pair`), the RMSNorms and the rope kernels. A speed hint only: the kernels use
        PDL where it is possible (compiled on a CUDA device of sm_90 or later) and the results are the same either
        way. Set it before a CUDA graph is captured: a graph keeps the launches it recorded."""
        self.pdl = bool(on)
        for m in self.modules():
            m.pdl = self.pdl

    def set_overlap(self, on: bool) -> None:
        """Run independent work of decode-sized CUDA steps on side streams (overlap.py, docs/overlap.md: the shared
        experts, the query projections, the V4.1 mHC mixes, the Engram projections one layer ahead); the same
        kernels on the same inputs, so the same results. On by default (engine option `side_streams`). Set it
        before a CUDA graph is captured: a graph keeps the streams it recorded."""
        self.overlap = bool(on)

    def set_deployed_numerics(self, on: bool, *, cache_records: bool = False) -> None:
        """Switch every attention module (backbone and drafts) to the deployed KV numerics, or back.
        `cache_records`: the cache stores the deployed records itself (kv_numerics.kv_numerics)."""
        from deepinfer_engine.model.kv_numerics import kv_numerics

        self.deployed_numerics = bool(on)
        numerics = kv_numerics(self.args, self.deployed_numerics, cache_records=cache_records)
        for m in self.modules():
            if isinstance(m, Attention):
                m.numerics = numerics

    def set_engram_token_map(self, token_map: object) -> None:
        """Install the Engram hasher from a compressed token map (numpy int64 [vocab], engram_hash)."""
        from deepinfer_engine.model.engram_hash import EngramHasher

        self.engram_hasher = EngramHasher.from_args(self.args, token_map)
        self._engram_device = None

    # ---------------------------------------------------------------------------------------------- checks
    def check_inputs(self, batch: ForwardBatch, cache: ModelCache, *, backbone: bool = True) -> StepHost:
        """Typed errors for bad input before any matmul (contracts §3: InputError; CapacityError for a backbone
        step that rolls back further than the cache slack). Returns the step's host facts.

        Host facts only: the batch's StepHost (the runner's persistent input batch, `ForwardBatch.single`), or,
        for a batch built without one, a read-back of its tensors (direct model users). The engine validates
        requests once at admission; these checks are the cheap host-side guard for direct callers.
        """
        a = self.args
        host = batch.host if batch.host is not None else StepHost.read(batch)
        if any(s < 0 or s >= cache.num_slots for s in batch.slots):
            raise InputError(f"slots: found {batch.slots}, expected each in [0, {cache.num_slots})")
        if len(host.ctx_lens) != batch.num_seqs or host.input_ids.shape != (batch.num_tokens,):
            raise InputError(
                f"ForwardBatch.host: found {len(host.ctx_lens)} ctx_lens and ids {host.input_ids.shape}, expected "
                f"{batch.num_seqs} and ({batch.num_tokens},)"
            )
        ids = host.input_ids
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            top = max_input_id(a)  # vocab_size, or vocab_size + 5 image-position ids (image_ids.py)
            if lo < 0 or hi >= top:
                bad = lo if lo < 0 else hi
                raise InputError(f"input_ids: found token id {bad}, expected 0 <= id < {top} (vocab_size={a.vocab_size}"
                                 f"{', + 5 image ids' if top > a.vocab_size else ''})")  # fmt: skip
        for c, n in zip(host.ctx_lens, batch.query_lens):
            if c < 0 or c + n > a.max_position_embeddings:
                bad = c if c < 0 else c + n - 1
                raise InputError(
                    f"positions: found {bad}, expected 0 <= position < max_position_embeddings="
                    f"{a.max_position_embeddings}"
                )
        if backbone:  # draft steps (MTP) run at positions of their own; they do not move the mark
            for slot, c in zip(batch.slots, host.ctx_lens):
                cache.check_resume(slot, c)
        return host

    def _engram_rows(self, ctx: ForwardContext) -> Tensor | None:
        """The step's Engram row ids [T, num_engram_layers, lookups] int64, computed on the batch's device from its
        device ids and the cache's device token ring, which gets this step's ids (None: no Engram). Device ops
        only (docs/async_scheduling.md): the ids may be asynchronous placeholders resolved on the device, and
        a fixed-shape step runs it inside its CUDA graph from the static buffers."""
        ring = getattr(ctx.cache, "token_ring", None)
        if ring is None:
            return None
        batch, st = ctx.batch, ctx.seq_t
        ids, pos, seq = batch.input_ids, batch.positions, ctx.seq_of_token
        prev = ring_step(ring, ids, pos, seq, st.ctx, st.qlen, st.slot, back=self.args.engram_max_ngram_size - 1,
                         dump_slot=ctx.cache.scratch_slot, backend=self.kernel_backend)
        if self.engram_hasher is None:
            return None
        dev = self._engram_device
        if dev is None or dev.device != ids.device or dev.source is not self.engram_hasher:
            dev = self._engram_device = DeviceEngramHasher(self.engram_hasher, ids.device)
        return dev.rows(ids, prev, backend=self.kernel_backend)

    def _side_streams(self, batch: ForwardBatch) -> SideStreams | None:
        dev = batch.input_ids.device
        if not self.overlap or dev.type != "cuda" or batch.num_tokens > OVERLAP_MAX_TOKENS:
            return None
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        s = self._streams
        if s is None or s.device != dev:
            if torch.cuda.is_current_stream_capturing():
                return None  # streams are created outside captures (the graph runner warms up eagerly first)
            s = self._streams = SideStreams.create(dev)
        return s

    def host_step(self, batch: ForwardBatch, cache: ModelCache) -> None:
        """The host half of a forward, for a caller that replays the device half (a captured fixed-shape step):
        the input checks and the rollback marks. Exactly what forward_features does on the host for the same
        batch (Engram row ids are computed inside the device half)."""
        host = self.check_inputs(batch, cache)
        for slot, c, n in zip(batch.slots, host.ctx_lens, batch.query_lens):
            cache.high_water[slot] = c + n

    # ---------------------------------------------------------------------------------------------- forward
    @torch.no_grad()  # inference-only model: no autograd graph, whatever the caller's grad mode
    def forward_features(
        self, batch: ForwardBatch | None, cache: ModelCache, *, capture: tuple[int, ...] = (),
        static: StaticDecodeStep | None = None, logits_out: Tensor | None = None,
    ) -> ModelOutput:
        """static: run the fixed-shape step held there (its batch and plans; `batch` is ignored and
        the host half, `host_step`, is the caller's) -- the form a CUDA graph captures. logits_out: a contiguous
        [rows, V] float32 tensor the LM head writes the logits into (CUDA graphs share one across shapes)."""
        if static is None:
            host = self.check_inputs(batch, cache)
            ctx = ForwardContext.build(batch, cache, host=host, capture_layers=tuple(capture), state_captures=True)
            ctx.engram_rows = self._engram_rows(ctx)
        else:
            ctx = static.context(cache, capture_layers=tuple(capture), kernel_backend=self.kernel_backend)
            ctx.engram_rows = self._engram_rows(ctx)
            batch = ctx.batch
        a = self.args
        # a fixed-shape step is a decode step: every row is kept, no window reaches below a truncation floor
        cut = plan_truncation(self.decoder_split, batch, host) if static is None else None
        if cut is None:  # side work covers every row of the step (truncation would run later layers on fewer)
            ctx.side_streams = self._side_streams(batch)
        img = image_positions(batch.input_ids, a.vocab_size)
        ctx.image_mask = img  # read by Engram (gate 0) and by the MoE gates with bias_vl: computed once per forward
        # image ids lie past the vocabulary: their token embedding is 0 (a vision tower would replace it)
        r = embed_streams(batch.input_ids, self.embed.weight, a.hc_mult, backend=self.kernel_backend)  # [T, n, d]
        pre: Tensor | None = None
        c = ctx  # the context of the rows still running (the decoder's kept rows after the boundary)
        # V4.1 fixed-shape steps chain the collapses: each layer's last combine also collapses its output with the
        # next layer's pre (its own pre_f), unless the next layer's Engram changes the streams first
        chain = static is not None and a.uses_delayed_mhc
        x_next: Tensor | None = None
        for i, layer in enumerate(self.layers):
            lid = layer.layer_id
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if ctx.side_streams is not None and nxt is not None and nxt.engram is not None:
                nxt.prefetch_engram(ctx, ctx.side_streams.prefetch)  # token ids only: beside this layer
            if cut is not None and lid == cut.split.boundary:
                r, pre, c = cut.enter(layer, r, pre, ctx)
                if not c.num_seqs:
                    break  # no decoder row in this step (early prefill chunks only)
            if a.arch == "v41" and lid in c.capture_layers:
                # fp32 accumulation inside the reduction (no fp32 copy of the streams first): 2 launches, not 3
                c.features[lid] = r.mean(dim=1, dtype=torch.float32).to(r.dtype)
            if chain:
                r, pre, x_next = layer.forward_chained(r, c, pre, collapsed=x_next,
                                                       collapse_next=nxt is None or nxt.engram is None)
            else:
                r, pre = layer(r, c, pre)
            if a.arch == "v4" and lid in c.capture_layers:
                c.features[lid] = r.mean(dim=1, dtype=torch.float32).to(r.dtype)
        if static is None:
            for i, slot in enumerate(batch.slots):
                cache.high_water[slot] = ctx.end_len(i)
        # a fixed-shape step takes the logits of every row in order (logits_indices = arange): no gather
        li = None if static is not None else c.batch.logits_indices
        rows = r if li is None else r[li]
        if a.has_hc_head:
            h = apply_hc_head(self, rows, a)
            pre_last = None
        else:
            pre_last = pre
            if li is None and x_next is not None:  # the last layer's chained collapse of every row
                h = x_next
            else:
                h = hc_pre(rows, pre if li is None else pre[li], backend=self.kernel_backend)
        # fp32 logits (docs/model.md §A.1) without widening the [V, d] head weight: fp32 accumulation over its stored dtype
        logits = self.head.f32_out(self.norm(h), out=logits_out)
        return ModelOutput(logits=logits, hidden=r, pre_last=pre_last, features=dict(c.features),
                           kept_batch=None if c is ctx else c.batch)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        """[N, V] float32 logits of the rows batch.logits_indices (contracts §3)."""
        return self.forward_features(batch, cache).logits

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, cache: ModelCache, hidden: Tensor, k: int = 0) -> Tensor:
        """V4 MTP block k: batch carries the NEXT tokens (id t+1) at the chosen positions; hidden [T, n, d] the
        backbone streams of the same rows. Returns [N, V] f32 logits (predicting t+2)."""
        if self.mtp is None or self.args.has_dspark:
            raise InputError("forward_mtp: this model has no V4 MTP block (num_nextn_predict_layers == 0 or DSpark)")
        host = self.check_inputs(batch, cache, backbone=False)
        ctx = ForwardContext.build(batch, cache, host=host, draft_captures=k == 0)
        blk: MTPBlock = self.mtp[k]
        h, _ = blk.forward_mtp(hidden, self.embed.weight[batch.input_ids], ctx)
        return self.head.f32_out(h[batch.logits_indices])
