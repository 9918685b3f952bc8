"""Sequential Markov sampling and confidence (`propose.sample_block`): greedy hand case, the formula of every
position against a direct computation, temperature sampling distribution (chi-square), reproducibility."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import (
    DraftBlock,
    DraftHeads,
    DSparkInputError,
    block_confidence,
    confidence,
    counter_uniforms,
    sample_block,
)
from deepinfer_dspark.rng import DRAW_DRAFT

# chi-square critical values at significance 1e-3 by degrees of freedom (standard table).
CHI2_CRIT_1E3 = {2: 13.816, 4: 18.467}


def _hand_heads() -> DraftHeads:
    # V = 3, rank 1: W1 = [[1], [0], [2]], W2 = [[1], [-1], [0]] -> bias(prev) = W1[prev] * W2
    return DraftHeads(markov_embed=torch.tensor([[1.0], [0.0], [2.0]]), markov_head=torch.tensor([[1.0], [-1.0], [0.0]]),
                      confidence=torch.tensor([[1.0, 0.0, 2.0]]))


def test_greedy_markov_hand_case():
    u = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 2.5, 0.0], [0.0, 0.0, 0.5]]])
    h = torch.tensor([[[0.5, 7.0], [0.0, 1.0], [-1.0, 0.0]]])
    # step 0, prev = y_p = 2: bias [2,-2,0] -> token 0
    # step 1, prev = 0: bias [1,-1,0] -> [1,1.5,0] -> token 1   (prev kept at y_p would give token 0)
    # step 2, prev = 1: bias [0,0,0] -> [0,0,0.5] -> token 2    (prev = 0 would give token 0)
    prop = sample_block(DraftBlock(base_logits=u, hidden=h), _hand_heads(), torch.tensor([2]), torch.tensor([7]),
                        keep_logits=True)
    assert prop.draft_ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(prop.draft_logits[0], torch.tensor([[2.0, -2.0, 0.0], [1.0, 1.5, 0.0], [0.0, 0.0, 0.5]]))
    # confidence c_i = sigmoid(w . [h_i ; W1[prev_i]]), w = [1, 0, 2]: prev = 2, 0, 1 -> e = 2, 1, 0
    want = torch.sigmoid(torch.tensor([0.5 + 4.0, 0.0 + 2.0, -1.0 + 0.0]))
    assert torch.allclose(prop.confidence[0], want)
    # per-position STS temperatures divide the confidence logit
    heads = DraftHeads(markov_embed=_hand_heads().markov_embed, markov_head=_hand_heads().markov_head,
                       confidence=_hand_heads().confidence, sts=(1.0, 2.0, 4.0))
    prop2 = sample_block(DraftBlock(base_logits=u, hidden=h), heads, torch.tensor([2]), torch.tensor([7]))
    assert torch.allclose(prop2.confidence[0], torch.sigmoid(torch.tensor([4.5, 1.0, -0.25])))


def _random_case(batch: int, width: int = 4, vocab: int = 5, rank: int = 2, dim: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    block = DraftBlock(base_logits=torch.randn(batch, width, vocab, generator=g),
                       hidden=torch.randn(batch, width, dim, generator=g))
    heads = DraftHeads(markov_embed=torch.randn(vocab, rank, generator=g),
                       markov_head=torch.randn(vocab, rank, generator=g),
                       confidence=torch.randn(1, dim + rank, generator=g))
    return block, heads


def test_sampled_block_matches_direct_formula():
    block, heads = _random_case(6)
    anchors = torch.tensor([0, 1, 2, 3, 4, 0])
    pos = torch.tensor([3, 9, 0, 100, 5, 3])
    seeds = torch.arange(6, dtype=torch.int64) * 7919
    temp = torch.tensor([0.7, 1.0, 0.0, 2.0, 1.3, 0.7])
    prop = sample_block(block, heads, anchors, pos, temperature=temp, seeds=seeds)
    for b in range(6):
        prev = int(anchors[b])
        for i in range(block.base_logits.shape[1]):
            e = heads.markov_embed[prev]
            logits = block.base_logits[b, i] + heads.markov_head @ e
            if temp[b] > 0:
                p = torch.softmax(logits / temp[b], -1)
                u = counter_uniforms(seeds[b : b + 1], pos[b : b + 1] + 1 + i, DRAW_DRAFT)
                tok = int(torch.searchsorted(torch.cumsum(p, 0), u * p.sum(), right=True).clamp(max=4))
                assert torch.allclose(prop.draft_probs[b, i], p, atol=1e-6)
            else:
                tok = int(logits.argmax())
                assert prop.draft_probs[b, i].tolist() == torch.nn.functional.one_hot(torch.tensor(tok), 5).tolist()
            assert int(prop.draft_ids[b, i]) == tok
            c = torch.sigmoid(torch.cat([block.hidden[b, i], e]) @ heads.confidence[0])
            assert torch.allclose(prop.confidence[b, i], c, atol=1e-6)
            prev = tok



def test_greedy_rows_read_the_greedy_head_and_sts():
    """A mixed batch: temperature-0 rows are scored by `greedy_confidence` / `greedy_sts`, sampled rows by the
    sampling head / `sts`; drafts and draft probabilities do not depend on the heads."""
    block, heads = _random_case(4, seed=5)
    g = torch.Generator().manual_seed(9)
    wg = torch.randn(1, heads.confidence.shape[1], generator=g)
    both = DraftHeads(markov_embed=heads.markov_embed, markov_head=heads.markov_head, confidence=heads.confidence,
                      sts=(1.0, 2.0), greedy_confidence=wg, greedy_sts=0.5)
    anchors, pos = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 8, 15, 16])
    temp, seeds = torch.tensor([0.0, 1.0, 0.0, 0.8]), torch.arange(4, dtype=torch.int64) + 11
    prop = sample_block(block, both, anchors, pos, temperature=temp, seeds=seeds)
    plain = sample_block(block, heads, anchors, pos, temperature=temp, seeds=seeds)
    assert torch.equal(prop.draft_ids, plain.draft_ids) and torch.equal(prop.draft_probs, plain.draft_probs)
    for b in range(4):
        prev = [int(anchors[b])] + prop.draft_ids[b, :-1].tolist()
        for i in range(block.base_logits.shape[1]):
            x = torch.cat([block.hidden[b, i], heads.markov_embed[prev[i]]])
            want = (torch.sigmoid(x @ wg[0] / 0.5) if temp[b] == 0
                    else torch.sigmoid(x @ heads.confidence[0] / (1.0 if i == 0 else 2.0)))
            assert torch.allclose(prop.confidence[b, i], want, atol=1e-6)
    # every request greedy (no draft probabilities): the greedy head throughout
    greedy = sample_block(block, both, anchors, pos)
    x0 = torch.cat([block.hidden[:, 0], heads.markov_embed[anchors]], -1)
    assert torch.allclose(greedy.confidence[:, 0], torch.sigmoid(x0 @ wg[0] / 0.5), atol=1e-6)

def test_block_confidence_equals_the_per_position_formula():
    """`block_confidence` (every position in one pass, what `sample_block` uses) == `confidence` per position, for
    per-position STS sets, a greedy head, mixed / all-greedy / all-sampled rows (tolerance: fp32 dot products)."""
    block, heads = _random_case(5, width=4, seed=3)
    g = torch.Generator().manual_seed(4)
    wg = torch.randn(1, heads.confidence.shape[1], generator=g)
    both = DraftHeads(markov_embed=heads.markov_embed, markov_head=heads.markov_head, confidence=heads.confidence,
                      sts=(1.0, 2.0, 0.5), greedy_confidence=wg, greedy_sts=(0.7, 1.5))
    e = torch.randn(5, 4, heads.markov_embed.shape[1], generator=g)
    for h in (heads, both):
        for greedy in (None, torch.tensor([True, False, True, False, False]), True):
            rows = torch.ones(5, dtype=torch.bool) if greedy is True else greedy
            got = block_confidence(h, block.hidden, e, greedy=greedy)
            want = torch.stack([confidence(h, block.hidden[:, i], e[:, i], i, greedy=rows) for i in range(4)], 1)
            assert got.shape == (5, 4)
            assert torch.allclose(got, want, atol=1e-6)
    no_head = DraftHeads(markov_embed=heads.markov_embed, markov_head=heads.markov_head)
    assert block_confidence(no_head, block.hidden, e) is None


def test_temperature_sampling_follows_the_corrected_distribution():
    n = 20000
    block, heads = _random_case(1, width=2, seed=3)
    block = DraftBlock(base_logits=block.base_logits.expand(n, -1, -1), hidden=block.hidden.expand(n, -1, -1))
    temp = torch.full((n,), 0.8)
    prop = sample_block(block, heads, torch.full((n,), 2), torch.zeros(n, dtype=torch.int64), temperature=temp,
                        seeds=torch.arange(n, dtype=torch.int64))
    # position 0: softmax((U_0 + W2 W1[2]) / 0.8)
    p0 = torch.softmax((block.base_logits[0, 0] + heads.markov_head @ heads.markov_embed[2]) / 0.8, -1)
    counts = torch.bincount(prop.draft_ids[:, 0], minlength=5).double()
    chi2 = float(((counts - n * p0) ** 2 / (n * p0)).sum())
    assert chi2 < CHI2_CRIT_1E3[4], chi2
    # position 1 conditioned on the sampled d_0 = 1 follows softmax((U_1 + W2 W1[1]) / 0.8)
    rows = prop.draft_ids[:, 0] == 1
    p1 = torch.softmax((block.base_logits[0, 1] + heads.markov_head @ heads.markov_embed[1]) / 0.8, -1)
    c1 = torch.bincount(prop.draft_ids[rows, 1], minlength=5).double()
    m = float(rows.sum())
    chi2 = float(((c1 - m * p1) ** 2 / (m * p1)).sum())
    assert chi2 < CHI2_CRIT_1E3[4], chi2


def test_sampling_is_batch_independent_and_reproducible():
    block, heads = _random_case(8, seed=5)
    anchors, pos = torch.arange(8) % 5, torch.arange(8, dtype=torch.int64) * 3
    seeds, temp = torch.arange(8, dtype=torch.int64) + 11, torch.full((8,), 1.0)
    full = sample_block(block, heads, anchors, pos, temperature=temp, seeds=seeds)
    again = sample_block(block, heads, anchors, pos, temperature=temp, seeds=seeds)
    assert torch.equal(full.draft_ids, again.draft_ids)
    sub = [6, 1, 3]
    part = sample_block(DraftBlock(base_logits=block.base_logits[sub], hidden=block.hidden[sub]), heads,
                        anchors[sub], pos[sub], temperature=temp[sub], seeds=seeds[sub])
    assert torch.equal(part.draft_ids, full.draft_ids[sub])


def test_errors():
    block, heads = _random_case(2)
    with pytest.raises(DSparkInputError, match="seeds"):
        sample_block(block, heads, torch.tensor([0, 1]), torch.tensor([0, 1]), temperature=torch.tensor([1.0, 0.0]))
    with pytest.raises(DSparkInputError, match="temperature"):
        sample_block(block, heads, torch.tensor([0, 1]), torch.tensor([0, 1]), temperature=torch.tensor([-1.0, 0.0]),
                     seeds=torch.tensor([1, 2]))
    with pytest.raises(DSparkInputError, match="anchor"):
        sample_block(block, heads, torch.tensor([0]), torch.tensor([0, 1]))


def test_the_capturable_core_equals_sample_block_bit_for_bit():
    """What a CUDA graph of the draft round captures (`sample_core` with device temperatures and seeds, the mixed
    formulation for any sampled batch, STS divisors made beforehand) gives exactly `sample_block`'s proposal for
    all-sampled, mixed and all-greedy batches, with per-position STS sets and a greedy head."""
    from deepinfer_dspark import sample_core, sts_divisors

    block, heads = _random_case(4, width=5, vocab=7, seed=8)
    g = torch.Generator().manual_seed(2)
    both = DraftHeads(markov_embed=heads.markov_embed, markov_head=heads.markov_head, confidence=heads.confidence,
                      sts=(1.0, 2.0, 0.5, 0.8, 1.1), greedy_confidence=torch.randn(1, 5, generator=g), greedy_sts=0.9)
    anchors, pos, seeds = torch.tensor([0, 6, 2, 3]), torch.tensor([4, 8, 15, 16]), torch.tensor([3, -5, 11, 1 << 40])
    divisors = {flag: sts_divisors(both, 5, flag, torch.device("cpu")) for flag in (False, True)}
    for temp in (torch.tensor([0.7, 1.0, 2.0, 1.3]), torch.tensor([0.0, 1.0, 0.0, 0.8]), torch.zeros(4)):
        want = sample_block(block, both, anchors, pos, temperature=temp, seeds=seeds)
        sampled = bool((temp > 0).any())
        got = sample_core(block, both, anchors, pos, temp=temp if sampled else None, seeds=seeds if sampled else None,
                          divisors=divisors)
        assert torch.equal(got.draft_ids, want.draft_ids)
        assert torch.equal(got.confidence, want.confidence)
        assert (got.draft_probs is None) == (want.draft_probs is None)
        if want.draft_probs is not None:
            assert torch.equal(got.draft_probs, want.draft_probs)


def test_the_core_writes_probs_out_whatever_the_grad_mode():
    """`probs_out` takes the draft probabilities in place (graphs of several batch sizes share one buffer), also
    when the heads require grad and grad mode is on, as for a caller outside the engine's inference mode: the
    out= write once refused such inputs on the GPU."""
    from deepinfer_dspark import sample_core

    block, heads = _random_case(3, width=4, vocab=6, seed=5)
    heads = DraftHeads(markov_embed=heads.markov_embed.requires_grad_(), markov_head=heads.markov_head.requires_grad_(),
                       confidence=heads.confidence.requires_grad_())
    anchors, pos, seeds = torch.tensor([0, 5, 2]), torch.tensor([3, 9, 12]), torch.tensor([1, 2, 3])
    temp = torch.tensor([0.0, 1.0, 0.6])
    out = torch.full((3, 4, 6), float("nan"))
    with torch.enable_grad():
        got = sample_core(block, heads, anchors, pos, temp=temp, seeds=seeds, probs_out=out)
    want = sample_block(block, heads, anchors, pos, temperature=temp, seeds=seeds)
    assert got.draft_probs.data_ptr() == out.data_ptr()
    assert torch.equal(out, want.draft_probs.detach())
    assert torch.equal(got.draft_ids, want.draft_ids)


def test_propose_takes_a_fused_round_and_falls_back_when_declined():
    from deepinfer_dspark import propose

    block, heads = _random_case(2, width=3, seed=1)
    calls = []

    class Model:
        block_size = 3

        def __init__(self, fused):
            self.heads, self.fused = heads, fused

        def draft_block(self, anchor_ids, anchor_positions):
            calls.append("pass")
            return block

        def propose_block(self, anchor_ids, anchor_positions, *, temperature=None, seeds=None):
            calls.append("fused")
            if not self.fused:
                return None
            return sample_block(block, heads, anchor_ids, anchor_positions, temperature=temperature, seeds=seeds)

    anchors, pos = torch.tensor([1, 2]), torch.tensor([5, 6])
    want = sample_block(block, heads, anchors, pos)
    for fused, path in ((True, ["fused"]), (False, ["fused", "pass"])):
        calls.clear()
        got = propose(Model(fused), anchors, pos)
        assert calls == path and torch.equal(got.draft_ids, want.draft_ids)
    with pytest.raises(DSparkInputError, match="seeds"):  # checked before the fused path too
        propose(Model(True), anchors, pos, temperature=torch.tensor([1.0, 0.0]))
