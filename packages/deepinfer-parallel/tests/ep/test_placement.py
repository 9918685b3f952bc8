"""ExpertPlacement: validation, initial layout, deterministic replica choice, local slots, stats folding."""

from __future__ import annotations

import pytest
import torch
from deepinfer_parallel.ep import REPLICA_HASH_PRIME, ExpertPlacement
from deepinfer_parallel.eplb import rebalance_experts
from deepinfer_parallel.errors import PlacementError


def _placement():
    # Layer 0: expert 0 has 3 replicas (slots 0, 3, 5), expert 1 slot 1, expert 2 slots 2 and 4.
    phy2log = torch.tensor([[0, 1, 2, 0, 2, 0]])
    logcnt = torch.tensor([[3, 1, 2]])
    return ExpertPlacement.from_maps(phy2log, logcnt)


def test_from_maps_by_hand():
    p = _placement()
    assert p.log2phy.tolist() == [[[0, 3, 5], [1, -1, -1], [2, 4, -1]]]
    assert (p.num_layers, p.num_logical, p.num_physical, p.max_replicas) == (1, 3, 6, 3)


def test_initial_layout():
    p = ExpertPlacement.initial(num_layers=2, num_experts=4, num_physical=6)
    assert p.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]] * 2
    assert p.logcnt.tolist() == [[2, 2, 1, 1]] * 2
    assert p.log2phy[0].tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]


def test_map_to_physical_formula_and_padding():
    p = _placement()
    ids = torch.tensor([[0, 1], [0, 2], [2, -1], [0, 0]])
    out = p.map_to_physical(0, ids, ep_rank=1)
    slots = {0: [0, 3, 5], 1: [1], 2: [2, 4]}
    for t in range(4):
        for k in range(2):
            e = int(ids[t, k])
            if e < 0:
                assert int(out[t, k]) == -1
            else:
                replica = (1 + t * REPLICA_HASH_PRIME) % len(slots[e])
                assert int(out[t, k]) == slots[e][replica]
    assert bool((p.phy2log[0][out.clamp(min=0)][ids >= 0] == ids[ids >= 0]).all())


def test_map_to_physical_spreads_and_is_batch_independent():
    weight = torch.tensor([[1000.0] + [1.0] * 15])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 24, 1, 1, 4)
    p = ExpertPlacement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
    hot = int(logcnt[0, 0])
    assert hot > 1
    ids = torch.zeros(hot * 50, 1, dtype=torch.int64)  # every token routes to the hot expert
    out = p.map_to_physical(0, ids)
    counts = torch.bincount(out[:, 0], minlength=24)[log2phy[0, 0, :hot]]
    assert counts.tolist() == [50] * hot, "consecutive tokens cycle over the replicas"
    # A token's slot depends on its own index only, not on the other rows of the batch.
    token_index = torch.tensor([7, 123, 99999])
    alone = torch.cat([p.map_to_physical(0, ids[:1], token_index=token_index[i : i + 1]) for i in range(3)])
    together = p.map_to_physical(0, ids[:3], token_index=token_index)
    assert torch.equal(alone, together)


def test_local_slots_and_ranks():
    p = ExpertPlacement.initial(num_layers=1, num_experts=6, num_physical=8)
    assert p.local_slots(1, 4) == range(2, 4)
    assert p.local_experts(0, 3, 4).tolist() == [0, 1]
    assert p.rank_of_slot(torch.tensor([0, 3, 7, -1]), 4).tolist() == [0, 1, 3, -1]
    with pytest.raises(PlacementError, match="ep_size"):
        p.slots_per_rank(3)


def test_logical_load_folds_replicas():
    p = _placement()
    counts = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert p.logical_load(counts).tolist() == [[1 + 4 + 6, 2, 3 + 5]]


def test_validation_errors():
    good = _placement()
    with pytest.raises(PlacementError, match="logcnt"):
        ExpertPlacement(phy2log=good.phy2log, log2phy=good.log2phy, logcnt=torch.tensor([[2, 2, 2]]))
    bad_l2p = good.log2phy.clone()
    bad_l2p[0, 0, 0], bad_l2p[0, 0, 1] = 3, 0  # not ascending
    with pytest.raises(PlacementError, match="log2phy"):
        ExpertPlacement(phy2log=good.phy2log, log2phy=bad_l2p, logcnt=good.logcnt)
    with pytest.raises(PlacementError, match="phy2log"):
        ExpertPlacement.from_maps(torch.tensor([[0, 1, 5]]), torch.tensor([[1, 1, 1]]))
    with pytest.raises(PlacementError, match="phy2log"):
        ExpertPlacement.from_maps(torch.tensor([[0.0, 1.0]]), torch.tensor([[1, 1]]))
    with pytest.raises(PlacementError, match="token_index"):
        good.map_to_physical(0, torch.tensor([[0]]), token_index=torch.tensor([0, 1]))
    with pytest.raises(PlacementError, match="layer"):
        good.map_to_physical(1, torch.tensor([[0]]))
