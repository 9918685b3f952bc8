"""Greedy and rejection-sampling verification: hand-made greedy cases, the exactness of rejection sampling on a
5-token vocabulary (chi-square + total-variation bounds), reproducibility and batch independence, typed errors."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import (
    DraftProposal,
    DSparkInputError,
    TargetLogits,
    greedy_accept,
    probs_from_logits,
    rejection_accept,
    row_plan,
    verify,
    verify_uniforms,
)
from torch.utils._python_dispatch import TorchDispatchMode

V = 5
# chi-square critical values at significance 1e-3 by degrees of freedom (standard table).
CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


def _one_hot_rows(argmaxes: list[int]) -> torch.Tensor:
    rows = torch.full((len(argmaxes), V), -1.0)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 2.0
    return rows


# ---------------------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------------------
def test_greedy_by_hand_varlen():
    # Request 0: 3 drafts, rows argmax [4, 1, 3, 0] -> drafts [4, 1, 2]: accept 2, correction 3.
    # Request 1: 2 drafts, rows argmax [2, 2, 1] -> drafts [2, 2]: all accepted, bonus 1.
    # Request 2: 0 drafts, row argmax [0] -> emits 0.
    # Request 3: 1 draft, rows [3, 4] -> draft [1]: rejected at once, correction 3.
    target = _one_hot_rows([4, 1, 3, 0] + [2, 2, 1] + [0] + [3, 4])
    drafts = torch.tensor([[4, 1, 2], [2, 2, -1], [-1, -1, -1], [1, 9, 9]])
    r = greedy_accept(target, drafts, [3, 2, 0, 1])
    assert r.num_accepted.tolist() == [2, 2, 0, 0]
    assert r.tokens() == [[4, 1, 3], [2, 2, 1], [0], [3]]
    assert r.output_ids[0].tolist() == [4, 1, 3, -1]
    assert r.num_emitted.tolist() == [3, 3, 1, 1]
    assert r.accept_prob is None


def test_greedy_ignores_drafts_past_num_drafts_and_ties_pick_lowest_id():
    # Row 1 would match draft 2 but only one draft is verified -> bonus from row 1.
    target = torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    r = greedy_accept(target, torch.tensor([[1, 0]]), [1])
    assert r.tokens() == [[1, 0]], "tie between ids 1 and 2 resolves to 1"


def test_greedy_all_drafts_wrong():
    target = _one_hot_rows([0, 0, 0])
    r = greedy_accept(target, torch.tensor([[1, 1]]), torch.tensor([2]))
    assert r.tokens() == [[0]]


# ---------------------------------------------------------------------------------------------------------------
# rejection sampling: hand cases
# ---------------------------------------------------------------------------------------------------------------
def test_rejection_by_hand_with_explicit_uniforms():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[[0.25, 0.75, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[1, 2]])
    # d_1 = 1: p/q = 0.5/0.75 = 2/3. u = 0.6 < 2/3 accepts; d_2 = 2: p/q = 1 accepts; bonus from row 2 at u=0.45:
    # cdf 0.2, 0.4, 0.6 -> id 2.
    r = rejection_accept(p, drafts, q, [2], uniforms=torch.tensor([[0.6, 0.99, 0.45]]))
    assert r.tokens() == [[1, 2, 2]]
    # u = 0.7 > 2/3 rejects d_1: residual max(0, p - q) = [0.25, 0, ...] -> always id 0 whatever the uniform.
    r = rejection_accept(p, drafts, q, [2], uniforms=torch.tensor([[0.7, 0.0, 0.999]]))
    assert r.tokens() == [[0]]
    assert torch.allclose(r.accept_prob, torch.tensor([[0.75, 1.0]]))  # sum min(p, q) per position


def test_rejection_draft_outside_target_support_is_always_rejected():
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.2] * 5])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]])
    for u in (0.0, 0.5, 0.999):
        r = rejection_accept(p, torch.tensor([[0]]), q, [1], uniforms=torch.tensor([[u, u]]))
        assert r.tokens() == [[1]]


# ---------------------------------------------------------------------------------------------------------------
# rejection sampling: the emitted distribution equals the target's
# ---------------------------------------------------------------------------------------------------------------
def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() * n
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


TARGET = [
    torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05]),
    torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40]),
    torch.tensor([0.00, 0.50, 0.30, 0.20, 0.00]),  # zeros in the target's support
]
DRAFTS = {
    "equal": lambda p: p.clone(),
    "uniform": lambda p: torch.full((V,), 1.0 / V),
    "very_wrong": lambda p: torch.tensor([0.01, 0.01, 0.01, 0.01, 0.96])[torch.argsort(torch.argsort(-p))],
    "one_hot": lambda p: torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]),  # greedy-style draft
    "disjoint": lambda p: (p == 0).to(torch.float32) / max(int((p == 0).sum()), 1) if bool((p == 0).any())
    else torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]),
}
N_REQUESTS = 20_000
# Bound stated for n = 20,000 draws over 5 tokens: E[TV] ~ 0.006, so 0.02 is > 3x the expected deviation.
TV_BOUND = 0.02


def _simulate(target_rows: list[torch.Tensor], draft_dist: list[torch.Tensor], seed: int):
    """N_REQUESTS identical requests, each with len(draft_dist) drafts sampled from the (context-free) draft
    distributions, verified against context-free target rows."""
    width = len(draft_dist)
    g_draft = torch.Generator().manual_seed(1000 + seed)
    q = torch.stack(draft_dist)  # [N, V]
    drafts = torch.stack([torch.multinomial(q[j], N_REQUESTS, replacement=True, generator=g_draft)
                          for j in range(width)], dim=1)
    p_rows = torch.stack(target_rows)  # [N + 1, V]
    target = p_rows.repeat(N_REQUESTS, 1)
    draft_probs = q.expand(N_REQUESTS, width, V)
    return rejection_accept(target, drafts, draft_probs, [width] * N_REQUESTS,
                            generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("draft_name", list(DRAFTS))
@pytest.mark.parametrize("t_index", range(len(TARGET)))
def test_first_token_follows_target(draft_name, t_index):
    p = TARGET[t_index]
    q = DRAFTS[draft_name](p)
    r = _simulate([p, TARGET[(t_index + 1) % 3]], [q], seed=17 * t_index + len(draft_name))
    counts = torch.bincount(r.output_ids[:, 0], minlength=V)
    stat, df = _chi2(counts, p)
    assert stat < CHI2_CRIT_1E3[df], (draft_name, counts.tolist(), stat)
    assert _tv(counts, p) < TV_BOUND
    # The acceptance rate matches its analytic value sum min(p, q) (binomial std ~ 0.0035 at n = 20,000).
    assert abs(float(r.num_accepted.double().mean()) - float(torch.minimum(p, q).sum())) < 0.015


@pytest.mark.parametrize("draft_name", ["uniform", "very_wrong"])
def test_second_token_follows_target_given_first_accepted(draft_name):
    rows = [TARGET[0], TARGET[1], TARGET[2]]
    q = [DRAFTS[draft_name](TARGET[0]), DRAFTS[draft_name](TARGET[1])]
    r = _simulate(rows, q, seed=5)
    reached = r.num_accepted >= 1
    counts = torch.bincount(r.output_ids[reached, 1], minlength=V)
    stat, df = _chi2(counts, TARGET[1])
    assert stat < CHI2_CRIT_1E3[df], (counts.tolist(), stat)
    # Bonus position: both accepted -> third token from row 2.
    both = r.num_accepted == 2
    counts3 = torch.bincount(r.output_ids[both, 2], minlength=V)
    if int(both.sum()) > 500:
        stat3, df3 = _chi2(counts3, TARGET[2])
        assert stat3 < CHI2_CRIT_1E3[df3]


@pytest.mark.gpu
@pytest.mark.parametrize("draft_name", ["uniform", "very_wrong", "disjoint"])
def test_gpu_target_logits_emit_the_target_distribution(draft_name):
    """The engine's sampled verification on the GPU (`TargetLogits`: `logsumexp_rows`, the fused correction / bonus
    draw `residual_sample`): the first emitted token follows the target row, the bonus token after an accepted draft
    the next row (chi-square at 1e-3, the TV bound), with zeros in the target's support (logits -inf)."""
    from deepinfer_kernels.sampling import logsumexp_rows

    p, bonus = TARGET[2], TARGET[0]
    q = DRAFTS[draft_name](p)
    n, dev = N_REQUESTS, "cuda"
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(11))[:, None]
    logits = torch.log(torch.stack([p, bonus])).repeat(n, 1).to(dev)  # rows: position 0, bonus; log 0 = -inf
    temps = torch.ones(2 * n, device=dev)
    target = TargetLogits(logits=logits, temperature=temps, lse=logsumexp_rows(logits, temps))
    proposal = DraftProposal(draft_ids=drafts.to(dev), draft_probs=q.expand(n, 1, V).contiguous().to(dev))
    u = verify_uniforms(torch.ones(n, dtype=torch.int64), 1, torch.Generator().manual_seed(3)).to(dev)
    r = verify(target, proposal, [1] * n, greedy=False, uniforms=u, argmax=logits.argmax(-1), accept_prob=False)
    out, acc = r.output_ids.cpu(), r.num_accepted.cpu()
    for counts, want in ((torch.bincount(out[:, 0], minlength=V), p),
                         (torch.bincount(out[acc == 1, 1], minlength=V), bonus)):
        if int(counts.sum()) < 2_000:  # a draft the target never accepts: no bonus draws to test
            continue
        stat, df = _chi2(counts, want)
        assert stat < CHI2_CRIT_1E3[df], (draft_name, counts.tolist(), stat)
        if int(counts.sum()) >= N_REQUESTS // 2:  # the TV bound is stated for about N_REQUESTS draws
            assert _tv(counts, want) < TV_BOUND, (draft_name, counts.tolist())
    assert abs(float(acc.double().mean()) - float(torch.minimum(p, q).sum())) < 0.015


