"""CUDA graphs for decode steps (docs/cuda_graphs.md).

A decode step (every sequence feeds one token, logits of every sequence, nothing else asked) runs as the replay
of a graph captured for a padded shape (B, L): B = the smallest batch bucket >= the step's sequences, L = the
smallest length bucket >= every sequence's length after the step. Each graph owns a `StaticDecodeStep` (static
inputs and gather plans, model/static_step.py); before a replay the runner runs the forward's host half
(`Transformer.host_step`: input checks, rollback marks) and `fill`s the step's buffers (Engram row ids are
computed inside the graph from the step's token ids and the device token ring). Graphs are
captured lazily, on the first step that needs a shape (warm-up run on a side stream, then capture), into one
memory pool shared by all graphs. Everything else (prefill, mixed steps, prompt logprobs, shapes past the
largest bucket) runs eagerly.

A speculative verify step (every sequence feeds its last token and up to k drafts, logits of every row, the
draft model's target features and the final streams asked) replays a ragged graph captured for (B, L, T): the
sequences' rows back to back, T = the smallest row bucket >= the step's rows (`verify_row_sizes`: B, then steps of
half a batch up to B * (k + 1)), the rows past them on one padding sequence (static_step.py), so a request that
verifies fewer drafts makes the step cheaper whatever the others verify; the outputs of the real rows (rows
[:sum n_i]) are returned in batch order (`run_verify`), so the speculative decoder reads them exactly as an eager
forward's.

The DSpark draft passes (`run_draft`, `run_draft_proposal`), V4's MTP block (`run_mtp`) and DSpark's draft-ring
writes of a step's kept positions (`run_insert`, one graph per batch bucket over k + 1 rows per sequence whose
padding rows write the scratch slot: `dspark.StaticInsert`) replay graphs of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.model.model import ModelOutput
from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep
from deepinfer_engine.worker.sampler import Sampler

__all__ = ["CudaGraphRunner", "GraphStats", "decode_shape", "graph_batch_sizes", "length_bucket", "pick_bucket",
           "verify_row_sizes", "verify_shape", "verify_token_sizes"]

logger = logging.getLogger(__name__)

MIN_LEN_BUCKET = 256  # shortest length bucket: fewer graphs for short sequences, little padding cost


def _powers_of_two_then(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below n, then n itself (n >= 1)."""
    sizes, b = [], 1
    while b < n:
        sizes.append(b)
        b *= 2
    return (*sizes, n)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch buckets: powers of two below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ConfigError(f"cuda graphs: max_num_seqs {max_num_seqs}, expected >= 1")
    return _powers_of_two_then(max_num_seqs)


def pick_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest size >= n (sizes ascending), None when n exceeds them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


def length_bucket(need: int, max_model_len: int) -> int | None:
    """Smallest power of two >= need (at least MIN_LEN_BUCKET), capped to max_model_len; None when need
    exceeds max_model_len."""
    if need > max_model_len:
        return None
    b = MIN_LEN_BUCKET
    while b < need:
        b *= 2
    return min(b, max_model_len)


def decode_shape(
    query_lens: Sequence[int], ctx_lens: Sequence[int], logit_rows: Sequence[int], batch_sizes: Sequence[int],
    max_model_len: int,
) -> tuple[int, int] | None:
    """(B, L) of the graph that runs a step, None when it must run eagerly: a step qualifies when every sequence
    feeds one token and the logits are exactly one row per sequence in batch order (no prompt logprobs)."""
    S = len(query_lens)
    if S == 0 or any(n != 1 for n in query_lens) or list(logit_rows) != list(range(S)):
        return None
    B = pick_bucket(S, batch_sizes)
    L = length_bucket(max(ctx_lens) + 1, max_model_len)
    return None if B is None or L is None else (B, L)


def verify_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """Tokens-per-sequence buckets of fixed-shape multi-token steps (V4's MTP passes): powers of two below
    max_tokens (= k + 1), then max_tokens."""
    if max_tokens < 1:
        raise ConfigError(f"cuda graphs: {max_tokens} tokens per verified sequence, expected >= 1")
    return _powers_of_two_then(max_tokens)


# times a verify row bucket is asked for, while a larger captured bucket of its (B, L) runs it, before it is captured
VERIFY_CAPTURE_AFTER = 3


