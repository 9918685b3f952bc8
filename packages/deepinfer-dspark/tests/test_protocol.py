"""DraftProposal validation and survival; a toy DraftModel satisfies the protocol and feeds verification."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import DraftModel, DraftProposal, DSparkInputError, greedy_accept


class _CopyDrafter:
    """Proposes anchor+1, anchor+2, ... (mod V) with one-hot probabilities."""

    def __init__(self, block_size: int, vocab: int) -> None:
        self._n, self._v = block_size, vocab

    @property
    def block_size(self) -> int:
        return self._n

    def propose(self, anchor_ids, anchor_positions, *, temperature=None, generators=None) -> DraftProposal:
        ids = (anchor_ids[:, None] + torch.arange(1, self._n + 1)) % self._v
        probs = torch.nn.functional.one_hot(ids, self._v).to(torch.float32)
        return DraftProposal(draft_ids=ids, draft_probs=probs, confidence=torch.full(ids.shape, 0.5))


def test_toy_model_satisfies_protocol_and_verifies():
    model = _CopyDrafter(3, 7)
    assert isinstance(model, DraftModel)
    prop = model.propose(torch.tensor([2, 6]), torch.tensor([10, 4]))
    assert prop.draft_ids.tolist() == [[3, 4, 5], [0, 1, 2]]
    assert prop.batch_size == 2 and prop.block_size == 3
    assert torch.allclose(prop.survival(), torch.tensor([[0.5, 0.25, 0.125]] * 2))
    # Target agrees with request 0 on two drafts, with request 1 on none (it wants 6 after anchor 6).
    target = torch.nn.functional.one_hot(torch.tensor([3, 4, 0, 1] + [6, 6]), 7).float()
    r = greedy_accept(target, prop.draft_ids, [3, 1])
    assert r.tokens() == [[3, 4, 0], [6]]


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