def test_the_statistical_check_detects_a_biased_sampler():
    # Power of the check above: emitting the very wrong draft unchecked must fail it by far.
    p = TARGET[0]
    q = DRAFTS["very_wrong"](p)
    draws = torch.multinomial(q, N_REQUESTS, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=V)
    stat, df = _chi2(counts, p)
    assert stat > 100 * CHI2_CRIT_1E3[df]
    assert _tv(counts, p) > TV_BOUND


# ---------------------------------------------------------------------------------------------------------------
# reproducibility, batch independence, mixed batches
# ---------------------------------------------------------------------------------------------------------------
def _random_case(batch: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, width + 1, (batch,), generator=g)
    target = torch.softmax(torch.randn(int((m + 1).sum()), V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(batch, width, V, generator=g) * 2, -1)
    drafts = torch.stack([torch.multinomial(q[b], 1, generator=g).squeeze(-1) for b in range(batch)])
    return target, drafts, q, m


def test_reproducible_with_seeded_generators():
    target, drafts, q, m = _random_case(8, 4, seed=3)
    a = rejection_accept(target, drafts, q, m, generator=torch.Generator().manual_seed(9))
    b = rejection_accept(target, drafts, q, m, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.num_accepted, b.num_accepted)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(8)]
    c = rejection_accept(target, drafts, q, m, generator=gens)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(8)]
    d = rejection_accept(target, drafts, q, m, generator=gens)
    assert torch.equal(c.output_ids, d.output_ids)


