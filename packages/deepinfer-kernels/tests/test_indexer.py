"""Indexer reference (docs/model.md §C.4) against small hand-derived cases."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.indexer import (
    candidate_blocks,
    causal_mask,
    index_scores,
    topk_indices,
    visible_counts,
)

NEG = float("-inf")


def test_index_scores_hand_case() -> None:
    # T=1, H=2, D=2. keys: e0=(1,0), e1=(0,1), e2=(1,1).
    q = torch.tensor([[[1.0, -1.0], [2.0, 3.0]]])  # head0 (1,-1), head1 (2,3)
    w = torch.tensor([[0.5, -1.0]])
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # head0 dots: 1, -1, 0 -> relu 1, 0, 0 ; head1 dots: 2, 3, 5 -> relu 2, 3, 5
    # score = 0.5*h0 - 1*h1 = 0.5-2, 0-3, 0-5 = -1.5, -3, -5
    got = index_scores(q, w, keys)
    assert torch.equal(got, torch.tensor([[-1.5, -3.0, -5.0]]))


def test_index_scores_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="keys"):
        index_scores(torch.zeros(1, 2, 3), torch.zeros(1, 2), torch.zeros(4, 2))


def test_visible_counts_ratio_1_and_2() -> None:
    pos = torch.arange(6)
    assert visible_counts(pos, 1).tolist() == [1, 2, 3, 4, 5, 6]  # own entry visible at ratio 1
    assert visible_counts(pos, 2).tolist() == [0, 1, 1, 2, 2, 3]  # entry w after token 2w+1


def test_causal_topk_pads_with_minus_one() -> None:
    scores = torch.tensor([[5.0, 1.0, 3.0, 9.0], [5.0, 1.0, 3.0, 9.0], [5.0, 1.0, 3.0, 9.0]])
    visible = torch.tensor([0, 2, 4])
    got = topk_indices(causal_mask(scores, visible), 3)
    # row0: nothing visible; row1: {0,1} both (k=min(3,2)); row2: top3 of 5,1,3,9 -> {0,2,3}
    assert got.tolist() == [[-1, -1, -1], [0, 1, -1], [0, 2, 3]]


def test_topk_ties_prefer_lower_index() -> None:
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0]])
    assert topk_indices(scores, 3).tolist() == [[0, 1, 4]]
    assert topk_indices(scores, 8).tolist() == [[0, 1, 2, 3, 4, -1, -1, -1]]


def test_candidate_blocks_pin_newest_block() -> None:
    # 7 entries, block_size 2 -> blocks {0,1} {2,3} {4,5} {6}. Query sees 5 entries (newest = 4, block 2).
    s = torch.tensor([[9.0, 0.0, 1.0, 8.0, -7.0, 5.0, 4.0]])
    visible = torch.tensor([5])
    ids, allowed = candidate_blocks(causal_mask(s, visible), visible, block_size=2, topk_blocks=2)
    # block maxima over visible: b0 = 9, b1 = 8, b2 = -7 (only entry 4 visible) but pinned -> keep b2 and b0.
    assert ids.tolist() == [[0, 2]]
    assert allowed.tolist() == [[True, True, False, False, True, False, False]]


def test_candidate_blocks_few_blocks_and_nothing_visible() -> None:
    s = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    visible = torch.tensor([0, 3])
    ids, allowed = candidate_blocks(causal_mask(s, visible), visible, block_size=2, topk_blocks=3)
    assert ids.tolist() == [[-1, -1, -1], [0, 1, -1]]
    assert allowed.tolist() == [[False, False, False], [True, True, True]]


def test_consumer_never_selects_outside_candidates() -> None:
    g = torch.Generator().manual_seed(0)
    t, n = 6, 20
    pub = torch.randn(t, n, generator=g)
    cons = torch.randn(t, n, generator=g)
    visible = torch.tensor([3, 7, 10, 14, 18, 20])
    _, allowed = candidate_blocks(causal_mask(pub, visible), visible, block_size=3, topk_blocks=2)
    sel = topk_indices(causal_mask(cons, visible).masked_fill(~allowed, NEG), 4)
    for row in range(t):
        for w in sel[row].tolist():
            if w >= 0:
                assert bool(allowed[row, w])
        # the newest visible entry's block is always allowed
        assert bool(allowed[row, visible[row] - 1])
