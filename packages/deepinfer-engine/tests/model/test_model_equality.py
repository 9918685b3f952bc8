"""V4 tiny: full forward == token-by-token decode == random chunked prefill == batched with other sequences
(fp32, max|Δ|/max|ref| <= 1e-5), plus the V4 MTP block and the bf16 mode.

(The V4.1 versions live in test_v41_equality.py on the same harness, equality.)
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config
from equality import (
    init_random_,
    max_rel_err,
    random_chunks,
    run_batched,
    run_chunked,
    run_full,
)

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=[0, 1])
def model(request) -> Transformer:
    args = ModelArgs.from_config_dict(tiny_v4_config())
    return init_random_(Transformer(args, torch.float32), seed=request.param).eval()


def _ids(model: Transformer, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_decode_and_chunks_equal_full(model):
    ids = _ids(model, 37, 1)  # past the window (8), 9 CSA blocks, 4 HCA blocks, ragged end
    full = run_full(model, ids)
    assert torch.isfinite(full).all()
    assert max_rel_err(run_chunked(model, ids, [1] * 37), full) <= TOL
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        chunks = random_chunks(37, gen, max_chunk=14)  # includes chunks longer than the ring (8 + slack 8)
        assert max_rel_err(run_chunked(model, ids, chunks), full) <= TOL, chunks
    assert max_rel_err(run_chunked(model, ids, [20, 17]), full) <= TOL


def test_batched_with_other_sequences(model):
    seqs = [_ids(model, n, 10 + n) for n in (29, 6, 17)]
    fulls = [run_full(model, s) for s in seqs]
    for seed in (0, 1):
        outs = run_batched(model, seqs, seed=seed, max_chunk=9)
        for o, f in zip(outs, fulls):
            assert max_rel_err(o, f) <= TOL


def test_only_selected_logit_rows(model):
    ids = _ids(model, 12, 3)
    cache, bt = ModelCache.allocate_dense(model.args, [12], dtype=torch.float32)
    batch = ForwardBatch.single(ids, block_table=bt[0], all_logits=False)
    last = model(batch, cache)
    assert last.shape == (1, model.args.vocab_size)
    assert max_rel_err(last, run_full(model, ids)[-1:]) <= TOL


def test_rollback_by_position_overwrites(model):
    """A rejected speculative tail is overwritten: decode 4 wrong tokens, then resume at the old position."""
    ids = _ids(model, 30, 4)
    full = run_full(model, ids)
    cache, bt = ModelCache.allocate_dense(model.args, [30], dtype=torch.float32)
    run = lambda s, e: model(ForwardBatch.single(ids[s:e], start_pos=s, block_table=bt[0]), cache)  # noqa: E731
    run(0, 21)
    wrong = _ids(model, 4, 99)
    model(ForwardBatch.single(wrong, start_pos=21, block_table=bt[0]), cache)  # crosses a CSA + HCA boundary
    out = torch.cat([run(21, 23), run(23, 30)])
    assert max_rel_err(out, full[21:]) <= TOL


def test_mtp_block_runs_and_is_causal(model):
    """MTP (docs/model.md §A.9): one pass over all rows == step by step through its own window cache, sharing the backbone's
    ModelCache (the MTP layer has its own ring; its steps do not trip the backbone rollback guard)."""
    args = model.args
    ids = _ids(model, 14, 6)
    cache, bt = ModelCache.allocate_dense(args, [15], dtype=torch.float32)
    out = model.forward_features(ForwardBatch.single(ids, block_table=bt[0]), cache)
    nxt = torch.roll(ids, -1)
    one = model.forward_mtp(ForwardBatch.single(nxt, start_pos=1, block_table=bt[0]), cache, out.hidden)
    c2, bt2 = ModelCache.allocate_dense(args, [15], dtype=torch.float32)
    steps = [
        model.forward_mtp(ForwardBatch.single(nxt[i : i + 1], start_pos=1 + i, block_table=bt2[0]), c2,
                          out.hidden[i : i + 1])
        for i in range(14)
    ]  # fmt: skip
    assert one.shape == (14, args.vocab_size) and torch.isfinite(one).all()
    assert max_rel_err(torch.cat(steps), one) <= TOL


def test_bf16_mode_close_to_fp32(model):
    args = model.args
    m16 = Transformer(args, torch.bfloat16)
    m16.load_state_dict({k: v for k, v in model.state_dict().items()}, strict=True)
    # fp32 where the spec says: mHC, sinks, ape, gate bias, compressor projections
    assert m16.layers[1].hc_attn_fn.dtype == torch.float32
    assert m16.layers[1].attn.compressor.wkv.weight.dtype == torch.float32
    assert m16.layers[1].attn.wq_a.weight.dtype == torch.bfloat16
    ids = _ids(model, 20, 7)
    cache, bt = ModelCache.allocate_dense(args, [20], dtype=torch.bfloat16)
    lo = m16(ForwardBatch.single(ids, block_table=bt[0]), cache)
    assert lo.dtype == torch.float32 and torch.isfinite(lo).all()
    ref = run_full(model, ids)
    cos = torch.nn.functional.cosine_similarity(lo, ref, dim=-1)
    # bf16 rounding can flip a discrete choice (top-k entry / expert) for a token: bound the median tightly
    assert float(cos.median()) > 0.999 and float(cos.min()) > 0.9


def test_rollback_beyond_slack_is_a_capacity_error(model):
    from deepinfer_engine.errors import CapacityError

    ids = _ids(model, 30, 8)
    cache, bt = ModelCache.allocate_dense(model.args, [30], dtype=torch.float32, slack=2)
    model(ForwardBatch.single(ids[:20], block_table=bt[0]), cache)
    model(ForwardBatch.single(ids[17:18], start_pos=17, block_table=bt[0]), cache)  # 3 = slack + 1: fine
    model(ForwardBatch.single(ids[18:22], start_pos=18, block_table=bt[0]), cache)
    with pytest.raises(CapacityError, match="rollback of 4 tokens"):
        model(ForwardBatch.single(ids[18:19], start_pos=18, block_table=bt[0]), cache)
    model(ForwardBatch.single(ids[:3], block_table=bt[0]), cache)  # a new sequence in the slot is always fine