def test_per_request_generators_make_results_batch_independent():
    target, drafts, q, m = _random_case(6, 3, seed=4)
    together = rejection_accept(target, drafts, q, m, generator=[torch.Generator().manual_seed(i) for i in range(6)])
    starts = torch.cumsum(m + 1, 0) - (m + 1)
    for b in range(6):
        rows = target[starts[b] : starts[b] + m[b] + 1]
        # Alone, and with a narrower draft tensor: only the request's own m matters.
        k = int(m[b])
        alone = rejection_accept(rows, drafts[b : b + 1, :k], q[b : b + 1, :k], [k],
                                 generator=[torch.Generator().manual_seed(b)])
        assert alone.tokens()[0] == together.tokens()[b]


def test_uniforms_from_verify_uniforms_match_generator_path():
    target, drafts, q, m = _random_case(5, 3, seed=8)
    u = verify_uniforms(m, 3, [torch.Generator().manual_seed(i) for i in range(5)])
    a = rejection_accept(target, drafts, q, m, uniforms=u)
    b = rejection_accept(target, drafts, q, m, generator=[torch.Generator().manual_seed(i) for i in range(5)])
    assert torch.equal(a.output_ids, b.output_ids)


def test_verify_mixed_greedy_and_sampled():
    target, drafts, q, m = _random_case(6, 3, seed=11)
    greedy = torch.tensor([True, False, True, False, False, True])
    proposal = DraftProposal(draft_ids=drafts, draft_probs=q)
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    r = verify(target, proposal, m, greedy=greedy, generators=gens)
    g = greedy_accept(target, drafts, m)
    starts = torch.cumsum(m + 1, 0) - (m + 1)
    for b in range(6):
        if greedy[b]:
            assert r.tokens()[b] == g.tokens()[b]
        else:
            rows = target[starts[b] : starts[b] + m[b] + 1]
            alone = rejection_accept(rows, drafts[b : b + 1], q[b : b + 1], [int(m[b])],
                                     generator=[torch.Generator().manual_seed(b)])
            assert r.tokens()[b] == alone.tokens()[0]
    assert verify(target, DraftProposal(draft_ids=drafts), m, greedy=True).tokens() == g.tokens()
    with pytest.raises(DSparkInputError, match="draft_probs"):
        verify(target, DraftProposal(draft_ids=drafts), m, greedy=False)


