"""Fixed-shape decode steps (static_step.py) give the logits of the exact forward (CPU, fp32, no graph).

The same decode steps run twice on two identically filled caches: the exact forward, and the host half
(`Transformer.host_step`) + the fixed-shape forward over a padded StaticDecodeStep (V4.1: its Engram row ids
computed inside the step from the static ids and the device token ring). Sequences of mixed lengths
(past the window, across compressed-entry boundaries) join and leave between steps; the padded rows write only
the scratch slot / page. Tolerance: max|Δ| / max|ref| <= 1e-5 (different reduction shapes, fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.errors import CapacityError, InputError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config
from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep, static_paged_plan
from equality import init_random_, max_rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
PAGE = 16


def _batch(ids: list[int], ctx: list[int], slots: list[int], tables: np.ndarray) -> ForwardBatch:
    n = len(ids)
    bt = tables[slots]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(ctx, dtype=torch.int64),
        query_lens=(1,) * n, slots=tuple(slots), block_tables=torch.from_numpy(bt),
        logits_indices=torch.arange(n, dtype=torch.int64),
        host=StepHost(ctx_lens=tuple(ctx), input_ids=np.asarray(ids, dtype=np.int64), block_tables=bt),
    )  # fmt: skip


def _prefill(model: Transformer, cache: ModelCache, ids: torch.Tensor, slot: int, tables: np.ndarray) -> None:
    bt = tables[[slot]]
    n = int(ids.numel())
    model(ForwardBatch(
        input_ids=ids, positions=torch.arange(n), query_lens=(n,), slots=(slot,),
        block_tables=torch.from_numpy(bt), logits_indices=torch.tensor([n - 1]),
        host=StepHost(ctx_lens=(0,), input_ids=ids.numpy(), block_tables=bt),
    ), cache)  # fmt: skip


def _run(model: Transformer, *, batch_size: int, max_len: int, freeze: bool = False) -> int:
    """Exact vs fixed-shape decode over a schedule with joins and leaves; returns the steps compared."""
    a = model.args
    slots, pages_per_slot = 4, -(-max_len // PAGE)
    tables = np.arange(slots * pages_per_slot, dtype=np.int32).reshape(slots, pages_per_slot)
    caches = [ModelCache.allocate(a, num_slots=slots, num_pages=slots * pages_per_slot, page_size=PAGE,
                                  dtype=torch.float32) for _ in range(2)]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    lens = {0: 21, 1: 6, 2: 13}  # prompt lengths: past the window, across entry boundaries
    for slot, n in lens.items():
        ids = torch.randint(0, a.vocab_size, (n,), generator=gen)
        for c in caches:
            _prefill(model, c, ids, slot, tables)
    nxt = {s: int(torch.randint(0, a.vocab_size, (1,), generator=gen)) for s in lens}
    step = StaticDecodeStep(caches[1], batch_size, max_len, "cpu")
    compared = 0
    for k in range(12):
        if k == 4:
            lens.pop(1)  # a request finishes ...
        if k == 6:
            lens[3] = 0  # ... and a new one joins (its prompt first, eagerly)
            ids = torch.randint(0, a.vocab_size, (5,), generator=gen)
            for c in caches:
                _prefill(model, c, ids, 3, tables)
            lens[3], nxt[3] = 5, int(ids[-1])
        order = sorted(lens)[::-1] if k % 2 else sorted(lens)
        batch = _batch([nxt[s] for s in order], [lens[s] for s in order], order, tables)
        ref = model(batch, caches[0])
        model.host_step(batch, caches[1])
        step.fill(DecodeFacts.of(batch))
        out = model.forward_features(None, caches[1], static=step).logits[: len(order)]
        if freeze and k == 0:  # plans registered: one arena from the next fill on (as before a capture)
            step.freeze()
        assert max_rel_err(out, ref) <= TOL, (k, order)
        if caches[0].token_ring is not None:  # Engram: the fixed-shape step kept the same n-gram history
            assert torch.equal(caches[1].token_ring[:slots], caches[0].token_ring[:slots]), k
        compared += 1
        for i, s in enumerate(order):
            nxt[s] = int(ref[i].argmax())
            lens[s] += 1
    return compared


@pytest.mark.parametrize("freeze", [False, True])
def test_static_decode_equals_exact_v41(make_tiny_v41_model, freeze: bool):
    assert _run(make_tiny_v41_model(0), batch_size=4, max_len=64, freeze=freeze) == 12


def test_static_decode_equals_exact_v4():
    args = ModelArgs.from_config_dict(tiny_v4_config())
    model = init_random_(Transformer(args, torch.float32), seed=0).eval()
    assert _run(model, batch_size=4, max_len=64) == 12


def test_static_ring_plans_are_disjoint_when_history_and_tokens_fit():
    # the fixed-shape plans read max_back rows and write `tokens` per sequence: one ring_pool launch when they fit
    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=2, num_pages=8, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 2, 64, "cpu")
    assert step.ring_plan(8, 7, write=True).disjoint and not step.ring_plan(8, 8, write=True).disjoint
    verify = StaticDecodeStep(cache, 2, 64, "cpu", tokens=3)
    assert verify.ring_plan(8, 5, write=True).disjoint and not verify.ring_plan(8, 6, write=True).disjoint


@pytest.mark.parametrize("write_padding", [True, False])
def test_static_ring_writes_of_padding_rows(write_padding: bool):
    """A verify-shaped step writes the ring rows of all Q rows of each real sequence into its slot; with
    write_padding=False (the DSpark context insertion) the rows past each sequence's real tokens go to the scratch
    slot, as the padding sequences' rows always do. Ring of 8 rows, Q = 3, sequences at ctx 5 (2 real tokens) and
    ctx 9 (3), one padding sequence."""
    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=4, num_pages=8, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 3, 64, "cpu", tokens=3, write_padding=write_padding)
    plan = step.ring_plan(8, 0, write=True)
    step.fill(DecodeFacts(ctx=np.array([5, 9]), slots=np.array([2, 0]), input_ids=np.arange(5),
                          block_tables=np.full((2, 1), -1), query_lens=np.array([2, 3])))
    s = cache.scratch_slot
    own = [2 * 8 + 5, 2 * 8 + 6, (2 if write_padding else s) * 8 + 7, 0 * 8 + 1, 0 * 8 + 2, 0 * 8 + 3]
    assert plan.write_dst.tolist() == own + [s * 8 + 0, s * 8 + 1, s * 8 + 2]
    assert plan.write_src.tolist() == list(range(9))


def test_static_paged_rows_scratch_and_completion():
    # ratio 2, page 8 (4 entries / page), 6 entry slots per sequence (2 pages); scratch row 99.
    # seq 0 at ctx 9: completes entry 4 (page 7, row 0 = store row 28), 5 entries; seq 1 at ctx 2: entry 1 in
    # progress (scratch), 1 entry; row 2 is padding
    bt = torch.tensor([[3, 7], [5, -1], [-1, -1]])
    plan = static_paged_plan(2, 8, bt, torch.tensor([9, 2, 0]), torch.tensor([1, 1, 0]), 6, 99)
    assert plan.read_rows.view(3, 6).tolist() == [[12, 13, 14, 15, 28, 99], [20, 99, 99, 99, 99, 99], [99] * 6]
    assert plan.write_rows.tolist() == [28, 99, 99] and plan.new_w.tolist() == [4, 1, 0]
    assert plan.new_seq.tolist() == [0, 1, 2] and plan.offsets_t.tolist() == [0, 6, 12] and plan.num_new == 3
    with pytest.raises(InputError, match="block tables"):
        static_paged_plan(2, 8, bt[:, :1], torch.tensor([9, 2, 0]), torch.tensor([1, 1, 0]), 6, 99)


# ops that launch no device kernel: the CPU scalars of `where`, host-side copies of Python values
_NO_KERNEL = {"scalar_tensor", "_to_copy", "lift_fresh"}


def test_static_paged_plan_replays_only_ops_on_the_step_buffers():
    """The shape-only tensors of a step's paged plans are made with the step, before any capture: the plan's ops
    are what a captured decode graph replays every step (made inside, they were 30 kernels per ratio, and a B = 1
    decode step of V4.1 at real width took 80 us longer than with host-built plans). Views and the CPU scalars of
    `where` launch nothing on a device and are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (func._schema.name.split("::")[1] in _NO_KERNEL or func.is_view):
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=4, num_pages=8, page_size=PAGE, dtype=torch.float32)
    for tokens, most in ((1, 16), (4, 19)):
        step = StaticDecodeStep(cache, 3, 64, "cpu", tokens=tokens)
        for ratio in sorted(set(cache.ratios.values())):
            with Kernels() as k:
                step.paged_plan(ratio)
            assert 0 < len(k.ops) <= most, (tokens, ratio, k.ops)
            assert "aten::arange" not in k.ops


