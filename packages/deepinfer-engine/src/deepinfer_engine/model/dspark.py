"""DSpark draft stages (docs/model.md Part B, docs/model.md §C.7): modules ``mtp.{k}.*`` and their forward.

Two forwards, both on ``Transformer.mtp`` (built by ``build_stages``):
- ``insert_context``: for accepted positions s with target features ``a_s`` (hc-stream means at the target
  layers: V4.1 inputs of ``dspark_target_layer_ids``, V4 outputs), ``m_s = RMSNorm(main_proj(a_s); main_norm)``
  and every stage k writes ``RoPE_{1e4}(RMSNorm(wkv_k m_s; kv_norm_k), s)`` into its own window ring.
- ``draft_block``: the block ``[y_p, noise, ...]`` at positions ``p .. p+N-1`` runs through the stages with the
  non-causal draft mask (``ctx.block_noncausal``: context ``[max(0, p-W), p)`` + the whole block), V4.1 delayed
  mHC starting from stream 0 (V4: per-stage own pre, learned ``mtp.{last}.hc_head``), then
  ``head(RMSNorm(h; mtp.{last}.norm))`` -> base logits ``U [T, V] float32`` and the pre-norm hidden ``h``.
The Markov head adds ``head.weight @ embed.weight[prev]`` sequentially with the SAMPLED previous token; the
sampling policy belongs to deepinfer-dspark; ``greedy_draft`` here is the reference/test helper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.attention import RMSNorm
from deepinfer_engine.model.block import Block
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.mhc import add_hc_head_params, apply_hc_head, hc_pre
from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep

__all__ = [
    "ConfidenceHead",
    "DSparkStage",
    "DraftOutput",
    "MarkovHead",
    "StaticInsert",
    "build_stages",
    "draft_block",
    "draft_block_ids",
    "draft_stages",
    "greedy_draft",
    "insert_context",
    "markov_logits",
    "markov_step",
    "target_features",
]


class MarkovHead(nn.Module):
    """Low-rank previous-token bias: ``bias = W2 · W1[prev]`` with ``W1, W2 [V, rank]``.

    Names: V4.1 ``markov_head.embed.weight`` / ``markov_head.head.weight``; V4-0731 ``markov_head.markov_w1.weight``
    / ``markov_head.markov_w2.weight`` (docs/model.md §B.2, docs/model.md §C.7).
    """

    def __init__(self, *, vocab: int, rank: int, arch: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        w1, w2 = ("embed", "head") if arch == "v41" else ("markov_w1", "markov_w2")
        self._names = (w1, w2)
        setattr(self, w1, Linear(rank, vocab, dtype))  # weight [V, rank]: used as an embedding table
        setattr(self, w2, Linear(rank, vocab, dtype))  # weight [V, rank]: rank -> vocab projection

    @property
    def w1(self) -> Tensor:
        return getattr(self, self._names[0]).weight

    @property
    def w2(self) -> Tensor:
        return getattr(self, self._names[1]).weight

    def forward(self, prev: Tensor) -> tuple[Tensor, Tensor]:
        """prev ``[B] int64`` -> (markov embed ``e [B, rank]``, vocab bias ``[B, V] float32``)."""
        e = self.w1[prev]
        return e, (e.float() @ self.w2.float().T)


class ConfidenceHead(nn.Module):
    """``confidence_head.proj.weight [1, d + rank]``, no bias [I: vLLM/SGLang load it without one, §11.3]."""

    def __init__(self, *, dim: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        del dtype  # stored fp32 in the checkpoint (docs/model.md §B.2); forward rounds it to bf16 like the reference
        self.proj = Linear(dim + rank, 1, torch.float32)

    def forward(self, h: Tensor, e: Tensor) -> Tensor:
        """h ``[B, d]`` PRE-norm head hidden of the position, e ``[B, rank]`` markov embed of the token BEFORE
        the drafted one -> ``sigmoid(w · [h; e]) [B] float32``."""
        x = torch.cat([h.float(), e.float()], dim=-1)
        # DeepSeek's code rounds this weight to bf16 before the fp32 dot (docs/fidelity.md §4)
        w = self.proj.weight.to(torch.bfloat16).float()
        return torch.sigmoid(x @ w.T).squeeze(-1)


class DSparkStage(Block):
    """Draft stage ``mtp.{k}.``: a ratio-0 Block (own SWA ring) plus stage-specific extras.

    Stage 0: ``main_proj [d, n_targets·d]``, ``main_norm``. Last stage: ``norm``, ``markov_head``,
    ``confidence_head`` and (V4 only) ``hc_head_{fn,base,scale}``.
    """

    def __init__(self, args: object, plan: object, dtype: torch.dtype, *, index: int, count: int) -> None:
        super().__init__(args, plan, dtype)
        if plan.ratio != 0:
            raise ModelConfigError(
                f"compress_ratios[{plan.layer_id}]: DSpark stage needs ratio 0, found {plan.ratio}"
            )
        d = args.hidden_size
        self.index = index
        if index == 0:
            self.main_proj = Linear(len(args.dspark_target_layer_ids) * d, d, dtype)
            self.main_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        if index == count - 1:
            self.norm = RMSNorm(d, args.rms_norm_eps, dtype)
            rank = args.dspark_markov_rank
            self.markov_head = MarkovHead(vocab=args.vocab_size, rank=rank, arch=args.arch, dtype=dtype)
            self.confidence_head = ConfidenceHead(dim=d, rank=rank, dtype=dtype)
            if args.has_hc_head:
                add_hc_head_params(self, args)


def build_stages(args: object, dtype: torch.dtype) -> nn.ModuleList:
    """``Transformer.mtp``: one DSparkStage per draft layer id (checkpoint prefix ``mtp.{k}.``)."""
    if not args.has_dspark:
        raise ModelConfigError(
            "dspark_block_size: found None, expected a DSpark config to build draft stages"
        )
    plans = [args.plan(lid) for lid in args.draft_layer_ids]
    return nn.ModuleList(DSparkStage(args, p, dtype, index=k, count=len(plans)) for k, p in enumerate(plans))


def draft_stages(model: nn.Module) -> nn.ModuleList:
    """`model.mtp` when the model has DSpark stages, else InputError."""
    stages = getattr(model, "mtp", None)
    if stages is None or not model.args.has_dspark:
        raise InputError("DSpark: this model has no DSpark draft stages (dspark_block_size missing)")
    return stages


def target_features(features: dict[int, Tensor], target_ids: tuple[int, ...]) -> Tensor:
    """``a [T, n_targets·d]``: concatenation of the captured hc-stream means in ``dspark_target_layer_ids`` order."""
    missing = [lid for lid in target_ids if lid not in features]
    if missing:
        raise InputError(
            f"DSpark target features: layers {missing} were not captured (forward_features capture=)"
        )
    return torch.cat([features[lid] for lid in target_ids], dim=-1)


@torch.no_grad()  # inference only: no autograd graph whatever the caller's grad mode
def insert_context(model: nn.Module, batch: ForwardBatch | None, cache: ModelCache, features: Tensor, *,
                   static: object = None) -> Tensor:  # fmt: skip
    """Write the stages' context KV for the batch's positions; features ``[T, n_targets·d]``.

    ``batch`` carries the accepted positions (input_ids are not used). Returns ``m [T, d]``.
    static: a fixed-shape step (static_step.StaticDecodeStep made with ``write_padding=False``; `StaticInsert`)
    whose batch and ring plans replace ``batch``: every row is projected, only the rows of each sequence's real
    tokens are written to its rings (the others go to the scratch slot). It serves no prefix-cache captures.
    """
    stages = draft_stages(model)
    if static is None:
        ctx = ForwardContext.build(batch, cache, draft_captures=True)
        if ctx.seq_host.captures:  # state blocks (prefix cache): the plans below capture this step's rows only
            cache.capture_history([st.attn.layer_id for st in stages], ctx.seq_host)
    else:
        if static.write_padding:
            raise InputError("DSpark insert_context: found a fixed-shape step with write_padding=True, expected "
                             "write_padding=False (see StaticInsert: padding rows must not reach the rings)")
        ctx = static.context(cache, kernel_backend=getattr(model, "kernel_backend", "device"))
        batch = ctx.batch
    s0 = stages[0]
    m = s0.main_norm(s0.main_proj(features))
    for st in stages:
        st.attn.write_window(st.attn.project_kv(m, batch.positions), ctx)
    return m


class StaticInsert:
    """`insert_context` of one step over a fixed shape, the form a CUDA graph captures (worker/cuda_graph.py
    `run_insert`) and that runs eagerly anywhere (tests): `batch_size` sequences x `tokens` (Q) rows, row j of
    sequence i at position ctx_i + j (the verify step's layout, static_step.StaticDecodeStep); sequence i's first
    n_i <= Q rows are its kept positions.

    `fill` writes a step's facts into static buffers: the step's (positions, slots, write plan) and, per target
    layer, a `[B * Q, d]` feature buffer gathered from the step's captured features. `forward` then only reads
    those buffers, the weights and the rings and writes the rings: no host read, nothing sized by the step.

    Only the kept rows reach the rings: the step is made with `write_padding=False`, so the padding rows (rows
    j >= n_i, and the padding sequences) write into the scratch slot. Writing every row into the sequence's own
    ring would be harmless only while Q <= slack + 1. A draft ring has R = W + slack rows (ModelCache.allocate),
    and a draft pass anchored at p reads positions [p - W, p) (`Attention._window`, block_noncausal). A round at
    ctx that keeps n >= 1 rows moves the next anchor to p = ctx + n, and its row j lands on the ring row of
    position ctx + j - R, which that pass reads iff ctx + j - R >= p - W, i.e. j >= n + slack (a later pass,
    larger p, only for a larger j). With j <= Q - 1 and n = 1 (no draft accepted) this first happens at
    Q = slack + 2, which the verify graphs allow (k <= slack + 1 drafts: the target's rings read back only
    W - 1 rows). Nothing else would catch it: `ModelCache.check_resume` guards rollbacks against the target's
    `high_water`, not the draft rings, and the prefix cache's state blocks copy ring rows as they are. Masking
    costs nothing (the write plan is rebuilt on the host every fill either way) and leaves every ring row as the
    eager insertion leaves it; nothing is written past the positions the target step itself wrote."""

    def __init__(self, model: nn.Module, cache: ModelCache, batch_size: int, tokens: int,
                 like: dict[int, Tensor]) -> None:  # fmt: skip
        """like: the captured features of a step (their dtype, width and device size the feature buffers)."""
        draft_stages(model)
        a = model.args
        self.model, self.cache = model, cache
        self.target_ids = tuple(a.dspark_target_layer_ids)
        dev = like[self.target_ids[0]].device
        # the stages own window rings only (no compressed entries): any length up to the model's positions
        self.step = StaticDecodeStep(cache, batch_size, int(a.max_position_embeddings), dev, tokens=tokens,
                                     write_padding=False)  # fmt: skip
        T = self.step.num_rows
        self.features = {lid: torch.zeros((T, *like[lid].shape[1:]), dtype=like[lid].dtype, device=dev)
                         for lid in self.target_ids}  # fmt: skip
        cuda = dev.type == "cuda"
        self._src_host = torch.zeros(T, dtype=torch.int64, pin_memory=cuda)
        self._src = torch.zeros(T, dtype=torch.int64, device=dev) if cuda else self._src_host
        self._copied = torch.cuda.Event() if cuda else None  # recorded after the copy out of _src_host
        self._pending = False

    @property
    def tokens(self) -> int:
        return self.step.tokens

    def accepts(self, features: dict[int, Tensor]) -> bool:
        """Whether `features` fit the buffers (every target layer, same dtype and width)."""
        return all(lid in features and features[lid].dtype == buf.dtype and features[lid].shape[1:] == buf.shape[1:]
                   for lid, buf in self.features.items())

    def fill(self, ctx: np.ndarray, slots: np.ndarray, lens: np.ndarray, first_rows: np.ndarray,
             features: dict[int, Tensor]) -> None:  # fmt: skip
        """One step's S <= batch_size sequences: first kept position ctx [S], cache slot [S], kept rows n_i [S]
        (1..Q) and the row of the step's features holding position ctx_i (first_rows [S]; its n_i rows follow
        it); features: {layer: [T, d]} of the step (every target layer)."""
        S, Q = int(ctx.shape[0]), self.step.tokens
        lens = np.asarray(lens, dtype=np.int64)
        self.step.fill(DecodeFacts(
            ctx=np.asarray(ctx, dtype=np.int64), slots=np.asarray(slots, dtype=np.int64),
            input_ids=np.zeros(int(lens.sum()), dtype=np.int64), block_tables=np.full((S, 1), -1, dtype=np.int64),
            query_lens=lens,
        ))  # fmt: skip
        if self._pending:  # the last fill's copy still reads the pinned rows: wait before rewriting them
            if not self._copied.query():
                self._copied.synchronize()
            self._pending = False
        src = self._src_host.numpy()
        # a padding row repeats its sequence's last kept row and a padding sequence reads row 0: real, finite
        # features (their rows are projected like the others, then written to the scratch slot)
        j = np.arange(Q, dtype=np.int64)
        src[: S * Q] = (np.asarray(first_rows, dtype=np.int64)[:, None] + np.minimum(j[None, :], lens[:, None] - 1)
                        ).reshape(-1)
        src[S * Q :] = 0
        if self._src is not self._src_host:
            self._src.copy_(self._src_host, non_blocking=True)
            self._copied.record()
            self._pending = True
        for lid, buf in self.features.items():
            torch.index_select(features[lid], 0, self._src, out=buf)

    def forward(self) -> Tensor:
        """The insertion over the filled buffers (the captured part): m `[B * Q, d]`."""
        return insert_context(self.model, None, self.cache, target_features(self.features, self.target_ids),
                              static=self.step)


@dataclass(frozen=True, kw_only=True)
class DraftOutput:
    """base_logits ``[T, V] float32`` (no Markov bias); hidden ``[T, d]`` pre-norm head input (confidence)."""

    base_logits: Tensor
    hidden: Tensor


def draft_block_ids(anchors: Tensor, block_size: int, noise_token_id: int) -> Tensor:
    """``[B·N] int64`` block tokens ``[y_p, noise, ..., noise]`` per sequence (sequence-major)."""
    out = torch.full((anchors.shape[0], block_size), noise_token_id, dtype=torch.int64, device=anchors.device)
    out[:, 0] = anchors
    return out.reshape(-1)


@torch.no_grad()  # inference only: no autograd graph whatever the caller's grad mode
def draft_block(model: nn.Module, batch: ForwardBatch | None, cache: ModelCache, *, static: object = None
                ) -> DraftOutput:  # fmt: skip
    """One parallel pass of the draft stages over the batch's blocks (non-causal inside each block).

    batch: per sequence the block tokens at positions ``p .. p+N-1`` (p = the anchor's position); the stages'
    rings must hold the context KV of positions ``< p`` (``insert_context``). Nothing is written to the rings.
    static: a fixed-shape step of N tokens per sequence (static_step.StaticDecodeStep, the form a CUDA graph
    captures): its batch and ring plans replace ``batch`` (padding sequences read the scratch slot).
    """
    stages = draft_stages(model)
    a = model.args
    if static is None:
        ctx = ForwardContext.build(batch, cache, block_noncausal=True)
    else:
        ctx = static.context(cache, block_noncausal=True, kernel_backend=getattr(model, "kernel_backend", "device"))
        batch = ctx.batch
    e = model.embed.weight[batch.input_ids]
    r = e[:, None, :].expand(-1, a.hc_mult, -1).contiguous()  # [T, n, d]
    pre: Tensor | None = None  # V4.1: delayed mHC starts again from stream 0
    for st in stages:
        r, pre = st(r, ctx, pre)
    last = stages[-1]
    backend = getattr(model, "kernel_backend", "auto")
    h = apply_hc_head(last, r, a) if a.has_hc_head else hc_pre(r, pre, backend=backend)
    logits = model.head.f32_out(last.norm(h))
    return DraftOutput(base_logits=logits, hidden=h)


def markov_step(markov: MarkovHead, base_logits: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
    """One sequential Markov correction: ``logits_i = U_i + W2 · W1[prev]``; returns (logits ``[B, V]`` f32,
    markov embed ``e_i [B, rank]``). ``prev`` is the token sampled at the previous block position (y_p for i=0)."""
    e, bias = markov(prev)
    return base_logits.float() + bias, e


def markov_logits(
    markov: MarkovHead, base_logits: Tensor, anchors: Tensor, drafted: Tensor
) -> tuple[Tensor, Tensor]:
    """Corrected logits for ALREADY sampled drafts in one batched op (e.g. for rejection sampling).

    base_logits ``[B, N, V]``, anchors ``[B]`` (y_p), drafted ``[B, N]`` (d_0..d_{N-1}); position i uses
    prev = y_p for i = 0, else d_{i-1}. Returns (logits ``[B, N, V]`` f32, markov embeds ``[B, N, rank]``).
    """
    prev = torch.cat([anchors[:, None], drafted[:, :-1]], dim=1)  # [B, N]
    e, bias = markov(prev.reshape(-1))
    b, n = prev.shape
    return base_logits.float() + bias.view(b, n, -1), e.view(b, n, -1)


@torch.no_grad()
def greedy_draft(model: nn.Module, out: DraftOutput, anchors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy sequential drafting (test/reference policy) over ``out`` of ``B`` blocks of ``N`` positions.

    Returns (draft tokens ``[B, N] int64``, corrected logits ``[B, N, V]`` f32, confidences ``[B, N]`` f32).
    """
    last = draft_stages(model)[-1]
    b = anchors.shape[0]
    u = out.base_logits.view(b, -1, out.base_logits.shape[-1])
    hid = out.hidden.view(b, u.shape[1], -1)
    prev = anchors
    toks, logits, conf = [], [], []
    for i in range(u.shape[1]):
        li, ei = markov_step(last.markov_head, u[:, i], prev)
        prev = torch.argmax(li, dim=-1)
        toks.append(prev)
        logits.append(li)
        conf.append(last.confidence_head(hid[:, i], ei))
    return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(conf, 1)