def test_verify_with_host_inputs_and_given_argmax_matches_the_plain_call():
    # the engine's form: num_drafts / greedy flags on the host, the target argmax precomputed, no id check
    target, drafts, q, m = _random_case(6, 3, seed=12)
    greedy = [True, False, True, False, False, True]
    proposal = DraftProposal(draft_ids=drafts, draft_probs=q)
    u = verify_uniforms(m, 3, [torch.Generator().manual_seed(i) for i in range(6)])
    ref = verify(target, proposal, m.tolist(), greedy=torch.tensor(greedy), uniforms=u)
    got = verify(target, proposal, m, greedy=greedy, uniforms=u, argmax=target.argmax(-1), check_ids=False)
    assert torch.equal(ref.output_ids, got.output_ids) and torch.equal(ref.num_accepted, got.num_accepted)
    assert torch.equal(ref.accept_prob, got.accept_prob)
    g = greedy_accept(target, drafts, m)
    assert verify(target, DraftProposal(draft_ids=drafts), m, greedy=True, argmax=target.argmax(-1)).tokens() == g.tokens()
    # the greedy path (argmax of the varlen rows) equals the argmax of the padded rows, by hand
    starts = (torch.cumsum(m + 1, 0) - (m + 1)).tolist()
    for b in range(6):
        best = [int(target[starts[b] + j].argmax()) for j in range(int(m[b]) + 1)]
        a = 0
        while a < int(m[b]) and int(drafts[b, a]) == best[a]:
            a += 1
        assert g.tokens()[b] == best[: a + 1]
    with pytest.raises(DSparkInputError, match="argmax"):
        verify(target, proposal, m, greedy=True, argmax=target.argmax(-1)[:-1])
    # the counts and row index built on the host (`row_plan`) and handed over as the plan: the same result, the
    # counts still checked against the draft width and the target's rows
    mp, index, rows = row_plan(m.numpy(), 3)
    assert rows == target.shape[0] and index.tolist() == [
        [s + min(j, int(k)) for j in range(4)] for s, k in zip(starts, m.tolist())]
    plan = (torch.from_numpy(mp), torch.from_numpy(index))
    planned = verify(target, proposal, m.numpy(), greedy=torch.tensor(greedy), uniforms=u, plan=plan)
    assert torch.equal(ref.output_ids, planned.output_ids) and torch.equal(ref.num_accepted, planned.num_accepted)
    with pytest.raises(DSparkInputError, match="rows"):
        verify(target[:-1], proposal, m.numpy(), greedy=True, plan=plan)
    with pytest.raises(DSparkInputError, match="values in"):
        verify(target, proposal, (m + 3).numpy(), greedy=True, plan=plan)
    with pytest.raises(DSparkInputError, match="plan"):
        verify(target, proposal, m.numpy(), greedy=True, plan=(plan[0][:-1], plan[1]))