def test_static_step_refuses_too_long_or_too_many():
    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=2, num_pages=4, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 1, 32, "cpu")
    one = np.zeros(1, np.int64)
    with pytest.raises(CapacityError, match="up to length 32"):
        step.fill(DecodeFacts(ctx=np.array([32]), slots=one, input_ids=one, block_tables=np.zeros((1, 2))))
    with pytest.raises(CapacityError, match="of 1 rows"):
        step.fill(DecodeFacts(ctx=np.zeros(2, np.int64), slots=np.arange(2), input_ids=np.zeros(2, np.int64),
                              block_tables=np.zeros((2, 2))))  # fmt: skip


def test_static_window_rows_equal_the_device_computation():
    """The host-built window rows of a fixed-shape step equal ForwardContext.window_rows' device computation over
    the same static ring plan (sequences before, across and past the window; padding rows)."""
    import dataclasses

    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=3, num_pages=12, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 4, 64, "cpu")
    W = args.sliding_window
    for ctx_lens in ([0, W - 1, W + 5], [3, 40, 1]):
        n = len(ctx_lens)
        step.fill(DecodeFacts(ctx=np.asarray(ctx_lens, np.int64), slots=np.arange(n, dtype=np.int64),
                              input_ids=np.zeros(n, np.int64), block_tables=np.arange(n * 4).reshape(n, 4)))
        ctx = step.context(cache)
        plan = ctx.ring_plan(cache.window_rows(0), (W - 1,) * 4, write=True, max_back=W - 1)
        got = ctx.window_rows(plan, W, noncausal=False)
        want = dataclasses.replace(ctx, static=None, plans={}).window_rows(plan, W, noncausal=False)
        assert got.shape == (4, W) and torch.equal(got, want)


