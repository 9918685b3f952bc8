"""DSpark draft stages (§B, docs/model.md §C.7): non-causal block mask, context window, Markov/confidence heads."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.dspark import (
    ConfidenceHead,
    DraftOutput,
    DSparkStage,
    MarkovHead,
    draft_block,
    draft_block_ids,
    greedy_draft,
    insert_context,
    markov_logits,
    target_features,
)
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from equality import init_random_


@pytest.fixture(scope="module")
def model(make_tiny_v41_model) -> Transformer:
    return make_tiny_v41_model(seed=4)


def test_stage_names_follow_the_checkpoint(model: Transformer) -> None:
    names = {n for n, _ in model.named_parameters()}
    a = model.args
    assert "mtp.0.main_proj.weight" in names and "mtp.0.main_norm.weight" in names
    assert "mtp.2.norm.weight" in names
    assert "mtp.2.markov_head.embed.weight" in names and "mtp.2.markov_head.head.weight" in names
    assert "mtp.2.confidence_head.proj.weight" in names
    assert "mtp.1.attn.wkv.weight" in names and "mtp.1.hc_attn_fn" in names
    assert not any(n.startswith("mtp.") and "hc_head" in n for n in names)  # V4.1 has no hc_head
    p = dict(model.named_parameters())
    d = a.hidden_size
    assert p["mtp.0.main_proj.weight"].shape == (d, 3 * d)
    assert p["mtp.2.markov_head.embed.weight"].shape == (a.vocab_size, a.dspark_markov_rank)
    assert p["mtp.2.confidence_head.proj.weight"].shape == (1, d + a.dspark_markov_rank)
    assert p["mtp.2.confidence_head.proj.weight"].dtype == torch.float32
    assert isinstance(model.mtp[0], DSparkStage)


def _prefill_and_context(model: Transformer, ids: torch.Tensor):
    """Target prefill of `ids` (positions 0..p-1) capturing the target features, then the drafter context."""
    a = model.args
    p = ids.numel()
    cache, bt = ModelCache.allocate_dense(a, [p + a.dspark_block_size + 8], dtype=torch.float32)
    batch = ForwardBatch.single(ids, block_table=bt[0])
    with torch.no_grad():
        out = model.forward_features(batch, cache, capture=tuple(a.dspark_target_layer_ids))
        feats = target_features(out.features, tuple(a.dspark_target_layer_ids))
        insert_context(model, batch, cache, feats)
    return cache, bt


def _draft(model: Transformer, cache, bt, anchor: int, p: int, block: torch.Tensor | None = None):
    a = model.args
    ids = (
        block
        if block is not None
        else draft_block_ids(torch.tensor([anchor]), a.dspark_block_size, a.dspark_noise_token_id)
    )
    with torch.no_grad():
        return draft_block(model, ForwardBatch.single(ids, start_pos=p, block_table=bt[0]), cache)


def test_block_is_noncausal_and_context_window_bounded(model: Transformer) -> None:
    a = model.args
    W, N = a.sliding_window, a.dspark_block_size
    g = torch.Generator().manual_seed(0)
    p = 12  # context window of the block = positions [p - W, p) = [4, 12)
    ids = torch.randint(3, 500, (p,), generator=g)
    cache, bt = _prefill_and_context(model, ids)
    rings = {lid: cache.swa[lid].clone() for lid in a.draft_layer_ids}
    base = _draft(model, cache, bt, 42, p)
    assert base.base_logits.shape == (N, a.vocab_size) and base.hidden.shape == (N, a.hidden_size)
    # the draft pass writes nothing into the stage rings
    for lid in a.draft_layer_ids:
        assert torch.equal(cache.swa[lid], rings[lid])
    # non-causal: changing the LAST block token changes the FIRST position's logits
    blk = draft_block_ids(torch.tensor([42]), N, a.dspark_noise_token_id)
    blk[-1] = 77
    changed = _draft(model, cache, bt, 42, p, blk)
    assert float((changed.base_logits[0] - base.base_logits[0]).abs().max()) > 1e-4
    # context window: ring rows of position p-W-1 (outside) do not matter, position p-W (inside) does
    ring_rows = cache.swa[a.draft_layer_ids[0]].shape[1]
    for pos, matters in ((p - W - 1, False), (p - W, True)):
        for lid in a.draft_layer_ids:
            cache.swa[lid][0, pos % ring_rows] += 3.0
        got = _draft(model, cache, bt, 42, p)
        for lid in a.draft_layer_ids:
            cache.swa[lid].copy_(rings[lid])
        delta = float((got.base_logits - base.base_logits).abs().max())
        assert (delta > 1e-4) == matters, (pos, delta)


def test_context_comes_from_target_features(model: Transformer) -> None:
    """The drafter's context KV is the projection of the target features: a different prefix (hence different
    features) at the same positions changes the draft, the same prefix reproduces it exactly."""
    a = model.args
    g = torch.Generator().manual_seed(1)
    p = 10
    ids = torch.randint(3, 500, (p,), generator=g)
    c1, b1 = _prefill_and_context(model, ids)
    c2, b2 = _prefill_and_context(model, ids.clone())
    other = ids.clone()
    other[-1] = (other[-1] + 1) % 500
    c3, b3 = _prefill_and_context(model, other)
    d1 = _draft(model, c1, b1, 9, p)
    d2 = _draft(model, c2, b2, 9, p)
    d3 = _draft(model, c3, b3, 9, p)
    assert torch.equal(d1.base_logits, d2.base_logits)
    assert float((d1.base_logits - d3.base_logits).abs().max()) > 1e-4
    toks, logits, conf = greedy_draft(model, d1, torch.tensor([9]))
    assert toks.shape == (1, a.dspark_block_size) and logits.shape == (1, a.dspark_block_size, a.vocab_size)
    assert bool(((conf > 0) & (conf < 1)).all())


def test_markov_head_sequential_greedy_hand_case() -> None:
    # V = 3, rank 1: W1 (embed) = [[1], [0], [2]], W2 (head) = [[1], [-1], [0]] -> bias(prev) = W1[prev] * W2
    mk = MarkovHead(vocab=3, rank=1, arch="v41", dtype=torch.float32)
    ch = ConfidenceHead(dim=2, rank=1, dtype=torch.float32)
    with torch.no_grad():
        mk.embed.weight.copy_(torch.tensor([[1.0], [0.0], [2.0]]))
        mk.head.weight.copy_(torch.tensor([[1.0], [-1.0], [0.0]]))
        ch.proj.weight.copy_(torch.tensor([[1.0, 0.0, 2.0]]))
    u = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.5, 0.0], [0.0, 0.0, 0.5]])
    h = torch.tensor([[0.5, 7.0], [0.0, 1.0], [-1.0, 0.0]])
    # step 0, prev = y_p = 2: bias [2,-2,0] -> [2,-2,0] -> token 0
    # step 1, prev = 0: bias [1,-1,0] -> [1,1.5,0] -> token 1   (prev kept at y_p would give token 0)
    # step 2, prev = 1: bias [0,0,0] -> [0,0,0.5] -> token 2    (prev = 0 would give token 0)
    # confidences: sigmoid(h0 + 2 e) with e = embed of the token BEFORE d_i = (2, 1, 0)
    fake = SimpleNamespace(
        mtp=[SimpleNamespace(markov_head=mk, confidence_head=ch)], args=SimpleNamespace(has_dspark=True)
    )
    with torch.no_grad():
        toks, logits, conf = greedy_draft(fake, DraftOutput(base_logits=u, hidden=h), torch.tensor([2]))
    assert toks.tolist() == [[0, 1, 2]]
    assert logits[0].tolist() == [[2.0, -2.0, 0.0], [1.0, 1.5, 0.0], [0.0, 0.0, 0.5]]
    want = [1 / (1 + math.exp(-v)) for v in (0.5 + 4.0, 0.0 + 2.0, -1.0 + 0.0)]
    torch.testing.assert_close(conf[0], torch.tensor(want), rtol=0, atol=1e-6)
    # the batched form for given drafts reproduces the sequential logits and embeds
    with torch.no_grad():
        bl, be = markov_logits(mk, u[None], torch.tensor([2]), toks)
    assert torch.equal(bl, logits) and be[0, :, 0].tolist() == [2.0, 1.0, 0.0]


def test_v4_0731_stage_names_and_draft_runs() -> None:
    """V4-0731 flavour: learned mtp.2.hc_head, markov_w1/markov_w2, features = layer OUTPUTS."""
    from deepinfer_engine.model.presets import tiny_v4_dspark_config

    a = ModelArgs.from_config_dict(tiny_v4_dspark_config())
    m = Transformer(a, torch.float32)
    init_random_(m, seed=2)
    names = {n for n, _ in m.named_parameters()}
    for n in ("mtp.2.hc_head_fn", "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight"):
        assert n in names
    assert "mtp.2.markov_head.embed.weight" not in names
    ids = torch.randint(3, 400, (9,), generator=torch.Generator().manual_seed(0))
    cache, bt = _prefill_and_context(m, ids)
    d = _draft(m, cache, bt, 5, 9)
    assert d.base_logits.shape == (a.dspark_block_size, a.vocab_size)
    assert bool(torch.isfinite(d.base_logits).all())


def test_confidence_head_rounds_its_weight_to_bf16() -> None:
    # DeepSeek's code uses the bf16-rounded weight: 1 + 2^-10 (not a bf16 value) acts as 1.0
    ch = ConfidenceHead(dim=2, rank=1, dtype=torch.float32)
    with torch.no_grad():
        ch.proj.weight.copy_(torch.tensor([[1.0 + 2.0**-10, -2.0, 0.5]]))
    h, e = torch.tensor([[3.0, 1.0]]), torch.tensor([[2.0]])
    got = ch(h, e)
    assert got.item() == torch.sigmoid(torch.tensor(3.0 - 2.0 + 1.0)).item()