class Largest(TorchDispatchMode):
    """Records the largest tensor any op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_sampled_verify_reads_only_the_rows_it_needs_and_accept_prob_is_optional():
    """Sampled verification gathers one value per (request, draft) and one row per request, never a copy of every
    (request, position) row: no op makes a tensor of B x (N + 1) vocabulary rows. accept_prob=False drops the
    statistics' [B, N, V] pass and changes no token."""
    batch, width, vocab = 4, 5, 64
    m = torch.tensor([0, 1, 2, 5])
    rows = int((m + 1).sum())  # 12 of the 24 padded (request, position) rows
    g = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(rows, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(batch, width, vocab, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, width)
    proposal = DraftProposal(draft_ids=drafts, draft_probs=q)
    u = verify_uniforms(m, width, [torch.Generator().manual_seed(i) for i in range(batch)])
    for greedy in ([False] * batch, [True, False, False, True]):
        full = verify(target, proposal, m.tolist(), greedy=torch.tensor(greedy), uniforms=u)
        with Largest() as seen:
            lean = verify(target, proposal, m.tolist(), greedy=torch.tensor(greedy), uniforms=u, accept_prob=False)
        assert seen.numel < batch * (width + 1) * vocab and seen.numel <= rows * vocab
        assert torch.equal(full.output_ids, lean.output_ids) and torch.equal(full.num_accepted, lean.num_accepted)
        assert lean.accept_prob is None and full.accept_prob is not None
    # accept_prob is still the analytic sum_v min(p, q) at verified positions
    starts = (torch.cumsum(m + 1, 0) - (m + 1)).tolist()
    want = torch.zeros(batch, width)
    for b in range(batch):
        for j in range(int(m[b])):
            want[b, j] = torch.minimum(target[starts[b] + j], q[b, j]).sum()
    torch.testing.assert_close(verify(target, proposal, m, greedy=False, uniforms=u).accept_prob, want)


def test_target_logits_give_the_probabilities_results_without_a_distribution_of_every_row():
    """`TargetLogits` (the engine's sampled rounds without top-k / top-p / min-p): the same tokens and counts as the
    softmax of every row at the same uniforms, mixed greedy rows included, the analytic accept_prob within fp32
    rounding; and verification writes no [R, V] tensor (only the B correction rows are softmaxed)."""
    batch, width, vocab = 6, 5, 300
    g = torch.Generator().manual_seed(7)
    m = torch.tensor([5, 0, 3, 5, 2, 1])
    rows = int((m + 1).sum())
    logits = 3 * torch.randn(rows, vocab, generator=g)
    temps = torch.tensor([1.0, 0.6, 1.4, 1.0, 0.8, 2.0]).repeat_interleave(m + 1)
    probs = torch.softmax(logits / temps[:, None], -1)
    q = torch.softmax(torch.randn(batch, width, vocab, generator=g), -1)
    # drafts that the target likes, so that long accepted prefixes occur
    drafts = torch.stack([probs[torch.clamp(torch.arange(width) + int(s), max=int(s + k))].argmax(-1)
                          for s, k in zip(torch.cumsum(m + 1, 0) - (m + 1), m)])
    proposal = DraftProposal(draft_ids=drafts, draft_probs=q)
    lse = torch.logsumexp(logits / temps[:, None], -1)
    target = TargetLogits(logits=logits, temperature=temps, lse=lse)
    for seed in range(20):
        u = verify_uniforms(m, width, torch.Generator().manual_seed(seed))
        for greedy in ([False] * batch, [True, False, False, True, False, True]):
            want = verify(probs, proposal, m.tolist(), greedy=torch.tensor(greedy), uniforms=u)
            got = verify(target, proposal, m.tolist(), greedy=torch.tensor(greedy), uniforms=u,
                         argmax=logits.argmax(-1))
            assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.output_ids, want.output_ids)
            torch.testing.assert_close(got.accept_prob, want.accept_prob)
    assert int(want.num_accepted.max()) >= 2
    with Largest() as seen:
        verify(target, proposal, m.tolist(), greedy=False, uniforms=u, accept_prob=False)
    assert seen.numel <= batch * vocab < rows * vocab


def test_zero_drafts_samples_from_target_row():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    r = rejection_accept(p, torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, V), [0],
                         generator=torch.Generator().manual_seed(0))
    assert r.tokens() == [[2]]


def test_probs_from_logits():
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 4.0]], [[0.0, 0.0, 0.0, 0.0, 0.0]]])
    p = probs_from_logits(logits, torch.tensor([0.5, 2.0]))
    assert torch.allclose(p[0, 0], torch.softmax(logits[0, 0] / 0.5, -1))
    assert torch.allclose(p[1, 0], torch.full((V,), 0.2))
    with pytest.raises(DSparkInputError, match="temperature"):
        probs_from_logits(logits, 0.0)


def test_typed_errors():
    target, drafts, q, m = _random_case(3, 2, seed=1)
    with pytest.raises(DSparkInputError, match="rows"):
        greedy_accept(target[:-1], drafts, m)
    with pytest.raises(DSparkInputError, match="num_drafts"):
        greedy_accept(target, drafts, [3, 0, 0])
    with pytest.raises(DSparkInputError, match="num_drafts"):
        greedy_accept(target, drafts, [1, 1])
    with pytest.raises(DSparkInputError, match="draft_probs"):
        rejection_accept(target, drafts, q[:, :1], m)
    with pytest.raises(DSparkInputError, match="draft_ids"):
        rejection_accept(target, drafts.float(), q, m)
    with pytest.raises(DSparkInputError, match="uniforms"):
        rejection_accept(target, drafts, q, m, uniforms=torch.zeros(3, 2))
    with pytest.raises(DSparkInputError, match="generator"):
        rejection_accept(target, drafts, q, m, generator=[torch.Generator()])
    bad = drafts.clone()
    bad[m > 0, 0] = V
    if bool((m > 0).any()):
        with pytest.raises(DSparkInputError, match="draft_ids"):
            rejection_accept(target, bad, q, m)
