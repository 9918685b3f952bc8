"""rebalance_experts / balanced_packing / replicate_experts: structural invariants, balance vs. naive placement and
vs. the ideal mean, brute-force optimality of the replication step, determinism, typed errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from deepinfer_parallel.eplb import (
    balanced_packing,
    build_log2phy,
    gpu_loads,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_parallel.errors import ParallelConfigError


def _skewed(layers: int, experts: int, seed: int, alpha: float = 1.2) -> torch.Tensor:
    """Zipf-like loads, a different random permutation of the hot experts per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1000.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** alpha
    return torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)])


def _loads_by_loop(weight, phy2log, logcnt, num_gpus):
    """Per-GPU load computed slot by slot (independent of gpu_loads)."""
    layers, slots = phy2log.shape
    per_gpu = slots // num_gpus
    out = [[0.0] * num_gpus for _ in range(layers)]
    for l in range(layers):
        for s in range(slots):
            e = int(phy2log[l, s])
            out[l][s // per_gpu] += float(weight[l, e]) / int(logcnt[l, e])
    return torch.tensor(out, dtype=torch.float64)


def _round_robin(num_layers, num_experts, num_replicas):
    """Naive placement: slot s holds expert s mod E (the start-up layout), no load information used."""
    phy2log = (torch.arange(num_replicas) % num_experts).expand(num_layers, -1)
    logcnt = torch.stack([torch.bincount(row, minlength=num_experts) for row in phy2log])
    return phy2log, logcnt


CASES = [
    # layers, experts, replicas, groups, nodes, gpus
    (3, 16, 16, 1, 1, 4),  # no redundancy
    (3, 16, 24, 1, 1, 4),
    (2, 32, 40, 4, 2, 8),  # hierarchical
    (2, 24, 32, 3, 2, 4),  # groups not divisible by nodes -> global policy
    (2, 12, 18, 1, 1, 1),  # a single GPU
    (1, 384, 448, 1, 1, 64),  # V4.1 shape: 384 experts, 64 redundant, EP64
]


@pytest.mark.parametrize("layers,experts,replicas,groups,nodes,gpus", CASES)
def test_structure(layers, experts, replicas, groups, nodes, gpus):
    weight = _skewed(layers, experts, seed=experts + replicas)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    assert phy2log.shape == (layers, replicas) and phy2log.dtype == torch.int64
    assert logcnt.shape == (layers, experts) and logcnt.dtype == torch.int64
    assert log2phy.shape[:2] == (layers, experts) and log2phy.shape[2] == int(logcnt.max())
    assert bool((logcnt >= 1).all()), "every logical expert needs a replica"
    assert torch.equal(logcnt.sum(1), torch.full((layers,), replicas))
    for l in range(layers):
        assert torch.equal(torch.bincount(phy2log[l], minlength=experts), logcnt[l])
        for e in range(experts):
            slots = log2phy[l, e]
            valid = slots[: int(logcnt[l, e])]
            assert bool((slots[int(logcnt[l, e]):] == -1).all())
            assert bool((valid[1:] > valid[:-1]).all()), "replica slots listed in ascending order"
            assert bool((phy2log[l, valid] == e).all())
    # Each GPU owns exactly replicas/gpus contiguous slots by construction of the layout; check that they are
    # all filled with real experts and that each slot appears once in log2phy.
    for l in range(layers):
        listed = log2phy[l][log2phy[l] >= 0]
        assert sorted(listed.tolist()) == list(range(replicas))


@pytest.mark.parametrize("layers,experts,replicas,groups,nodes,gpus", CASES)
def test_replicas_of_one_expert_on_distinct_gpus(layers, experts, replicas, groups, nodes, gpus):
    weight = _skewed(layers, experts, seed=7)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    per_gpu = replicas // gpus
    gpus_in_scope = gpus // nodes if groups % nodes == 0 else gpus  # replicas stay inside their node
    for l in range(layers):
        for e in range(experts):
            slots = log2phy[l, e][: int(logcnt[l, e])]
            ranks = set((slots // per_gpu).tolist())
            assert len(ranks) == min(len(slots), gpus_in_scope)


def test_global_policy_balance_bound_and_beats_round_robin():
    # Bound stated: max GPU load <= ideal mean + the largest per-replica load. This is the classic greedy
    # (list-scheduling) bound; for the equal-cardinality greedy used here it is not proven in this repo (it held on
    # every small integer instance with <= 4 packs / 8 items and on random ones when this test was written).
    for seed, (experts, replicas, gpus) in enumerate([(64, 80, 8), (128, 160, 16), (384, 448, 64), (32, 32, 4)]):
        weight = _skewed(4, experts, seed=seed)
        phy2log, _, logcnt = rebalance_experts(weight, replicas, 1, 1, gpus)
        loads = _loads_by_loop(weight, phy2log, logcnt, gpus)
        mean = weight.sum(1) / gpus
        max_replica = (weight / logcnt).max(1).values
        assert bool((loads.max(1).values <= mean + max_replica + 1e-9).all())
        rr_p, rr_c = _round_robin(4, experts, replicas)
        rr_loads = _loads_by_loop(weight, rr_p, rr_c, gpus)
        assert bool((loads.max(1).values <= rr_loads.max(1).values + 1e-9).all())
        # On Zipf loads the hottest expert alone exceeds the mean GPU load under round robin; EPLB must do better.
        assert bool((loads.max(1).values < rr_loads.max(1).values).all())
        assert abs(float(loads.sum() - weight.sum())) < 1e-6 * float(weight.sum())


def test_hierarchical_policy_keeps_groups_on_one_node_and_bound():
    layers, experts, groups, nodes, gpus, replicas = 3, 32, 8, 2, 8, 48
    weight = _skewed(layers, experts, seed=3)
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    group_size, per_gpu, gpus_per_node = experts // groups, replicas // gpus, gpus // nodes
    loads = _loads_by_loop(weight, phy2log, logcnt, gpus)
    for l in range(layers):
        node_of_slot = torch.arange(replicas) // per_gpu // gpus_per_node
        groups_per_node = [set() for _ in range(nodes)]
        for s in range(replicas):
            groups_per_node[int(node_of_slot[s])].add(int(phy2log[l, s]) // group_size)
        assert all(len(g) == groups // nodes for g in groups_per_node)
        assert set().union(*groups_per_node) == set(range(groups))
        assert not set.intersection(*groups_per_node), "a group's experts must all live on one node"
        # Composed bound: node total <= mean node load + heaviest group; GPU <= its node total / GPUs per node
        # + the heaviest replica of that node.
        group_loads = weight[l].reshape(groups, group_size).sum(1)
        node_totals = loads[l].reshape(nodes, gpus_per_node).sum(1)
        assert float(node_totals.max()) <= float(weight[l].sum()) / nodes + float(group_loads.max()) + 1e-9
        max_replica = float((weight[l] / logcnt[l]).max())
        for n in range(nodes):
            node_gpus = loads[l, n * gpus_per_node : (n + 1) * gpus_per_node]
            assert float(node_gpus.max()) <= float(node_totals[n]) / gpus_per_node + max_replica + 1e-9


def test_uniform_load_is_perfectly_balanced():
    weight = torch.full((2, 16), 5.0)
    phy2log, _, logcnt = rebalance_experts(weight, 16, 1, 1, 4)
    assert torch.equal(logcnt, torch.ones(2, 16, dtype=torch.int64))
    assert torch.equal(_loads_by_loop(weight, phy2log, logcnt, 4), torch.full((2, 4), 20.0, dtype=torch.float64))


def test_hot_expert_gets_the_redundant_slots():
    weight = torch.tensor([[100.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    _, _, logcnt = rebalance_experts(weight, 12, 1, 1, 4)
    assert logcnt.tolist() == [[5, 1, 1, 1, 1, 1, 1, 1]]


def test_replication_is_optimal_by_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        experts, slots = 4, 4 + int(torch.randint(0, 5, (1,), generator=g))
        weight = torch.rand(1, experts, generator=g, dtype=torch.float64) * 10
        _, logcnt = replicate_experts(weight, slots)
        best = min(
            max(float(weight[0, e]) / c[e] for e in range(experts))
            for c in itertools.product(range(1, slots + 1), repeat=experts)
            if sum(c) == slots
        )
        got = float((weight[0] / logcnt[0]).max())
        assert got <= best + 1e-12, (trial, got, best)


def test_balanced_packing_counts_and_bound():
    g = torch.Generator().manual_seed(1)
    weight = torch.rand(5, 24, generator=g) ** 3
    pack, rank = balanced_packing(weight, 6)
    for r in range(5):
        assert torch.equal(torch.bincount(pack[r], minlength=6), torch.full((6,), 4))
        for p in range(6):
            assert sorted(rank[r][pack[r] == p].tolist()) == [0, 1, 2, 3]
        loads = torch.zeros(6, dtype=torch.float64).index_add_(0, pack[r], weight[r].double())
        assert float(loads.max()) <= float(weight[r].sum()) / 6 + float(weight[r].max()) + 1e-6
    # One item per pack: the heaviest item goes to pack 0, the next to pack 1, ...
    pack1, _ = balanced_packing(torch.tensor([[1.0, 5.0, 3.0]]), 3)
    assert pack1.tolist() == [[2, 0, 1]]


def test_gpu_loads_matches_loop():
    weight = _skewed(2, 16, seed=5)
    phy2log, _, logcnt = rebalance_experts(weight, 24, 1, 1, 4)
    assert torch.allclose(gpu_loads(weight, phy2log, logcnt, 4), _loads_by_loop(weight, phy2log, logcnt, 4))


def test_build_log2phy_by_hand():
    phy2log = torch.tensor([[2, 0, 2, 1, 0, 2]])
    logcnt = torch.tensor([[2, 1, 3]])
    assert build_log2phy(phy2log, logcnt).tolist() == [[[1, 4, -1], [3, -1, -1], [0, 2, 5]]]


def test_deterministic_and_dtype_independent():
    weight = _skewed(3, 64, seed=11)
    # Exact ties everywhere: the tie-break rules, not the hash order of anything, decide.
    weight[:, :8] = 50.0
    a = rebalance_experts(weight, 80, 4, 2, 8)
    b = rebalance_experts(weight.clone(), 80, 4, 2, 8)
    c = rebalance_experts(weight.to(torch.float32).to(torch.float64), 80, 4, 2, 8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    counts = torch.round(weight).to(torch.int64)
    d = rebalance_experts(counts, 80, 4, 2, 8)
    e = rebalance_experts(counts.to(torch.float64), 80, 4, 2, 8)
    for x, y in zip(d, e):
        assert torch.equal(x, y)
    assert all(t.shape == u.shape for t, u in zip(a, c))


@pytest.mark.parametrize(
    "args,field",
    [
        ((torch.ones(2, 16), 12, 1, 1, 4), "num_replicas"),  # fewer slots than experts
        ((torch.ones(2, 16), 18, 1, 1, 4), "num_replicas"),  # not divisible by GPUs
        ((torch.ones(2, 16), 16, 3, 1, 4), "num_groups"),
        ((torch.ones(2, 16), 16, 1, 3, 4), "num_nodes"),
        ((torch.ones(16), 16, 1, 1, 4), "weight"),
        ((-torch.ones(2, 16), 16, 1, 1, 4), "weight"),
        ((torch.ones(2, 16), 16, 1, 1, 0), "num_gpus"),
    ],
)
def test_typed_errors(args, field):
    with pytest.raises(ParallelConfigError, match=field):
        rebalance_experts(*args)


def test_property_random_instances():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(
        gpus=st.integers(1, 6),
        slots_per_gpu=st.integers(1, 4),
        data=st.data(),
    )
    def check(gpus, slots_per_gpu, data):
        replicas = gpus * slots_per_gpu
        experts = data.draw(st.integers(1, replicas))
        weight = torch.tensor([data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))],
                              dtype=torch.float64)
        phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, 1, 1, gpus)
        assert bool((logcnt >= 1).all()) and int(logcnt.sum()) == replicas
        assert torch.equal(torch.bincount(phy2log[0], minlength=experts), logcnt[0])
        listed = log2phy[0][log2phy[0] >= 0]
        assert sorted(listed.tolist()) == list(range(replicas))
        loads = _loads_by_loop(weight, phy2log, logcnt, gpus)
        bound = float(weight.sum()) / gpus + float((weight / logcnt).max())
        assert float(loads.max()) <= bound + 1e-9

    check()
