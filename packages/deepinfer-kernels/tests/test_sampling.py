"""Sampling reference: masks vs. naive per-row formulas, penalties vs. a Python loop, seeded noise properties,
exponential-race frequencies vs. the target distribution, and batch-composition independence."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels.sampling import apply_penalties, counter_uniform, logprobs_topk, mask_logits, sample


def _rows(n: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2.0


def test_counter_uniform_top_value_stays_below_one() -> None:
    # this key's column 54310 hashes to the top 24-bit value, whose centre 1 - 2**-25 rounds to 1.0 in float32
    u = counter_uniform(torch.tensor([2838760209921152440]), torch.tensor([0]), 129280)
    assert float(u[0, 54310]) == 1.0 - 2.0**-24 and bool((u < 1).all())
    logits = torch.zeros(1, 129280)
    logits[0, :3] = 5.0
    tok = sample(logits, temperature=torch.ones(1), top_k=torch.tensor([3]), top_p=torch.ones(1),
                 min_p=torch.zeros(1), seeds=torch.tensor([2838760209921152440]), offsets=torch.tensor([0]))
    assert int(tok) < 3  # never a masked token


def test_counter_uniform_is_open_unit_interval_deterministic_and_keyed() -> None:
    seeds = torch.tensor([0, 1, -5, 2**62 + 3], dtype=torch.int64)
    offs = torch.tensor([0, 0, 7, 123456], dtype=torch.int64)
    u = counter_uniform(seeds, offs, 4096)
    assert u.shape == (4, 4096) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, counter_uniform(seeds, offs, 4096))
    # distinct keys give different streams; a different offset changes the stream
    assert not torch.equal(u[0], u[1])
    u2 = counter_uniform(seeds, offs + 1, 4096)
    assert (u2 != u).float().mean() > 0.99
    # roughly uniform: mean 1/2, variance 1/12, 10 equal bins within 15% of the expected count
    flat = counter_uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1024).flatten()
    assert abs(flat.mean().item() - 0.5) < 0.01
    assert abs(flat.var().item() - 1 / 12) < 0.005
    hist = torch.histc(flat, bins=10, min=0, max=1)
    assert bool(((hist - flat.numel() / 10).abs() < 0.15 * flat.numel() / 10).all())


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = _rows(5, 50)
    top_k = torch.tensor([1, 3, 0, 50, 99])
    out = mask_logits(logits, top_k=top_k, top_p=torch.ones(5), min_p=torch.zeros(5))
    for i, k in enumerate([1, 3, 50, 50, 50]):
        kept = torch.isfinite(out[i])
        assert int(kept.sum()) == k
        assert set(kept.nonzero().flatten().tolist()) == set(logits[i].topk(k).indices.tolist())
        assert torch.equal(out[i][kept], logits[i][kept])


def test_top_p_matches_naive_prefix_rule() -> None:
    logits = _rows(6, 40, seed=3)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
    out = mask_logits(logits, top_k=torch.zeros(6, dtype=torch.int64), top_p=top_p, min_p=torch.zeros(6))
    for i in range(6):
        probs = torch.softmax(logits[i].double(), -1).tolist()
        order = sorted(range(40), key=lambda j: -probs[j])
        keep, mass = [], 0.0
        for j in order:
            if keep and mass >= top_p[i].item():
                break
            keep.append(j)
            mass += probs[j]
        assert set(torch.isfinite(out[i]).nonzero().flatten().tolist()) == set(keep), i


def test_min_p_matches_naive_ratio_rule() -> None:
    logits = _rows(4, 30, seed=4)
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    out = mask_logits(logits, top_k=torch.zeros(4, dtype=torch.int64), top_p=torch.ones(4), min_p=min_p)
    for i in range(4):
        probs = torch.softmax(logits[i].double(), -1)
        expect = set((probs >= min_p[i].item() * probs.max()).nonzero().flatten().tolist())
        assert set(torch.isfinite(out[i]).nonzero().flatten().tolist()) == expect


def test_penalties_match_python_loop() -> None:
    logits = _rows(3, 12, seed=5)
    prompt = torch.tensor([[1, 2, -1], [3, 3, 3], [-1, -1, -1]])
    output = torch.tensor([[2, 2, 5, -1], [0, -1, -1, -1], [7, 8, 7, 7]])
    rep = torch.tensor([1.3, 1.0, 2.0])
    pres = torch.tensor([0.5, 0.0, -0.25])
    freq = torch.tensor([0.1, 0.7, 0.2])
    got = apply_penalties(logits, prompt_ids=prompt, output_ids=output, repetition_penalty=rep,
                          presence_penalty=pres, frequency_penalty=freq)
    for i in range(3):
        p = [t for t in prompt[i].tolist() if t >= 0]
        o = [t for t in output[i].tolist() if t >= 0]
        for v in range(12):
            x = logits[i, v].item()
            if v in p or v in o:
                x = x / rep[i].item() if x > 0 else x * rep[i].item()
            x -= freq[i].item() * o.count(v)
            x -= pres[i].item() * (1 if v in o else 0)
            assert got[i, v].item() == pytest.approx(x, abs=1e-5)


def _params(n: int, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    return dict(temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.int64),
                top_p=torch.ones(n), min_p=torch.zeros(n))


def test_greedy_rows_are_argmax_and_ignore_noise() -> None:
    logits = _rows(4, 100, seed=6)
    p = _params(4, 0.0)
    a = sample(logits, **p, seeds=torch.arange(4), offsets=torch.zeros(4, dtype=torch.int64))
    b = sample(logits, **p, seeds=torch.arange(4) + 99, offsets=torch.arange(4))
    assert torch.equal(a, logits.argmax(-1)) and torch.equal(a, b)


def test_exponential_race_frequencies_match_distribution() -> None:
    target = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    n = 20000
    logits = target.log().expand(n, -1).contiguous()
    toks = sample(logits, **_params(n), seeds=torch.arange(n) * 7919 + 11, offsets=torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(toks, minlength=5).double() / n
    # 5 sigma of a binomial proportion
    tol = 5 * torch.sqrt(target.double() * (1 - target.double()) / n)
    assert bool(((freq - target.double()).abs() < tol).all()), freq


def test_temperature_top_k_restrict_support() -> None:
    n = 2000
    logits = _rows(1, 20, seed=7).expand(n, -1).contiguous()
    p = _params(n, 5.0)
    p["top_k"] = torch.full((n,), 3, dtype=torch.int64)
    toks = sample(logits, **p, seeds=torch.arange(n), offsets=torch.zeros(n, dtype=torch.int64))
    assert set(toks.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_sampling_is_independent_of_batch_composition() -> None:
    logits = _rows(6, 64, seed=8)
    p = _params(6, 0.8)
    p["top_p"] = torch.full((6,), 0.9)
    seeds = torch.tensor([5, 5, 17, 3, 1000, 5])
    offs = torch.tensor([0, 1, 0, 4, 2, 0])
    full = sample(logits, **p, seeds=seeds, offsets=offs)
    for i in range(6):
        one = sample(logits[i : i + 1], **{k: v[i : i + 1] for k, v in p.items()},
                     seeds=seeds[i : i + 1], offsets=offs[i : i + 1])
        assert one.item() == full[i].item()
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = sample(logits[perm], **{k: v[perm] for k, v in p.items()}, seeds=seeds[perm], offsets=offs[perm])
    assert torch.equal(shuffled, full[perm])


def test_logprobs_topk_matches_log_softmax() -> None:
    logits = _rows(3, 10, seed=9)
    toks = torch.tensor([0, 4, 9])
    chosen, ids, vals, rank = logprobs_topk(logits, toks, 3)
    ref = torch.log_softmax(logits.double(), -1)
    for i in range(3):
        assert chosen[i].item() == pytest.approx(ref[i, toks[i]].item(), abs=1e-5)
        assert ids[i].tolist() == ref[i].topk(3).indices.tolist()
        assert rank[i].item() == 1 + int((ref[i] > ref[i, toks[i]]).sum())
    assert math.isclose(float(vals[0, 0]), float(ref[0].max()), abs_tol=1e-5)


@pytest.mark.gpu
def test_cuda_noise_and_samples_equal_cpu() -> None:
    seeds = torch.tensor([3, 2**40 + 5, -9], dtype=torch.int64)
    offs = torch.tensor([0, 17, 2], dtype=torch.int64)
    u_cpu = counter_uniform(seeds, offs, 1000)
    u_gpu = counter_uniform(seeds.cuda(), offs.cuda(), 1000).cpu()
    assert torch.equal(u_cpu, u_gpu)  # integer hash: bit-identical on every device
    logits = _rows(3, 1000, seed=11)
    p = _params(3, 0.9)
    a = sample(logits, **p, seeds=seeds, offsets=offs)
    b = sample(logits.cuda(), **{k: v.cuda() for k, v in p.items()}, seeds=seeds.cuda(), offsets=offs.cuda())
    assert torch.equal(a, b.cpu())


def test_skipping_masks_equals_masks_that_keep_everything() -> None:
    logits = _rows(8, 300, seed=12)
    p = _params(8, 0.7)
    seeds, offs = torch.arange(8) * 3, torch.arange(8)
    assert torch.equal(sample(logits, **p, seeds=seeds, offsets=offs),
                       sample(logits, **p, seeds=seeds, offsets=offs, apply_masks=False))
