"""Fixed-shape multi-token steps (static_step.py, tokens Q > 1: speculative verify steps) give the logits of the
exact forward on every real row (CPU, fp32, no graph).

Two identically filled caches run the same verify-shaped steps: the exact forward over sequences feeding n_i
tokens (the last accepted token + n_i - 1 "drafts", n_i mixed in 1..Q), and the host half + the fixed-shape
forward over a StaticDecodeStep of Q rows per sequence (rows past n_i padded). After each step every sequence
keeps a random prefix of its rows (a rejection rolls the rest back, as speculative decoding does), so the padding
rows' writes past the kept positions must be overwritten exactly like rejected drafts'. A ragged step (`rows=T`)
lays the real rows out back to back and gives the rest to one padding sequence on the scratch slot; it writes
exactly the real rows. Sequences join and leave;
lengths cross the window and compressed-entry boundaries. Tolerance: max|Δ| / max|ref| <= 1e-5 (fp32, different
reduction shapes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.errors import CapacityError, InputError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache, SeqHost, build_paged_plan
from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config
from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep, static_paged_plan
from equality import init_random_, max_rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
PAGE = 16


def _batch(ids: list[list[int]], ctx: list[int], slots: list[int], tables: np.ndarray) -> ForwardBatch:
    lens = [len(x) for x in ids]
    flat = np.asarray([t for x in ids for t in x], dtype=np.int64)
    pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, lens)]).astype(np.int64)
    bt = tables[slots]
    return ForwardBatch(
        input_ids=torch.from_numpy(flat), positions=torch.from_numpy(pos), query_lens=tuple(lens),
        slots=tuple(slots), block_tables=torch.from_numpy(bt), logits_indices=torch.arange(len(flat)),
        host=StepHost(ctx_lens=tuple(ctx), input_ids=flat, block_tables=bt),
    )  # fmt: skip


def _prefill(model: Transformer, cache: ModelCache, ids: torch.Tensor, slot: int, tables: np.ndarray) -> None:
    model(_batch([ids.tolist()], [0], [slot], tables), cache)


def _run(model: Transformer, *, batch_size: int, tokens: int, max_len: int, steps: int = 8,
         rows: int | None = None) -> int:
    a = model.args
    slots, pages_per_slot = 4, -(-max_len // PAGE)
    tables = np.arange(slots * pages_per_slot, dtype=np.int32).reshape(slots, pages_per_slot)
    caches = [ModelCache.allocate(a, num_slots=slots, num_pages=slots * pages_per_slot, page_size=PAGE,
                                  dtype=torch.float32) for _ in range(2)]  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    lens = {0: 19, 1: 6, 2: 11}  # prompt lengths: past the window, across entry boundaries
    for slot, n in lens.items():
        ids = torch.randint(0, a.vocab_size, (n,), generator=gen)
        for c in caches:
            _prefill(model, c, ids, slot, tables)
    nxt = {s: int(torch.randint(0, a.vocab_size, (1,), generator=gen)) for s in lens}
    step = StaticDecodeStep(caches[1], batch_size, max_len, "cpu", tokens=tokens, rows=rows)
    compared = 0
    for k in range(steps):
        if k == 3:
            lens.pop(1)  # a request finishes ...
        if k == 4:  # ... and a new one joins (its prompt first, eagerly)
            ids = torch.randint(0, a.vocab_size, (5,), generator=gen)
            for c in caches:
                _prefill(model, c, ids, 3, tables)
            lens[3], nxt[3] = 5, int(ids[-1])
        order = sorted(lens)[::-1] if k % 2 else sorted(lens)
        # mixed verify lengths: 1 (no draft) .. Q (Q - 1 drafts); the first step has one sequence at each extreme
        qlens = [int(x) for x in rng.integers(1, tokens + 1, len(order))]
        if k == 0:
            qlens[0], qlens[-1] = 1, tokens
        if rows is not None:  # a ragged step holds at most `rows` tokens: trim the longest chunks
            while sum(qlens) > rows:
                qlens[qlens.index(max(qlens))] -= 1
        ids = [[nxt[s]] + [int(x) for x in rng.integers(0, a.vocab_size, n - 1)] for s, n in zip(order, qlens)]
        batch = _batch(ids, [lens[s] for s in order], order, tables)
        ref = model(batch, caches[0])
        facts = DecodeFacts.of(batch, tokens)
        model.host_step(batch, caches[1])
        step.check_tables(facts)
        step.fill(facts)
        out = model.forward_features(None, caches[1], static=step).logits
        got = out.index_select(0, torch.from_numpy(step.rows_of(batch.query_lens)))
        assert max_rel_err(got, ref) <= TOL, (k, order, qlens)
        compared += 1
        row = 0
        for s, n in zip(order, qlens):
            keep = int(rng.integers(1, n + 1))  # accepted drafts + 1: the rest is rolled back
            nxt[s] = int(ref[row + keep - 1].argmax())
            lens[s] += keep
            row += n
    return compared


def test_static_verify_equals_exact_v41(make_tiny_v41_model):
    assert _run(make_tiny_v41_model(0), batch_size=4, tokens=4, max_len=64) == 8


def test_static_verify_equals_exact_v4():
    args = ModelArgs.from_config_dict(tiny_v4_config())
    model = init_random_(Transformer(args, torch.float32), seed=0).eval()
    assert _run(model, batch_size=4, tokens=6, max_len=96) == 8


@pytest.mark.parametrize("rows", [4, 7, 12])
def test_ragged_verify_equals_exact_v41(make_tiny_v41_model, rows):
    """Rows back to back: 4 = one row per sequence slot (no padding row once four sequences run), 7 = some padding
    rows, 12 = B * Q (as many rows as the uniform step)."""
    assert _run(make_tiny_v41_model(0), batch_size=4, tokens=4, max_len=64, rows=rows) == 8


@pytest.mark.parametrize("rows", [5, 13])
def test_ragged_verify_equals_exact_v4(rows):
    args = ModelArgs.from_config_dict(tiny_v4_config())
    model = init_random_(Transformer(args, torch.float32), seed=0).eval()
    assert _run(model, batch_size=4, tokens=6, max_len=96, rows=rows) == 8


def test_static_verify_paged_rows_equal_the_exact_plan():
    """On the entries real queries read and the entries real tokens complete, the fixed-shape paged plan of a
    Q-token step equals the exact one; everything else is the scratch row."""
    rng = np.random.default_rng(1)
    for ratio, Q in ((1, 3), (2, 4), (4, 6), (8, 3)):
        B, S, width, scratch = 4, 3, 3 * PAGE // ratio, 9999
        ctx = np.array([0, 9, 23, 0]) + rng.integers(0, 3, 4)
        n = np.array([1, Q, 2, 0])
        bt = np.array([[3, 7, 1], [5, 2, 6], [4, 8, 0], [-1, -1, -1]])
        real = np.array([True, True, True, False])
        # the padding sequence sits at a position past entries of its own: it must complete none of them
        seqs = SeqHost(ctx=np.where(real, ctx, 37), qlen=np.full(B, Q), start=np.arange(B) * Q,
                       slot=np.array([0, 1, 2, 9]))
        plan = static_paged_plan(ratio, PAGE, torch.from_numpy(bt), torch.from_numpy(seqs.ctx), torch.from_numpy(n),
                                 width, scratch, tokens=Q)
        read, write, new_w, new_seq = (t.numpy() for t in (plan.read_rows, plan.write_rows, plan.new_w, plan.new_seq))
        offs = plan.offsets_t
        K = -(-Q // ratio)
        assert write.shape == (B * K,) and offs.tolist() == [0, width, 2 * width, 3 * width]
        exact = build_paged_plan(ratio, PAGE, bt[:S], SeqHost(ctx=ctx[:S], qlen=n[:S], start=np.cumsum(n[:S]) - n[:S],
                                                             slot=np.arange(S)), device=torch.device("cpu"))
        for i in range(S):
            c = exact.counts[i]
            want = exact.read_rows[exact.offsets[i] : exact.offsets[i] + c].tolist()
            assert read[i * width : i * width + c].tolist() == want
            assert (read[i * width + c : (i + 1) * width] == scratch).all()
            mine = {int(w): int(r) for w, r, s in zip(new_w, write, new_seq) if s == i and r != scratch}
            theirs = {int(w): int(r) for w, r, s in zip(exact.new_w, exact.write_rows, exact.new_seq) if s == i}
            assert mine == theirs, (ratio, Q, i)
        assert (read[S * width :] == scratch).all() and (write[new_seq == S] == scratch).all()


def test_static_verify_window_rows_equal_the_device_computation():
    import dataclasses

    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=3, num_pages=12, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 4, 64, "cpu", tokens=3)
    W = args.sliding_window
    for ctx_lens, qlens in (([0, W - 2, W + 5], [3, 1, 2]), ([3, 40, 1], [2, 3, 3])):
        n = len(ctx_lens)
        step.fill(DecodeFacts(ctx=np.asarray(ctx_lens, np.int64), slots=np.arange(n, dtype=np.int64),
                              input_ids=np.zeros(sum(qlens), np.int64), block_tables=np.arange(n * 4).reshape(n, 4),
                              query_lens=np.asarray(qlens)))  # fmt: skip
        ctx = step.context(cache)
        plan = ctx.ring_plan(cache.window_rows(0), (W - 1,) * 4, write=True, max_back=W - 1)
        got = ctx.window_rows(plan, W, noncausal=False)
        want = dataclasses.replace(ctx, static=None, plans={}).window_rows(plan, W, noncausal=False)
        assert got.shape == (12, W) and torch.equal(got, want)



def test_ragged_step_window_rows_come_from_the_device_computation():
    """A ragged step's forward takes its window rows from ForwardContext's device computation (captured with the
    graph) rather than a host plan that every change of the rows' layout would rebuild; the host builder refuses."""
    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=3, num_pages=12, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 4, 64, "cpu", tokens=3, rows=8)
    W = args.sliding_window
    step.fill(DecodeFacts(ctx=np.asarray([0, W + 5], np.int64), slots=np.arange(2, dtype=np.int64),
                          input_ids=np.zeros(5, np.int64), block_tables=np.arange(8).reshape(2, 4),
                          query_lens=np.asarray([3, 2])))  # fmt: skip
    ctx = step.context(cache)
    plan = ctx.ring_plan(cache.window_rows(0), (W - 1,) * 5, write=True, max_back=W - 1)
    got = ctx.window_rows(plan, W, noncausal=False)
    assert got.shape == (8, W) and not any(k[0] == "win" for k in step._plans)
    rows = plan.pool_rows(step.batch.seq_of_token[:, None].expand(-1, W),
                          step.batch.positions[:, None] - W + 1 + torch.arange(W)[None, :], step.seq_t)
    q = step.batch.positions[:, None] - W + 1 + torch.arange(W)[None, :]
    assert torch.equal(got, torch.where(q >= 0, rows, -1))
    assert int((got[:3] >= 0).sum()) == 1 + 2 + 3  # sequence 0 from position 0: its own fresh rows only
    with pytest.raises(InputError, match="ragged"):
        step.window_rows(plan, W)

def test_static_verify_step_checks_its_facts():
    args = ModelArgs.from_config_dict(tiny_v4_config())
    cache = ModelCache.allocate(args, num_slots=2, num_pages=4, page_size=PAGE, dtype=torch.float32)
    step = StaticDecodeStep(cache, 2, 32, "cpu", tokens=3)
    one = np.zeros(1, np.int64)
    with pytest.raises(CapacityError, match="up to length 32"):  # ctx + Q rows must fit the length bucket
        step.fill(DecodeFacts(ctx=np.array([30]), slots=one, input_ids=one, block_tables=np.zeros((1, 2)),
                              query_lens=np.array([1])))  # fmt: skip
    with pytest.raises(CapacityError, match="3 tokens per sequence"):
        step.fill(DecodeFacts(ctx=one, slots=one, input_ids=np.zeros(4, np.int64), block_tables=np.zeros((1, 2)),
                              query_lens=np.array([4])))  # fmt: skip
    assert step.rows_of((2, 1, 3)).tolist() == [0, 1, 3, 6, 7, 8]