def verify_row_sizes(batch: int, max_tokens: int) -> tuple[int, ...]:
    """Row buckets of the ragged verify steps of a batch bucket of `batch` sequences of 1..max_tokens rows each:
    batch, then steps of half a batch (rounded up) to batch * max_tokens. A step's rows round up to the next
    bucket, and its padding rows cost what real ones do: finer steps waste less of a pruned draft's saving, for
    more graphs (captured lazily, per shape a step needs)."""
    if batch < 1 or max_tokens < 1:
        raise ConfigError(f"cuda graphs: verify rows of {batch} sequences x {max_tokens} tokens, expected >= 1 each")
    return tuple(sorted({-(-batch * m // 2) for m in range(2, 2 * max_tokens + 1)}))


def verify_shape(
    query_lens: Sequence[int], ctx_lens: Sequence[int], logit_rows: Sequence[int], batch_sizes: Sequence[int],
    max_tokens: int, max_model_len: int,
) -> tuple[int, int, int] | None:
    """(B, L, T) of the ragged graph that runs a speculative step, None when it must run eagerly: a step qualifies
    when every sequence feeds 1..max_tokens tokens and the logits are every row in batch order (verify chunks and
    one-token decode chunks; no prefill chunk, no prompt logprobs). T: the row bucket of the step's rows."""
    S = len(query_lens)
    T = sum(query_lens)
    if S == 0 or min(query_lens) < 1 or max(query_lens) > max_tokens or list(logit_rows) != list(range(T)):
        return None
    B = pick_bucket(S, batch_sizes)
    if B is None:
        return None
    L = length_bucket(max(c + n for c, n in zip(ctx_lens, query_lens)), max_model_len)
    return None if L is None else (B, L, pick_bucket(T, verify_row_sizes(B, max_tokens)))


@dataclass
class GraphStats:
    """captures / replays / eager_steps / shapes: plain decode steps, shapes (B, L); verify_*: speculative steps,
    shapes (B, L, T) (ragged, T rows); draft_*: DSpark draft passes, shapes (B, N); mtp_*: V4 MTP draft passes, shapes (B, Q);
    insert_*: DSpark draft-ring writes (context insertion) of a step's kept positions, shapes (B, Q)."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    capture_s: float = 0.0
    shapes: list[tuple[int, int]] = field(default_factory=list)
    verify_captures: int = 0
    verify_replays: int = 0
    verify_eager_steps: int = 0
    verify_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    verify_padded: int = 0  # steps replayed on a captured larger row bucket while their own was not captured yet
    draft_captures: int = 0
    draft_replays: int = 0
    draft_eager_steps: int = 0
    draft_shapes: list[tuple[int, int]] = field(default_factory=list)
    mtp_captures: int = 0
    mtp_replays: int = 0
    mtp_eager_steps: int = 0
    mtp_shapes: list[tuple[int, int]] = field(default_factory=list)
    insert_captures: int = 0
    insert_replays: int = 0
    insert_eager_steps: int = 0
    insert_shapes: list[tuple[int, int]] = field(default_factory=list)
    # every capture in order: (kind: "decode", "verify", "draft", ..., shape, seconds) (benchmarks read which shapes a
    # run captured and what each cost)
    capture_log: list[tuple[str, tuple[int, ...], float]] = field(default_factory=list)


@dataclass
class _DecodeOutputs:
    """What a decode graph writes: the logits [B, V] float32 and their greedy ids [B] int64 (`Sampler.greedy`)."""

    logits: Tensor
    greedy: Tensor


@dataclass
class _Graph:
    step: StaticDecodeStep
    graph: torch.cuda.CUDAGraph
    logits: Tensor | None  # [rows, V] float32, written by every replay (None: draft-round graphs)
    greedy: Tensor | None = None  # decode graphs: [B] int64 greedy ids of the logits (INVALID_TOKEN: not finite)
    hidden: Tensor | None = None  # verify graphs: the final streams [T, n, d]
    features: dict[int, Tensor] = field(default_factory=dict)  # verify graphs: captured features [T, d]
    capture: tuple[int, ...] | None = None  # verify graphs: the feature layers they capture
    proposal: Any = None  # draft-round graphs: the DraftProposal of all B rows, written by every replay
    sampling: tuple[Tensor, Tensor, Tensor] | None = None  # their static [B] temperatures (device, pinned host), seeds
    copied: torch.cuda.Event | None = None  # recorded after the copy out of the pinned temperatures
    insert: Any = None  # insertion graphs: their dspark.StaticInsert (static step and feature buffers)
    # the captured callable. A graph reads the tensors its forward closed over by address but does not own them:
    # a constant made for the capture and held only by the closure (e.g. the STS divisors of a draft round) would
    # be freed with it, and its memory handed to other tensors while the graph still reads it. Keeping the callable
    # keeps all of them.
    forward: Callable[[], Any] | None = None


class CudaGraphRunner:
    """Captures and replays the decode forward of `model` over `cache` per (batch bucket, length bucket)."""

    def __init__(
        self, model: object, cache: object, *, device: torch.device | str, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.model, self.cache = model, cache
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"cuda graphs need a CUDA device, found {self.device}")
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.graphs: dict[tuple[int, ...], _Graph] = {}  # (B, L): decode graphs; (B, L, T): verify graphs
        self.verify_tokens: int | None = None  # the most rows a verified sequence feeds (k + 1), set by the first step
        # a verify step whose row bucket has no graph yet replays a captured larger bucket of its (B, L) as padding
        # rows, until the bucket has been asked for this many times: a capture stalls the step for about a second
        # (H200), and the cost policy's row counts move with its online curve, so buckets asked for once or twice
        # are not worth one (docs/cuda_graphs.md, "Speculative steps")
        self.verify_capture_after = VERIFY_CAPTURE_AFTER
        self._verify_misses: dict[tuple[int, int, int], int] = {}
        self.stats = GraphStats()
        self._pool = None
        # the draft-round graphs' own pool: their proposal outputs are read by the verify forward replayed after
        # them, so no other graph's intermediates may share their memory (graphs of one pool may overwrite the
        # outputs of graphs captured before them)
        self._draft_pool = None
        # the insertion graphs' own pool (`run_insert`): in a shared pool their intermediates could sit on the
        # outputs of graphs captured after them (a pool hands the blocks one capture freed to the next), and an
        # insertion replayed between such a graph's replay and the read of its outputs would overwrite them.
        # The engine's order (verify outputs are gathered before the insertion) avoids that today; an own pool
        # avoids it whatever the order, for the price of intermediates of [B * Q, d] size not shared
        self._insert_pool = None
        self._pools: list = []  # every pool graphs were captured into (a failed capture starts a new one)
        self._stream: torch.cuda.Stream | None = None
        self.failed: dict[tuple[int, ...], str] = {}  # shapes whose capture raised -> the error; they run eagerly
        self.last_shape: tuple[int, ...] | None = None  # the shape of the latest replay (benchmarks replay it)
        self._greedy: Tensor | None = None  # the greedy ids of the latest decode replay
        # the outputs every decode graph ("decode.*"), every verify graph ("verify.*") and every sampled draft
        # round ("draft.probs") writes: one buffer per output for the largest shape of its kind, outside the pools,
        # each graph writing its leading rows. Only one replay's outputs are read at a time (each is read before
        # the next launch), so per-graph outputs would only multiply the memory: [T, vocab] float32 logits per
        # ragged verify graph, [B, N, vocab] probabilities per draft round (docs/cuda_graphs.md)
        self._outputs: dict[str, Tensor] = {}
        self.sampler = Sampler()  # the greedy argmax captured with each decode graph, as the runner's sampler runs it

    def shape_of(self, batch: object, logit_rows: Sequence[int]) -> tuple[int, int] | None:
        """(B, L) of a graph that can run this step, None when it must run eagerly."""
        if batch.host is None or self.cache.needs_exact_plans(batch.slots, batch.host.ctx_lens):  # prefix replay
            return None
        shape = decode_shape(batch.query_lens, batch.host.ctx_lens, logit_rows, self.batch_sizes,
                             self.max_model_len)  # fmt: skip
        if shape is None or shape in self.failed:
            self.stats.eager_steps += 1
            return None
        return shape

    def run(self, batch: object, shape: tuple[int, int]) -> Tensor | None:
        """[S, V] float32 logits of a decode step (shape from shape_of), valid until the next replay; None when
        the shape cannot be captured (the forward holds something a graph cannot record, e.g. a host read in an
        expert-parallel dispatch): logged once, and that shape runs eagerly from then on."""
        g = self.graphs.get(shape)
        if g is None:
            g = self._try_capture(shape, lambda: self._capture(*shape))
            if g is None:
                return None
        self.model.host_step(batch, self.cache)
        facts = DecodeFacts.of(batch)
        g.step.check_tables(facts)
        g.step.fill(facts)
        # the device ids are authoritative: asynchronous scheduling resolves its placeholder rows there only (the
        # host copy holds 0); the captured Engram hashing reads them from here
        g.step.batch.input_ids[: batch.num_seqs].copy_(batch.input_ids)
        g.graph.replay()
        self.stats.replays += 1
        self.last_shape = shape
        self._greedy = g.greedy
        return g.logits[: batch.num_seqs]

    def greedy_ids(self, num_seqs: int) -> Tensor:
        """[num_seqs] int64 greedy ids (`Sampler.greedy`, INVALID_TOKEN where not finite) of the logits of the
        latest decode replay (`run`), computed inside its graph: a greedy decode step launches nothing for its
        sampling. A view into the graph's memory, valid until the next replay (copy it before that)."""
        return self._greedy[:num_seqs]

    def verify_shape_of(self, batch: object, logit_rows: Sequence[int], max_tokens: int
                        ) -> tuple[int, int, int] | None:  # fmt: skip
        """(B, L, T) of a ragged graph that can run this speculative step (at most `max_tokens` = k + 1 rows per
        sequence, the same for every step of a runner), None when it must run eagerly."""
        if batch.host is None or self.cache.needs_exact_plans(batch.slots, batch.host.ctx_lens):  # prefix replay
            return None
        if self.verify_tokens is None:
            self.verify_tokens = int(max_tokens)
        elif self.verify_tokens != int(max_tokens):
            raise InputError(f"cuda graphs: verify steps of up to {max_tokens} tokens per sequence, expected "
                             f"{self.verify_tokens} (the graphs captured so far hold that many)")  # fmt: skip
        shape = verify_shape(batch.query_lens, batch.host.ctx_lens, logit_rows, self.batch_sizes,
                             self.verify_tokens, self.max_model_len)  # fmt: skip
        if shape is None or shape in self.failed:
            self.stats.verify_eager_steps += 1
            return None
        if shape not in self.graphs:
            wider = self._captured_wider(shape)
            misses = self._verify_misses.get(shape, 0) + 1
            if wider is not None and misses < self.verify_capture_after:
                self._verify_misses[shape] = misses
                self.stats.verify_padded += 1
                return wider
            self._verify_misses.pop(shape, None)
        return shape

    def _captured_wider(self, shape: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """The captured verify graph of shape's (B, L) with the fewest rows above shape's T, or None."""
        B, L, T = shape
        rows = [k[2] for k, g in self.graphs.items()
                if len(k) == 3 and k[0] == B and k[1] == L and k[2] > T and g.capture is not None]  # fmt: skip
        return (B, L, min(rows)) if rows else None

    def run_verify(self, batch: object, shape: tuple[int, int, int], *, capture: tuple[int, ...]
                   ) -> ModelOutput | None:  # fmt: skip
        """The ModelOutput of a speculative step (shape from verify_shape_of) as the eager
        `forward_features(batch, cache, capture=capture)` gives it: logits of every row, the captured features
        and the final streams, rows in batch order (gathered from the graph's padded rows; valid until the next
        replay). None when the shape cannot be captured (then it runs eagerly from then on, as in `run`)."""
        capture = tuple(capture)
        g = self.graphs.get(shape)
        if g is None:
            B, L, T = shape
            g = self._try_capture(shape, lambda: self._capture(B, L, self.verify_tokens, capture=capture, rows=T))
            if g is None:
                return None
        if g.capture != capture:
            raise InputError(f"cuda graphs: verify graph {shape} captures layers {g.capture}, asked for {capture}")
        self.model.host_step(batch, self.cache)
        facts = DecodeFacts.of(batch, g.step.tokens)
        g.step.check_tables(facts)
        g.step.fill(facts)
        n = batch.num_tokens
        # the device ids are authoritative (asynchronous scheduling resolves placeholders there only); a ragged
        # step's real rows are its first n, in batch order: views, no gather
        g.step.batch.input_ids[:n].copy_(batch.input_ids)
        g.graph.replay()
        self.stats.verify_replays += 1
        self.last_shape = shape
        return ModelOutput(logits=g.logits[:n], hidden=g.hidden[:n], pre_last=None,
                           features={lid: f[:n] for lid, f in g.features.items()})

    def _try_capture(self, shape: tuple, make: Callable[[], _Graph]) -> _Graph | None:
        """make() (a capture of `shape`), or None when it raised: logged once, `shape` then runs eagerly."""
        try:
            return make()
        except RuntimeError as exc:  # torch reports capture violations as RuntimeError
            torch.cuda.synchronize(self.device)
            # a capture that died inside cudaStreamEndCapture leaves the allocator recording into the pool
            # from the capture stream ("beginAllocateToPool: already recording" for every later capture, seen
            # on the H200): later captures take a fresh pool and stream; the graphs captured so far keep theirs
            self._pool = self._stream = self._draft_pool = self._insert_pool = None
            self.failed[shape] = f"{type(exc).__name__}: {exc}"
            logger.warning("cuda graphs: capturing %s failed, that shape runs eagerly: %s", shape, exc)
            return None

    def replay_seconds(self, iters: int = 20) -> float | None:
        """Median device seconds of one replay of the latest replayed graph, as it was last filled: the forward-only
        decode step a benchmark sets the engine's step against. Each replay recomputes that step in place (the same
        cache rows written again), so it is for benchmarks whose batch is discarded afterwards; None before any
        replay."""
        if self.last_shape is None:
            return None
        g = self.graphs[self.last_shape]
        torch.cuda.synchronize(self.device)
        g.graph.replay()  # warm: the first replay after host work may see cold caches
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            g.graph.replay()
            events[i + 1].record()
        torch.cuda.synchronize(self.device)
        times = sorted(events[i].elapsed_time(events[i + 1]) * 1e-3 for i in range(iters))
        return times[len(times) // 2]

    def pool_bytes(self) -> int:
        """Device memory reserved by the graphs' pools (allocator segments of those pools), -1 when this
        torch's memory snapshot does not name segment pools. Reads the allocator state: not for a hot path."""
        if not self._pools:
            return 0
        segs = torch.cuda.memory_snapshot()
        if segs and "segment_pool_id" not in segs[0]:
            return -1
        pools = {tuple(p) for p in self._pools}
        return sum(int(s["total_size"]) for s in segs if tuple(s["segment_pool_id"]) in pools)

    def _forward(self, step: StaticDecodeStep, capture: tuple[int, ...] | None,
                 logits_out: Tensor | None = None) -> ModelOutput:  # fmt: skip
        return self.model.forward_features(None, self.cache, capture=capture or (), static=step,
                                           logits_out=logits_out)

    def _output_rows(self, name: str, rows: int, max_rows: int, tail: tuple[int, ...], dtype: torch.dtype
                     ) -> Tensor:  # fmt: skip
        """Rows [:rows] of the shared output buffer `name` ([max_rows, *tail] dtype, allocated on first use, on the
        current stream outside every capture: a graph's warm-up asks first)."""
        buf = self._outputs.get(name)
        if buf is None:
            buf = torch.empty((max_rows, *tail), dtype=dtype, device=self.device)
            self._outputs[name] = buf
        if rows > buf.shape[0] or tuple(buf.shape[1:]) != tuple(tail) or buf.dtype != dtype:
            raise InputError(f"cuda graphs: output {name} of {rows} rows {tuple(tail)} {dtype}, the shared buffer "
                             f"holds {tuple(buf.shape)} {buf.dtype} (the graphs of one runner share it)")
        return buf[:rows]

    def _logits_out(self, kind: str, rows: int, max_rows: int) -> Tensor:
        return self._output_rows(f"{kind}.logits", rows, max_rows, (int(self.model.args.vocab_size),), torch.float32)

    def _copy_out(self, name: str, t: Tensor, max_rows: int) -> Tensor:
        """t copied into the leading rows of the shared output `name` (captured with the graph: t itself is a
        temporary of the pool then, reused by the other graphs)."""
        return self._output_rows(name, t.shape[0], max_rows, tuple(t.shape[1:]), t.dtype).copy_(t)

    def output_bytes(self) -> int:
        """Device memory of the outputs the graphs share (outside their pools)."""
        return sum(t.numel() * t.element_size() for t in self._outputs.values())

    # a graph records no autograd, so neither do its warm-ups: the capture is the same whatever the caller's grad mode
    # (out= ops, such as the shared draft probabilities' writer, refuse inputs that require grad)
    @torch.no_grad()
    def _record(self, forward: Callable[[], Any], prepare: Callable[[], None] | None = None, *,
                pool: str = "shared") -> tuple[Any, Any]:  # fmt: skip
        """(graph, outputs) of `forward` captured into the shared pool after two warm-up runs on the side stream
        (Triton compiles / autotunes there, plans register, lazies initialise); `graph.replay()` rewrites the
        outputs in place. `prepare` runs after the first warm-up (the static step's `freeze`: its plans are
        registered by then, and the second warm-up already runs on the frozen buffers). pool: "shared", "draft"
        (the draft-round graphs' pool) or "insert" (the insertion graphs' pool)."""
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._pools.append(self._pool)
            self._stream = torch.cuda.Stream(self.device)
        if pool == "draft" and self._draft_pool is None:
            self._draft_pool = torch.cuda.graph_pool_handle()
            self._pools.append(self._draft_pool)
        if pool == "insert" and self._insert_pool is None:
            self._insert_pool = torch.cuda.graph_pool_handle()
            self._pools.append(self._insert_pool)
        pool = {"shared": self._pool, "draft": self._draft_pool, "insert": self._insert_pool}[pool]
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for i in range(2):
                forward()
                if i == 0 and prepare is not None:
                    prepare()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self._stream):
            out = forward()
        torch.cuda.synchronize(self.device)
        return graph, out

    def _capture(self, B: int, L: int, Q: int = 1, *, capture: tuple[int, ...] | None = None,
                 rows: int | None = None) -> _Graph:  # fmt: skip
        """Capture the decode graph (B, L) (capture None) or the ragged verify graph (B, L, T = rows) of up to Q
        rows per sequence, whose forward also captures the features of layers `capture` and keeps the final
        streams."""
        t0 = time.perf_counter()
        # all rows padding while warming up and capturing: only the scratch slot / page are written
        step = StaticDecodeStep(self.cache, B, L, self.device, tokens=Q, rows=rows)
        if capture is None:  # the decode graph samples greedily too (its ids are used for plain greedy steps)
            logits_out = self._logits_out("decode", B, self.batch_sizes[-1])

            def decode() -> _DecodeOutputs:
                logits = self._forward(step, None, logits_out).logits
                return _DecodeOutputs(logits=logits, greedy=self.sampler.greedy(logits))

            graph, dec = self._record(decode, step.freeze)
            g = _Graph(step=step, graph=graph, logits=dec.logits, greedy=dec.greedy, forward=decode)
            return self._keep((B, L), g, "", t0)
        most = verify_row_sizes(self.batch_sizes[-1], Q)[-1]  # the largest row bucket
        logits_out = self._logits_out("verify", rows, most)

        def verify() -> ModelOutput:
            out = self._forward(step, capture, logits_out)
            return ModelOutput(logits=out.logits, hidden=self._copy_out("verify.hidden", out.hidden, most),
                               pre_last=None, features={lid: self._copy_out(f"verify.features.{lid}", f, most)
                                                        for lid, f in out.features.items()})

        graph, out = self._record(verify, step.freeze)
        g = _Graph(step=step, graph=graph, logits=out.logits, hidden=out.hidden, features=dict(out.features),
                   capture=tuple(capture), forward=verify)
        return self._keep((B, L, rows), g, "verify", t0)

    def _keep(self, key: tuple, g: _Graph, kind: str, t0: float) -> _Graph:
        """Store a graph captured since `t0` under `key` and count it in the stats of `kind` ("" plain decode,
        "verify", "draft", "mtp"; the shape recorded is the key without its kind tag)."""
        dt = time.perf_counter() - t0
        self.graphs[key] = g
        st = self.stats
        st.capture_s += dt
        prefix = f"{kind}_" if kind else ""
        setattr(st, prefix + "captures", getattr(st, prefix + "captures") + 1)
        shape = tuple(k for k in key if not isinstance(k, str))
        getattr(st, prefix + "shapes").append(shape)
        st.capture_log.append((kind or "decode", shape, dt))
        logger.info("captured the %s graph of shape %s in %.2f s", kind or "decode", shape, dt)
        return g

    # ------------------------------------------------------------------------------------ DSpark draft pass
    def run_draft(self, batch: object) -> Any:
        """The DSpark stages' parallel pass (`dspark.draft_block`) over a round's blocks (every sequence N rows at
        its anchor position, host facts given) as the replay of the graph of B = its batch bucket: a
        `dspark.DraftOutput` whose rows [:S * N] are the real blocks (valid until the next replay), or None
        (no bucket, positions past the model, or a failed capture: the caller runs it eagerly)."""
        N = batch.query_lens[0] if batch.num_seqs else 0
        B = pick_bucket(batch.num_seqs, self.batch_sizes)
        if B is None or batch.host is None or any(n != N for n in batch.query_lens):
            self.stats.draft_eager_steps += 1
            return None
        key = ("draft", B, N)
        facts = DecodeFacts.of(batch, N)
        limit = int(self.model.args.max_position_embeddings)
        if key in self.failed or int(facts.ctx.max()) + N > limit:
            self.stats.draft_eager_steps += 1
            return None
        g = self.graphs.get(key)
        if g is None:
            g = self._try_capture(key, lambda: self._capture_draft(B, N))
            if g is None:
                return None
        from deepinfer_engine.model.dspark import DraftOutput

        g.step.fill(facts)
        T = batch.num_tokens
        g.step.batch.input_ids[:T].copy_(batch.input_ids)  # every sequence has N rows: real rows are [:T]
        g.graph.replay()
        self.stats.draft_replays += 1
        return DraftOutput(base_logits=g.logits[:T], hidden=g.hidden[:T])

    def _capture_draft(self, B: int, N: int) -> _Graph:
        from deepinfer_engine.model import dspark

        t0 = time.perf_counter()
        # the stages read the window rings only (no compressed entries): any length up to the model's positions
        step = StaticDecodeStep(self.cache, B, int(self.model.args.max_position_embeddings), self.device, tokens=N)

        def forward() -> Any:
            return dspark.draft_block(self.model, None, self.cache, static=step)

        graph, out = self._record(forward, step.freeze)
        g = _Graph(step=step, graph=graph, logits=out.base_logits, hidden=out.hidden, forward=forward)
        return self._keep(("draft", B, N), g, "draft", t0)

    def run_draft_proposal(self, batch: object, heads: Any, version: int, temperature: Tensor | None,
                           seeds: Tensor | None) -> Any:  # fmt: skip
        """The DSpark round's parallel pass AND its Markov sampling and confidence (`deepinfer_dspark.sample_core`)
        as one replay: the `DraftProposal` that `sample_block(dspark.draft_block(...))` gives for the round's S
        real blocks (rows of the graph's buffers, valid until its next replay), or None (the caller takes the two
        steps: `run_draft`, then the eager sampling).

        heads: the drafter's `DraftHeads`, baked into the graph (its STS temperatures are constants there), so
        graphs are keyed by the drafter's `version` of them. temperature: host `[S]` float32 (0 = greedy row;
        None = all greedy), checked by the caller; seeds: device `[S]` int64 (with a temperature). A round with
        a sampled row replays the graph of the mixed formulation (greedy rows one-hot), which gives an
        all-sampled round's values bit for bit; an all-greedy round replays the greedy graph (no softmax)."""
        from deepinfer_dspark import DraftProposal

        S = batch.num_seqs
        N = batch.query_lens[0] if S else 0
        B = pick_bucket(S, self.batch_sizes)
        if B is None or batch.host is None or any(n != N for n in batch.query_lens):
            return None  # `run_draft` counts the eager step when the caller falls back
        sampled = temperature is not None and bool((temperature > 0).any())
        key = ("draft", B, N, "sampled" if sampled else "greedy", int(version))
        facts = DecodeFacts.of(batch, N)
        if key in self.failed or int(facts.ctx.max()) + N > int(self.model.args.max_position_embeddings):
            return None
        g = self.graphs.get(key)
        if g is None:
            # graphs of earlier heads are never replayed again: their memory goes back to the draft pool
            for old in [k for k in self.graphs if k[0] == "draft" and len(k) == 5 and k[4] != key[4]]:
                del self.graphs[old]
            g = self._try_capture(key, lambda: self._capture_proposal(B, N, sampled, heads, key))
            if g is None:
                return None
        g.step.fill(facts)
        T = batch.num_tokens
        g.step.batch.input_ids[:T].copy_(batch.input_ids)  # every sequence has N rows: real rows are [:T]
        if sampled:
            temp, temp_host, seed = g.sampling
            if g.copied is not None and not g.copied.query():  # the last round's copy still reads the buffer
                g.copied.synchronize()
            t = temp_host.numpy()
            t[:S], t[S:] = temperature.to(torch.float32).numpy(), 0.0  # padding rows: greedy
            temp.copy_(temp_host, non_blocking=True)
            if self.device.type == "cuda":
                g.copied = g.copied or torch.cuda.Event()
                g.copied.record()
            seed[:S].copy_(seeds)
        g.graph.replay()
        self.stats.draft_replays += 1
        p = g.proposal
        return DraftProposal(draft_ids=p.draft_ids[:S], confidence=None if p.confidence is None else p.confidence[:S],
                             draft_probs=None if p.draft_probs is None else p.draft_probs[:S])

    def _capture_proposal(self, B: int, N: int, sampled: bool, heads: Any, key: tuple) -> _Graph:
        from deepinfer_dspark import DraftBlock, sample_core, sts_divisors

        from deepinfer_engine.model import dspark

        t0 = time.perf_counter()
        step = StaticDecodeStep(self.cache, B, int(self.model.args.max_position_embeddings), self.device, tokens=N)
        dev = self.device
        sampling = None
        if sampled:
            sampling = (torch.zeros(B, dtype=torch.float32, device=dev), torch.zeros(B, dtype=torch.float32,
                        pin_memory=dev.type == "cuda"), torch.zeros(B, dtype=torch.int64, device=dev))  # fmt: skip
        # the STS divisors as constants made outside the capture (a host tensor cannot be copied inside one)
        divisors = {flag: sts_divisors(heads, N, flag, dev) for flag in (False, True)}
        # the draft probabilities of every sampled round's graph in one buffer (one round is read at a time; the
        # verify graphs, replayed before the read, cannot write it: it is outside every pool)
        probs = None if not sampled else self._output_rows(
            "draft.probs", B, self.batch_sizes[-1], (N, int(self.model.args.vocab_size)), torch.float32)

        def forward() -> Any:
            out = dspark.draft_block(self.model, None, self.cache, static=step)
            block = DraftBlock(base_logits=out.base_logits.view(B, N, -1), hidden=out.hidden.view(B, N, -1))
            batch = step.batch  # read here: freeze() replaces the step's tensors after the first warm-up
            anchors, positions = batch.input_ids.view(B, N)[:, 0], batch.positions.view(B, N)[:, 0]
            return sample_core(block, heads, anchors, positions, temp=None if sampling is None else sampling[0],
                               seeds=None if sampling is None else sampling[2], divisors=divisors, probs_out=probs)

        graph, prop = self._record(forward, step.freeze, pool="draft")
        # forward holds the STS divisors: without it their memory went to other tensors after the capture, and
        # the graph's confidences (read by the threshold and cost policies, not by verification) were wrong
        g = _Graph(step=step, graph=graph, logits=None, proposal=prop, sampling=sampling, forward=forward)
        return self._keep(key, g, "draft", t0)

    # ------------------------------------------------------------------------------------ V4 MTP draft pass
    def run_mtp(self, batch: object, hidden: Tensor, max_tokens: int = 2) -> Tensor | None:
        """V4's MTP block (`Transformer.forward_mtp`, block 0) over a step's accepted positions as the replay of
        the graph of (B, Q): every sequence at most Q <= `max_tokens` rows (an accepted draft + the emitted
        token), padded to Q. batch: the MTP batch (next tokens at the next positions, host facts given),
        hidden: [T, n, d] the target's streams of its rows. Returns [len(logits_indices), V] logits (rows of
        batch.logits_indices), or None (a chunk too long, no bucket, a failed capture: the caller runs it
        eagerly)."""
        S = batch.num_seqs
        Q = pick_bucket(max(batch.query_lens, default=0), verify_token_sizes(max_tokens))
        B = pick_bucket(S, self.batch_sizes)
        if not S or Q is None or B is None or batch.host is None:
            self.stats.mtp_eager_steps += 1
            return None
        key = ("mtp", B, Q)
        facts = DecodeFacts.of(batch, Q)
        if key in self.failed or int(facts.ctx.max()) + Q > int(self.model.args.max_position_embeddings):
            self.stats.mtp_eager_steps += 1
            return None
        g = self.graphs.get(key)
        if g is None:
            g = self._try_capture(key, lambda: self._capture_mtp(B, Q, hidden))
            if g is None:
                return None
        g.step.fill(facts)
        rows = g.step.real_rows[: batch.num_tokens]
        g.step.batch.input_ids.index_copy_(0, rows, batch.input_ids)
        g.hidden.index_copy_(0, rows, hidden.to(g.hidden.dtype))
        g.graph.replay()
        self.stats.mtp_replays += 1
        return g.logits.index_select(0, rows.index_select(0, batch.logits_indices))

    def _capture_mtp(self, B: int, Q: int, like: Tensor) -> _Graph:
        t0 = time.perf_counter()
        m = self.model
        # the block reads its own window ring only (no compressed cache): any length up to the model's positions
        step = StaticDecodeStep(self.cache, B, int(m.args.max_position_embeddings), self.device, tokens=Q)
        hin = torch.zeros((B * Q, *like.shape[1:]), dtype=like.dtype, device=self.device)  # static input

        @torch.no_grad()  # as Transformer.forward_mtp: whatever the caller's grad mode
        def forward() -> Tensor:
            ctx = step.context(self.cache, kernel_backend=m.kernel_backend)
            h, _ = m.mtp[0].forward_mtp(hin, m.embed.weight[step.batch.input_ids], ctx)
            return m.head.f32_out(h)

        graph, logits = self._record(forward, step.freeze)
        # hidden: the static INPUT streams here
        g = _Graph(step=step, graph=graph, logits=logits, hidden=hin, forward=forward)
        return self._keep(("mtp", B, Q), g, "mtp", t0)

    # ------------------------------------------------------------------------------------ DSpark context insertion
    def run_insert(self, ctx: Sequence[int], slots: Sequence[int], lens: Sequence[int], first_rows: Sequence[int],
                   features: dict[int, Tensor], tokens: int) -> bool:  # fmt: skip
        """The DSpark draft-ring writes of a step's kept positions (`dspark.insert_context`) as the replay of the
        graph of (B, Q): B = the batch bucket of the S sequences that keep rows, Q = `tokens` (k + 1, the
        longest verify chunk). Sequence i keeps lens[i] >= 1 positions from ctx[i] in cache slot slots[i],
        whose features are rows first_rows[i] .. of `features` ({layer: [T, d]}, the step's captured rows in
        batch order). Returns whether it replayed; False (the caller runs the eager insertion): a sequence keeps
        more than Q rows (a prefill chunk), no bucket holds S, positions past the model, features the buffers do
        not fit, a failed capture, or prefix-cache captures armed (the eager insertion serves and disarms them:
        this check only reads them)."""
        S, Q = len(lens), int(tokens)
        cache, a = self.cache, self.model.args
        B = pick_bucket(S, self.batch_sizes)
        if (not S or B is None or Q < 1 or max(lens) > Q or min(lens) < 1 or cache.draft_captures or cache.captures
                or max(ctx) + Q > int(a.max_position_embeddings)
                or any(lid not in features for lid in a.dspark_target_layer_ids)):  # eager raises the error
            self.stats.insert_eager_steps += 1
            return False
        key = ("insert", B, Q)
        if key in self.failed:
            self.stats.insert_eager_steps += 1
            return False
        g = self.graphs.get(key)
        if g is None:
            g = self._try_capture(key, lambda: self._capture_insert(B, Q, features))
            if g is None:
                self.stats.insert_eager_steps += 1
                return False
        if not g.insert.accepts(features):
            self.stats.insert_eager_steps += 1
            return False
        g.insert.fill(np.asarray(ctx, dtype=np.int64), np.asarray(slots, dtype=np.int64),
                      np.asarray(lens, dtype=np.int64), np.asarray(first_rows, dtype=np.int64), features)
        g.graph.replay()
        self.stats.insert_replays += 1
        return True

    def _capture_insert(self, B: int, Q: int, like: dict[int, Tensor]) -> _Graph:
        from deepinfer_engine.model.dspark import StaticInsert

        t0 = time.perf_counter()
        # made unfilled: every row is padding while warming up and capturing, so only the scratch slot is written
        ins = StaticInsert(self.model, self.cache, B, Q, like)
        graph, m = self._record(ins.forward, ins.step.freeze, pool="insert")
        # nobody reads m; it stays referenced (as `logits`) so that the blocks this graph writes stay its own
        g = _Graph(step=ins.step, graph=graph, logits=m, insert=ins, forward=ins.forward)
        return self._keep(("insert", B, Q), g, "insert", t0)