@pytest.mark.parametrize(("tokens", "freeze"), [(1, False), (3, False), (1, True), (3, True)])
def test_static_plans_equal_fresh_builds_every_step(make_tiny_v41_model, tokens: int, freeze: bool):
    """After every fill each plan's buffer holds what the exact builders give for that step: ring plans
    (built from ctx / slot only) equal ring_plan_arrays(clip=False); window plans, which skip the rebuild and
    the copy while their memo is unchanged, equal a fresh build; the paged plans the forward computes from the
    step's buffers equal the exact plans on every real entry (positions advancing one by one across entry, page
    and window boundaries; sequences joining and leaving; growing block tables). Frozen (one arena): the same,
    and the plan objects and batch view the arena."""
    from deepinfer_engine.model.cache import SeqHost, build_paged_plan, ring_plan_arrays

    model = make_tiny_v41_model(0)
    cache = ModelCache.allocate(model.args, num_slots=4, num_pages=64, page_size=4, dtype=torch.float32)
    step = StaticDecodeStep(cache, 4, 128, "cpu", tokens=tokens)
    model.forward_features(None, cache, static=step)  # registers every plan the forward asks for
    kinds = {k[0] for k in step._plans}
    assert {"ring", "win"} <= kinds, kinds
    ratios = sorted(set(cache.ratios.values()))
    if freeze:
        step.freeze()
        arena = step._seq.dev.untyped_storage().data_ptr()
        assert all(p.buf.dev.untyped_storage().data_ptr() == arena for p in step._plans.values())
        assert step.batch.input_ids.untyped_storage().data_ptr() == arena
        with pytest.raises(InputError, match="after freeze"):
            step.ring_plan(3, 2, write=False)  # a plan the warm-up did not register
    skipped = 0
    for k in range(40):
        live = [s for s in range(3) if not (s == 1 and 10 <= k < 20)]
        ctx = np.array([5 * s + k for s in live], dtype=np.int64)
        lens = np.array([1 + (s + k) % tokens for s in live], dtype=np.int64)
        tables = np.stack([np.arange(16, dtype=np.int64) + 16 * s for s in live])[:, : 2 + (k + 12) // 4]
        before = {key: p.last for key, p in step._plans.items()}
        step.fill(DecodeFacts(ctx=ctx, slots=np.asarray(live, dtype=np.int64), input_ids=np.zeros(int(lens.sum()),
                              np.int64), block_tables=tables, query_lens=None if tokens == 1 else lens))
        for key, plan in step._plans.items():
            got = plan.buf.dev.numpy()
            if key[0] == "ring":
                _, R, back, write = key
                want = ring_plan_arrays(R, (back,) * 4, step.seq_host, write=write, clip=False)
            else:
                want = plan.build()
                skipped += plan.last == before[key]
            assert np.array_equal(got, np.concatenate(want)), (k, key)
        seqs = SeqHost(ctx=ctx, qlen=lens, start=np.cumsum(lens) - lens, slot=np.asarray(live, dtype=np.int64))
        for r in ratios:
            _assert_paged_equal(step.context(cache).paged_plan(r),
                                build_paged_plan(r, cache.page_size, tables, seqs, device=torch.device("cpu")),
                                step.entries_width(r), cache.scratch_page * (cache.page_size // r))
    assert skipped > 0  # some steps really kept a plan


def _assert_paged_equal(static, exact, width: int, scratch: int) -> None:
    """A fixed-shape paged plan against the exact one: the same page rows on every entry a real sequence reads
    and every entry its real tokens complete, the scratch row everywhere else."""
    S = len(exact.counts)
    read = static.read_rows.tolist()
    for i in range(S):
        c = exact.counts[i]
        assert read[i * width : i * width + c] == exact.read_rows[exact.offsets[i] : exact.offsets[i] + c].tolist()
        assert set(read[i * width + c : (i + 1) * width]) <= {scratch}
        mine = {int(w): int(r) for w, r, s in zip(static.new_w, static.write_rows, static.new_seq)
                if s == i and r != scratch}
        theirs = {int(w): int(r) for w, r, s in zip(exact.new_w, exact.write_rows, exact.new_seq) if s == i}
        assert mine == theirs, i
    assert set(read[S * width :]) <= {scratch}
    assert set(static.write_rows[static.new_seq >= S].tolist()) <= {scratch}


@pytest.mark.parametrize("tokens", [1, 3])
def test_static_visible_counts_equal_the_device_computation(tokens):
    """The host-built visible entry counts of a fixed-shape step equal ForwardContext.visible_counts' device
    computation: sequences at even and odd positions, verify steps of 3 tokens, padding sequences."""
    import dataclasses

    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=3, num_pages=12, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 4, 64, "cpu", tokens=tokens)
    for ctx_lens in ([0, 7, 20], [3, 40, 1]):
        n = len(ctx_lens)
        step.fill(DecodeFacts(ctx=np.asarray(ctx_lens, np.int64), slots=np.arange(n, dtype=np.int64),
                              input_ids=np.zeros(n * tokens, np.int64), block_tables=np.arange(n * 4).reshape(n, 4),
                              query_lens=None if tokens == 1 else np.full(n, tokens)))  # fmt: skip
        ctx = step.context(cache)
        exact = dataclasses.replace(ctx, static=None, plans={})  # the device computation
        assert ctx.visible_counts(2).shape == (4 * tokens,)
        assert torch.equal(ctx.visible_counts(2), exact.visible_counts(2))
