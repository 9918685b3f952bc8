"""DraftProposal / DraftBlock / DraftHeads validation and survival; a toy DraftModel satisfies the protocol, and
`propose` turns its parallel pass into drafts that verification accepts."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import (
    DraftBlock,
    DraftHeads,
    DraftModel,
    DraftProposal,
    DSparkInputError,
    greedy_accept,
    propose,
)


class _CopyDrafter:
    """Base logits favour anchor+1+i (mod V) strongly at block position i; a zero Markov head."""

    def __init__(self, block_size: int, vocab: int) -> None:
        self._n, self._v = block_size, vocab
        self._heads = DraftHeads(markov_embed=torch.zeros(vocab, 2), markov_head=torch.zeros(vocab, 2),
                                 confidence=torch.zeros(1, 3 + 2))

    @property
    def block_size(self) -> int:
        return self._n

    @property
    def heads(self) -> DraftHeads:
        return self._heads

    def draft_block(self, anchor_ids, anchor_positions) -> DraftBlock:
        ids = (anchor_ids[:, None] + torch.arange(1, self._n + 1)) % self._v
        logits = 10.0 * torch.nn.functional.one_hot(ids, self._v).to(torch.float32)
        return DraftBlock(base_logits=logits, hidden=torch.zeros(ids.shape[0], self._n, 3))


def test_toy_model_satisfies_protocol_and_verifies():
    model = _CopyDrafter(3, 7)
    assert isinstance(model, DraftModel)
    prop = propose(model, torch.tensor([2, 6]), torch.tensor([10, 4]))
    assert prop.draft_ids.tolist() == [[3, 4, 5], [0, 1, 2]]
    assert prop.batch_size == 2 and prop.block_size == 3
    assert prop.draft_probs is None  # all greedy
    # zero confidence weights: c = sigmoid(0) = 0.5 at every position
    assert torch.allclose(prop.survival(), torch.tensor([[0.5, 0.25, 0.125]] * 2))
    # Target agrees with request 0 on two drafts, with request 1 on none (it wants 6 after anchor 6).
    target = torch.nn.functional.one_hot(torch.tensor([3, 4, 0, 1] + [6, 6]), 7).float()
    r = greedy_accept(target, prop.draft_ids, [3, 1])
    assert r.tokens() == [[3, 4, 0], [6]]
    assert r.next_anchors().tolist() == [0, 6]
    assert r.rejected([3, 1]).tolist() == [1, 1]


def test_proposal_validation():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(DSparkInputError, match="draft_ids"):
        DraftProposal(draft_ids=ids.to(torch.int32))
    with pytest.raises(DSparkInputError, match="draft_probs"):
        DraftProposal(draft_ids=ids, draft_probs=torch.zeros(2, 2, 5))
    with pytest.raises(DSparkInputError, match="draft_logits"):
        DraftProposal(draft_ids=ids, draft_logits=torch.zeros(2, 3, 5, dtype=torch.int64))
    with pytest.raises(DSparkInputError, match="differ"):
        DraftProposal(draft_ids=ids, draft_probs=torch.zeros(2, 3, 5), draft_logits=torch.zeros(2, 3, 6))
    with pytest.raises(DSparkInputError, match="confidence"):
        DraftProposal(draft_ids=ids, confidence=torch.zeros(2, 2))
    assert DraftProposal(draft_ids=ids).survival() is None


def test_block_and_heads_validation():
    with pytest.raises(DSparkInputError, match="base_logits"):
        DraftBlock(base_logits=torch.zeros(2, 3), hidden=torch.zeros(2, 3, 4))
    with pytest.raises(DSparkInputError, match="hidden"):
        DraftBlock(base_logits=torch.zeros(2, 3, 5), hidden=torch.zeros(2, 2, 4))
    with pytest.raises(DSparkInputError, match="markov"):
        DraftHeads(markov_embed=torch.zeros(5, 2), markov_head=torch.zeros(5, 3))
    with pytest.raises(DSparkInputError, match="confidence"):
        DraftHeads(markov_embed=torch.zeros(5, 2), markov_head=torch.zeros(5, 2), confidence=torch.zeros(2, 6))
    with pytest.raises(DSparkInputError, match="sts"):
        DraftHeads(markov_embed=torch.zeros(5, 2), markov_head=torch.zeros(5, 2), sts=(1.0, 0.0))
    h = DraftHeads(markov_embed=torch.zeros(5, 2), markov_head=torch.zeros(5, 2), sts=(1.0, 2.0))
    assert [h.sts_temperature(i) for i in range(4)] == [1.0, 2.0, 2.0, 2.0]


def test_greedy_head_validation():
    w1 = w2 = torch.zeros(5, 2)
    with pytest.raises(DSparkInputError, match="greedy_confidence"):  # needs the (sampling) head beside it
        DraftHeads(markov_embed=w1, markov_head=w2, greedy_confidence=torch.zeros(1, 5))
    with pytest.raises(DSparkInputError, match="greedy_confidence"):
        DraftHeads(markov_embed=w1, markov_head=w2, confidence=torch.zeros(1, 5), greedy_confidence=torch.zeros(1, 6))
    with pytest.raises(DSparkInputError, match="greedy_sts"):
        DraftHeads(markov_embed=w1, markov_head=w2, greedy_sts=-1.0)
    h = DraftHeads(markov_embed=w1, markov_head=w2, sts=2.0, greedy_sts=(1.0, 3.0))
    assert h.has_greedy_head and h.sts_temperature(4) == 2.0 and h.sts_temperature(4, greedy=True) == 3.0
    assert not DraftHeads(markov_embed=w1, markov_head=w2, sts=2.0).has_greedy_head
