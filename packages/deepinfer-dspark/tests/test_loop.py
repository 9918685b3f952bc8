"""The full propose -> schedule -> verify loop with a toy DraftModel against a toy bigram target: greedy output is
the target's greedy chain token for token, and with temperature 1 the emitted tokens follow the target's
distribution (chi-square at significance 1e-3) for every policy, including the confidence-scheduled ones."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import (
    AcceptanceStats,
    DraftBlock,
    DraftHeads,
    LatencyModel,
    VerifyPolicy,
    probs_from_logits,
    propose,
    schedule_verification,
    verify,
    verify_counter_uniforms,
)

V, N, D, R = 5, 4, 3, 2
# chi-square critical values at significance 1e-3 (standard table): 24 and 4 degrees of freedom
CHI2_CRIT_1E3 = {24: 51.179, 4: 18.467}


class _ToyDrafter:
    """Base logits and hidden states are fixed random functions of (anchor, block position); random Markov head
    and Confidence Head, so confidences depend on the drafted tokens."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self._u = torch.randn(V, N, V, generator=g) * 1.5
        self._h = torch.randn(V, N, D, generator=g)
        self._heads = DraftHeads(markov_embed=torch.randn(V, R, generator=g),
                                 markov_head=torch.randn(V, R, generator=g),
                                 confidence=torch.randn(1, D + R, generator=g) * 2)

    @property
    def block_size(self) -> int:
        return N

    @property
    def heads(self) -> DraftHeads:
        return self._heads

    def draft_block(self, anchor_ids, anchor_positions) -> DraftBlock:
        return DraftBlock(base_logits=self._u[anchor_ids], hidden=self._h[anchor_ids])


def _run(policy: VerifyPolicy, n: int, tokens: int, temperature: float, seed: int = 0):
    """Speculative generation of `tokens` tokens after anchor 0 for n requests; returns ([n, tokens], stats)."""
    g = torch.Generator().manual_seed(100 + seed)
    bigram = torch.randn(V, V, generator=g) * 1.2  # target logits of the next token given the previous one
    drafter = _ToyDrafter(seed)
    latency = LatencyModel.affine(0.2 * n, 1.0, n * (N + 1) + 1)  # heavy load: a draft costs 1/0.2n of a step
    out = torch.full((n, tokens + N + 1), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    anchor, pos = torch.zeros(n, dtype=torch.int64), torch.full((n,), 7, dtype=torch.int64)
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + seed
    temp = torch.full((n,), temperature)
    stats = AcceptanceStats(N)
    while bool((count < tokens).any()):
        prop = propose(drafter, anchor, pos, temperature=temp, seeds=seeds)
        m = schedule_verification(policy, torch.full((n,), N), survival=prop.survival(), latency=latency)
        seq = torch.cat([anchor[:, None], prop.draft_ids], 1)  # rows verify [anchor, d_1 .. d_m]
        rows = bigram[seq][torch.arange(N + 1)[None, :] <= m[:, None]]
        greedy = temperature == 0
        target = rows if greedy else probs_from_logits(rows, temperature)
        res = verify(target, prop, m, greedy=greedy, uniforms=verify_counter_uniforms(seeds, pos, N))
        stats.update(res.num_accepted, m)
        emitted = res.num_accepted + 1
        for k in range(N + 1):
            ok = (k < emitted) & (count + k < out.shape[1])  # finished requests keep drafting, unrecorded
            out[ok, (count + k)[ok]] = res.output_ids[ok, k]
        count += emitted
        anchor, pos = res.next_anchors(), pos + emitted
    return out[:, :tokens], stats, bigram


POLICIES = [VerifyPolicy(kind="verify_all"), VerifyPolicy(kind="threshold", threshold=0.3), VerifyPolicy(kind="cost")]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
def test_greedy_speculation_equals_target_greedy(policy: VerifyPolicy):
    out, stats, bigram = _run(policy, 6, 12, 0.0)
    want, prev = [], 0
    for _ in range(12):
        prev = int(bigram[prev].argmax())
        want.append(prev)
    assert out.tolist() == [want] * 6
    assert stats.num_verified_tokens <= stats.num_draft_tokens


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.kind)
def test_sampled_speculation_follows_the_target(policy: VerifyPolicy):
    n = 20000
    out, stats, bigram = _run(policy, n, 3, 1.0, seed=1)
    p = torch.softmax(bigram.double(), -1)
    joint = p[0][:, None] * p  # P(x1 | anchor 0) P(x2 | x1)
    counts = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).double().view(V, V)
    chi2 = float(((counts - n * joint) ** 2 / (n * joint)).sum())
    assert chi2 < CHI2_CRIT_1E3[24], chi2
    third = (joint.sum(0) @ p)  # P(x3)
    c3 = torch.bincount(out[:, 2], minlength=V).double()
    chi2 = float(((c3 - n * third) ** 2 / (n * third)).sum())
    assert chi2 < CHI2_CRIT_1E3[4], chi2
    if policy.kind != "verify_all":  # the scheduled policies really skip drafts here
        assert stats.num_verified_tokens < 0.95 * stats.num_draft_tokens
    assert stats.mean_accepted_length > 1.0
