"""Speculative decoding in the engine loop (worker/spec_decode.py): lossless greedy output with the checkpoint's
DSpark stages, with V4's MTP block, and with a stand-in drafter that proposes mostly-right drafts (mixed acceptance, rollback of every
cache family, chunked prefill, preemption), the emitted distribution at temperature > 0 against the target's
exact distribution, per-request metrics, and the typed configuration errors."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from deepinfer_dspark import DraftBlock
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.errors import ConfigError
from oracle_drafter import OracleDrafter

PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 20)), [0, 11, 12, 13, 14, 15, 16, 17, 18]]  # mixed lengths


@pytest.fixture(scope="module")
def ckpts(tiny_ckpt) -> dict[str, Path]:
    return {"v41": tiny_ckpt("v41"), "v4-0731": tiny_ckpt("v4", "tiny-dspark")}


def _llm(path: Path, **kw) -> LLM:
    page = 4 if path.name == "v41" else 8  # a multiple of every compress ratio
    return LLM(str(path), device="cpu", dtype="float32", page_size=page, **kw)


def _use_policy(llm: LLM, kind: str) -> None:
    """Switch the running engine's verification policy (one model load serves every policy)."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy

    spec = llm.engine.runner.spec
    spec.policy = VerifyPolicy(kind=kind)
    spec.latency = LatencyModel.affine(0.01, 0.001, 64) if kind == "cost" else None
    spec.online_latency = False
    spec.reset_stats()


def _ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def v41_reference(ckpts) -> list[list[int]]:
    """Plain greedy outputs of PROMPTS on tiny V4.1 (14 tokens; shorter runs are prefixes)."""
    return _ids(_llm(ckpts["v41"]).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
                                            use_tqdm=False))


@pytest.fixture(scope="module")
def v41_spec(ckpts) -> LLM:
    """One speculative engine for the V4.1 tests: a 10-token step budget (prefill chunks beside verify chunks)
    and 12 pages of 4 tokens, too few for the four requests at once (preemption + recompute)."""
    return _llm(ckpts["v41"], max_num_batched_tokens=10, num_kv_pages=12, speculative_config={"method": "dspark"})


def test_statistics_sum_the_survivals_each_request_was_scheduled_by(v41_spec, monkeypatch) -> None:
    """`AcceptanceStats.predicted` (survival calibration, docs/dspark.md) sums, per position, the survival the policy
    ranked each request's verified drafts by: recomputed here from every `schedule_verification` call of the run
    (its survivals and the drafts it chose), with preemption and prefill chunks in the run."""
    import numpy as np
    from deepinfer_engine.worker import spec_decode

    seen = []
    real = spec_decode.schedule_verification

    def spy(policy, max_drafts, **kw):
        m = real(policy, max_drafts, **kw)
        seen.append((np.array(kw["survival"], dtype=np.float64), np.asarray(m)))
        return m

    monkeypatch.setattr(spec_decode, "schedule_verification", spy)
    _use_policy(v41_spec, "threshold")
    v41_spec.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=5), use_tqdm=False)
    stats = v41_spec.engine.runner.spec.stats
    want = sum((np.where(np.arange(a.shape[1])[None, :] < m[:, None], a, 0.0)).sum(0) for a, m in seen)
    assert len(seen) == stats.steps > 0 and stats.num_verified_tokens > 0
    assert stats.predicted == pytest.approx(list(want), rel=1e-12)
    assert stats.as_dict()["predicted_acceptance_by_position"] == pytest.approx(
        [p / v if v else 0.0 for p, v in zip(want, stats.verified)])


def test_greedy_speculation_equals_plain_greedy_with_checkpoint_drafter(ckpts, v41_reference, v41_spec) -> None:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [r[:6] for r in v41_reference]
    for policy in ("verify_all", "threshold", "cost"):
        _use_policy(v41_spec, policy)
        outs = v41_spec.generate(PROMPTS, sp, use_tqdm=False)
        assert _ids(outs) == want, policy
        stats = v41_spec.engine.runner.spec.stats
        assert stats.request_steps > 0 and stats.num_draft_tokens == 5 * stats.request_steps
        m = [o.metrics for o in outs]
        assert sum(x.num_verified_tokens for x in m) == stats.num_verified_tokens
        assert sum(x.num_accepted_tokens for x in m) == stats.num_accepted_tokens
    # V4-0731: V4 backbone (learned hc_head, CSA / HCA) with DSpark stages reading layer outputs
    plain = _ids(_llm(ckpts["v4-0731"]).generate(PROMPTS[:3], sp, use_tqdm=False))
    llm = _llm(ckpts["v4-0731"], max_num_batched_tokens=8, speculative_config={"method": "dspark"})
    assert _ids(llm.generate(PROMPTS[:3], sp, use_tqdm=False)) == plain


def test_draft_ahead_gives_the_tokens_and_counts_of_drafting_in_the_round(ckpts) -> None:
    """`SpecDecoder.draft_ahead` (on with CUDA graphs): the next round's drafts, launched once a round's results are
    read, give the tokens and statistics of drafting in `begin`, with requests leaving the batch at different
    steps (the drafted rows are then selected) and greedy and sampled requests in one batch."""
    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"})
    spec = llm.engine.runner.spec
    sps = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, seed=s)
           for t, n, s in ((0, 14, 1), (0.9, 9, 2), (0.7, 12, 3), (0, 5, 4))]
    runs = {}
    for ahead in (False, True):
        spec.draft_ahead = ahead
        spec.reset_stats()
        outs = llm.generate(PROMPTS, sps, use_tqdm=False)
        t = spec.timing
        runs[ahead] = (_ids(outs), spec.stats.as_dict(), (t.ahead_used, t.ahead_selected, t.ahead_missed))
    assert runs[True][0] == runs[False][0]
    # counts exactly; the confidences up to float rounding: a subset's rows were computed in a larger batch
    got, want = runs[True][1], runs[False][1]
    assert got.keys() == want.keys()
    # the survival bins are left out: float rounding may move a survival across a bin edge, and their totals are the
    # verified and accepted counts and the survival sums compared below
    got.pop("survival_reliability"), want.pop("survival_reliability")
    assert all(got[k] == (pytest.approx(v, rel=1e-6) if v is not None else None) for k, v in want.items()), got
    assert runs[False][2] == (0, 0, 0)
    used, selected, _ = runs[True][2]
    assert used > selected > 0, runs[True][2]  # whole rounds and subsets of them both came from the drafts ahead


def test_round_statistics_are_counted_after_the_next_draft_launch(ckpts) -> None:
    """A round's statistics and calibration update are bookkeeping the next draft pass does not need: they run after
    `launch_ahead` launched it (while a device drafts), not between the round's read and that launch. They are
    complete whenever they are read, and count every round."""
    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"})
    spec = llm.engine.runner.spec
    spec.draft_ahead = True
    events = []
    propose, update, collect = spec._propose, spec._stats.update, spec.collect_verify

    def spy_collect(*a, **kw):
        events.append("read")
        return collect(*a, **kw)

    def spy_propose(*a, **kw):
        events.append("draft")
        return propose(*a, **kw)

    def spy_update(*a, **kw):
        events.append("count")
        return update(*a, **kw)

    spec.collect_verify, spec._propose, spec._stats.update = spy_collect, spy_propose, spy_update
    spec.timing.deferred_s = 0.0
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    rounds = events.count("count")
    assert rounds == spec.stats.steps == spec.timing.rounds > 3 and spec.timing.deferred_s > 0
    # after a round's read, the next round's draft launch comes before the round is counted
    after_read = [events[i + 1: i + 3] for i, e in enumerate(events) if e == "read"]
    assert sum(nxt == ["draft", "count"] for nxt in after_read) >= rounds - 2, events
    assert not any(nxt[:1] == ["count"] for nxt in after_read) and not spec._deferred


def _oracle_run(llm: LLM, prompts, sp, reference) -> list[list[int]]:
    eng = llm.engine
    full = {str(i): list(p) + list(r) for i, (p, r) in enumerate(zip(prompts, reference))}

    def seq_of_slot(slot: int) -> list[int]:
        kv = eng.scheduler.kv
        (rid,) = [r for r in eng.scheduler.requests if r in kv._slots and kv.slot(r) == slot]
        return full[rid]

    eng.runner.spec.drafter = OracleDrafter(int(eng.args.vocab_size), seq_of_slot)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(prompts))], done


def test_greedy_lossless_with_mixed_acceptance_chunked_prefill_and_preemption(v41_reference, v41_spec) -> None:
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    real = v41_spec.engine.runner.spec.drafter
    preempted = v41_spec.engine.scheduler.num_preemptions
    try:
        for policy in ("verify_all", "threshold", "cost"):
            _use_policy(v41_spec, policy)
            got, done = _oracle_run(v41_spec, PROMPTS, sp, v41_reference)
            assert got == v41_reference, policy
            stats = v41_spec.engine.runner.spec.stats
            assert stats.mean_accepted_length > 1.5, stats.as_dict()  # drafts really were accepted
            assert 0 < stats.histogram[0] and sum(stats.histogram[1:]) > 0  # ... and rejected
            m = [o.metrics for o in done.values()]
            assert sum(x.num_accepted_tokens for x in m) == stats.num_accepted_tokens
            assert all(x.mean_accepted_length is None or x.mean_accepted_length >= 1 for x in m)
    finally:
        v41_spec.engine.runner.spec.drafter = real
    assert v41_spec.engine.scheduler.num_preemptions > preempted


def _masked_probs(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    vals, idx = logits.topk(top_k)
    return torch.zeros_like(logits).scatter_(0, idx, torch.softmax(vals, 0))


@pytest.mark.slow  # ~80 s on 2 busy cores: 300 samples, each proposing over the full 129,280-token vocabulary
def test_sampled_speculation_emits_the_target_distribution(ckpts) -> None:
    """(t1, t2) of 240 samples (temperature 1, top_k 3: 9 outcomes) with speculation (the stand-in drafter
    proposes t2 with the wrong probabilities, so acceptance and the residual both occur) against the exact
    target probabilities from the model itself. Pearson chi-square, 8 degrees of freedom, significance 0.001
    (critical value 26.12): the sampler is counter-based, so the outcome is deterministic."""
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch

    llm = _llm(ckpts["v41"], max_num_seqs=60, speculative_config={"method": "dspark"})
    eng = llm.engine
    model = eng.runner.model
    prompt = [0, 21, 22, 23]
    k, n = 3, 240

    def next_probs(ids: list[int]) -> torch.Tensor:
        cache, bt = ModelCache.allocate_dense(model.args, [len(ids) + 1], dtype=torch.float32)
        b = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(len(ids)), query_lens=(len(ids),),
                         slots=(0,), block_tables=bt, logits_indices=torch.tensor([len(ids) - 1]))
        return _masked_probs(model(b, cache)[0].double(), k)

    p1 = next_probs(prompt)
    firsts = p1.nonzero().squeeze(1).tolist()
    expected = {(a, b): float(p1[a] * p2[b]) for a in firsts for p2 in [next_probs(prompt + [a])]
                for b in p2.nonzero().squeeze(1).tolist()}
    cand = {a: sorted({b for (x, b) in expected if x == a}) for a in firsts}

    class Skewed(OracleDrafter):  # drafts t2 from the target's own support, with inverted preferences
        def draft_block(self, anchor_ids, anchor_positions) -> DraftBlock:
            b, nb = anchor_ids.shape[0], self.block_size
            logits = torch.full((b, nb, self.vocab), -30.0)
            for i, g in enumerate(anchor_ids.tolist()):
                for r, tok in enumerate(cand.get(g, [7])):
                    logits[i, :, tok] = float(r)
            return DraftBlock(base_logits=logits, hidden=torch.zeros(b, nb, 2))

    eng.runner.spec.drafter = Skewed(int(eng.args.vocab_size), None)
    (out,) = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True,
                                                   seed=1234), use_tqdm=False)
    counts: dict[tuple[int, int], int] = {}
    for c in out.outputs:
        key = (c.token_ids[0], c.token_ids[1])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(key, 0) - n * p) ** 2 / (n * p) for key, p in expected.items())
    stats = eng.runner.spec.stats
    assert stats.num_verified_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_verified_tokens
    assert len(expected) == 9 and chi2 < 26.12, (chi2, counts, expected)
    assert not math.isnan(chi2)


def test_mtp_speculation_is_lossless_and_drafts_what_the_mtp_block_predicts(tiny_ckpt) -> None:
    """V4 with its MTP block: greedy speculation == plain greedy (chunked prefill, mixed lengths); the draft the
    engine keeps after the last step equals the MTP block run over the whole sequence in one forward (the
    pure-torch path: full target forward, then forward_mtp over positions 1 .. L), within fp32 reordering."""
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch

    path = tiny_ckpt("v4")
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = _ids(_llm(path).generate(PROMPTS[:3], sp, use_tqdm=False))
    # no prefix cache: the second call below must recompute PROMPTS[2] so that the MTP block's own ring is fed
    # from position 0 (a prefix hit restores the MTP ring too: tests/worker/test_spec_prefix_cache.py)
    llm = _llm(path, max_num_batched_tokens=8, speculative_config={"method": "mtp"}, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS[:3], sp, use_tqdm=False)
    assert _ids(outs) == plain
    stats = llm.engine.runner.spec.stats
    assert stats.request_steps > 0 and stats.num_verified_tokens == stats.request_steps  # one draft per round

    model, drafter = llm.engine.runner.model, llm.engine.runner.spec.drafter
    drafter._pending.clear()
    (out,) = llm.generate([PROMPTS[2]], sp, use_tqdm=False)
    seq = PROMPTS[2] + list(out.outputs[0].token_ids)
    ((pos, got),) = drafter._pending.values()
    assert pos == len(seq) - 1
    L = len(seq)
    cache, bt = ModelCache.allocate_dense(model.args, [L + 1], dtype=torch.float32)
    full = ForwardBatch(input_ids=torch.tensor(seq), positions=torch.arange(L), query_lens=(L,), slots=(0,),
                        block_tables=bt, logits_indices=torch.tensor([L - 1]))
    hidden = model.forward_features(full, cache).hidden
    cache, bt = ModelCache.allocate_dense(model.args, [L + 1], dtype=torch.float32)
    mtp = ForwardBatch(input_ids=torch.tensor(seq[1:]), positions=torch.arange(1, L), query_lens=(L - 1,),
                       slots=(0,), block_tables=bt, logits_indices=torch.tensor([L - 2]))
    want = model.forward_mtp(mtp, cache, hidden[: L - 1], 0)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_speculation_config_errors(ckpts, tiny_ckpt) -> None:
    with pytest.raises(ConfigError, match="without a V4 MTP block"):
        _llm(ckpts["v41"], speculative_config={"method": "mtp"})
    with pytest.raises(ConfigError, match="dspark_block_size"):
        _llm(ckpts["v41"], speculative_config={"method": "dspark", "num_speculative_tokens": 9})
    with pytest.raises(ConfigError, match="speculative_latency"):
        _llm(ckpts["v41"], speculative_config={"method": "dspark", "latency": "affine:x"})
    v4 = tiny_ckpt("v4")
    with pytest.raises(ConfigError, match="without DSpark draft stages"):
        _llm(v4, speculative_config={"method": "dspark"})
    with pytest.raises(ConfigError, match="no Confidence Head"):
        _llm(v4, speculative_config={"method": "mtp", "policy": "cost"})


def test_bench_reports_speculative_statistics(ckpts) -> None:
    from deepinfer_engine.bench import format_result, throughput

    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"})
    r = throughput(llm, num_prompts=2, input_len=4, output_len=4)
    spec = r["speculative"]
    assert spec["policy"] == "verify_all" and spec["num_verified_tokens"] > 0
    assert spec["mean_accepted_length"] >= 1 and spec["request_steps"] > 0
    assert "Mean accepted length" in format_result(r)
    # the random checkpoint's head predicts something; the report shows predicted over accepted drafts when any
    # draft was accepted (random drafts rarely are)
    assert len(spec["predicted_acceptance_by_position"]) == 5
    assert ("Predicted/accepted drafts" in format_result(r)) == (spec["survival_calibration"] is not None)
    assert "speculative" not in throughput(_llm(ckpts["v41"]), num_prompts=1, input_len=4, output_len=2)


def test_non_finite_verify_logits_fail_only_that_request(v41_spec) -> None:
    model = v41_spec.engine.runner.model
    orig = model.forward_features
    calls = []

    def poisoned(batch, cache, capture=()):
        out = orig(batch, cache, capture=capture)
        calls.append(batch.query_lens)
        if len(calls) == 2:  # the first verify step (the first call is the prefill)
            out.logits = torch.full_like(out.logits, float("nan"))
        return out

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    model.forward_features = poisoned
    try:
        (out,) = v41_spec.generate([PROMPTS[0]], sp, use_tqdm=False)
    finally:
        del model.forward_features
    assert out.outputs[0].finish_reason == "error" and "not finite" in out.error
    assert calls[1] != calls[0]  # the poisoned step was a verify step after the prefill
    (again,) = v41_spec.generate([PROMPTS[0]], sp, use_tqdm=False)  # the engine stays usable
    assert again.error is None and len(again.outputs[0].token_ids) == 6


def test_shipped_greedy_confidence_head_is_loaded_per_row_and_stays_lossless(tmp_path, ckpts, v41_reference) -> None:
    """dspark_confidence.safetensors (a greedy head + its STS set) and dspark_sts.json beside the weights: the drafter
    scores greedy requests with that head, sampled ones with the checkpoint's head; greedy output is unchanged.
    A head of the wrong size is a ConfigError."""
    import json

    from safetensors.torch import save_file

    path = Path(shutil.copytree(ckpts["v41"], tmp_path / "v41"))  # a copy: the heads are written beside it
    text = json.loads((path / "config.json").read_text())["text_config"]
    width = text["hidden_size"] + text["dspark_markov_rank"]  # the Confidence Head reads [h ; e]
    head = torch.linspace(-1, 1, width).reshape(1, width)
    save_file({"greedy": head, "greedy_sts": torch.tensor([1.0, 2.0])}, str(path / "dspark_confidence.safetensors"))
    (path / "dspark_sts.json").write_text(json.dumps({"sampling": [0.5, 0.75], "greedy": 3.0}))
    llm = _llm(path, speculative_config={"method": "dspark", "policy": "threshold", "threshold": 0.3})
    heads = llm.engine.runner.spec.drafter.heads
    assert torch.equal(heads.greedy_confidence.cpu(), head) and heads.greedy_sts == (1.0, 2.0)
    assert heads.sts == (0.5, 0.75)  # the json's greedy set belongs to the checkpoint's head: replaced here
    out = _ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False))
    assert out == v41_reference
    assert llm.engine.runner.spec.stats.num_verified_tokens > 0
    save_file({"greedy": torch.zeros(1, width + 1)}, str(path / "dspark_confidence.safetensors"))
    with pytest.raises(ConfigError, match="Confidence Head calibration"):
        _llm(path, speculative_config={"method": "dspark"})


def test_cost_policy_explores_large_verify_steps(v41_reference, v41_spec) -> None:
    """A start-up curve that overstates large verify steps (here: 10 s per verified token) makes the cost policy
    verify almost nothing, and the online correction alone only sees the small steps it picks: every
    explore_every-th round verifies every draft instead. Outputs stay lossless either way."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy

    spec = v41_spec.engine.runner.spec
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    verified = {}
    try:
        for every in (0, 2):
            spec.set_policy(VerifyPolicy(kind="cost"), LatencyModel.affine(0.001, 10.0, 64), online_latency=True)
            spec.explore_every, explored = every, spec.explored
            spec.reset_stats()
            assert _ids(v41_spec.generate(PROMPTS, sp, use_tqdm=False)) == v41_reference
            verified[every] = spec.stats.num_verified_tokens
            assert (spec.explored > explored) == (every > 0)
    finally:
        spec.explore_every = 32
        _use_policy(v41_spec, "verify_all")
    assert verified[2] > verified[0], verified


def test_cost_policy_verifies_all_on_a_flat_noisy_curve_and_times_its_rounds(v41_reference, v41_spec) -> None:
    """A start-up curve flat within its noise (the H200 failure: ~100 ms of launch overhead at every size) verifies
    every draft, as verify_all does; the online correction learns the draft pass as the curve's overhead (its
    level), and the rounds' host timing adds up."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy

    spec = v41_spec.engine.runner.spec
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    verified = {}
    try:
        # a first run warms the engine's prefix cache: with 12 pages for 4 requests (preemption), the steps and so
        # the drafts verified depend on what it holds, and both measured runs must start from the same state
        for name in ("warm", "verify_all", "cost"):
            if name == "cost":
                flat = LatencyModel([1, 8, 64], [0.111, 0.090, 0.145], noise=0.05)  # wide: CPU steps under load
                assert flat.flat()
                spec.set_policy(VerifyPolicy(kind="cost"), flat, online_latency=True)
            else:
                _use_policy(v41_spec, "verify_all")
            spec.reset_stats()
            assert _ids(v41_spec.generate(PROMPTS, sp, use_tqdm=False)) == v41_reference
            verified[name] = spec.stats.num_verified_tokens
            t = spec.timing
            assert t.rounds == spec.stats.steps > 0 and min(t.draft_s, t.verify_s, t.finish_s) > 0
            # the drafts' host read and the policy's host time are parts of the draft span
            assert 0 < t.policy_s < t.draft_s and 0 < t.drafted_s < t.draft_s
            # every timed round is in the per-size split, and the split sums to the verify span
            assert sum(c for c, _ in t.by_rows.values()) == t.rounds
            assert abs(sum(s for _, s in t.by_rows.values()) - t.verify_s) < 1e-9
        assert spec.latency.overhead > 0 and spec.latency.observations == spec.stats.steps
        # on the CPU the forward is host work: no floor under it
        assert spec.latency.floor == 0.0 and spec.latency.floor_observations == 0
    finally:
        _use_policy(v41_spec, "verify_all")
    assert verified["cost"] == verified["verify_all"], verified


@pytest.mark.parametrize("every", [1, 3])
def test_lagged_cost_policy_allocates_the_previous_rounds_budget(v41_reference, v41_spec, monkeypatch, every) -> None:
    """The engine's cost policy runs lagged: a round with sampled rows allocates (the top K by its own survivals)
    the budget K that the global argmax gave on an earlier such round's survivals; an all-greedy round verifies
    its drafts above the survival cutoff (`cost_cutoff`) searched on an earlier all-greedy round. Both are computed
    after that round's launch; only a round without one for its class, or whose shape (requests, other tokens, graph
    bucket) changed, runs the search itself. The search prices the survivals through the online calibration, which
    learns from every draft the cost rounds verified, per class. With BUDGET_EVERY > 1 a value serves the rounds
    after it until the next search or a change of shape. A mixed batch (two greedy, two sampled requests): the
    greedy ones' output stays the target's."""
    from deepinfer_dspark import LatencyModel, SurvivalCalibration, VerifyPolicy
    from deepinfer_engine.worker import spec_decode

    spec = v41_spec.engine.runner.spec
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=3)
    params = [greedy, sampled, greedy, sampled]
    calls = {"in_round": 0, "greedy_in_round": 0, "budgets": [], "cutoffs": [], "allocated": [], "above": [],
             "applied": []}
    kept = spec.calibration
    spec.calibration = SurvivalCalibration(decay=1.0)
    apply, map_values = spec.calibration.apply, spec.calibration.map
    search, budget, top_k = spec_decode.schedule_verification, spec_decode.cost_budget, spec_decode.allocate
    cutoff, above = spec_decode.cost_cutoff, spec_decode.allocate_above

    def spy_apply(*a, **kw):  # a mixed batch's survivals, both classes
        calls["applied"].append(apply(*a, **kw))
        return calls["applied"][-1]

    def spy_map(*a, **kw):  # a one-class batch's ranked survivals
        calls["applied"].append(map_values(*a, **kw))
        return calls["applied"][-1]

    def spy_search(policy, *a, **kw):
        calls["in_round"] += policy.kind == "cost"
        calls["greedy_in_round"] += policy.kind == "cost" and kw["deterministic"]
        return search(policy, *a, **kw)

    def spy_budget(*a, **kw):  # next_budget's global argmax (rounds with sampled rows)
        assert kw["exact"] is False
        calls["budgets"].append(budget(*a, **kw))
        return calls["budgets"][-1]

    def spy_cutoff(*a, **kw):  # next_budget's cutoff (all-greedy rounds)
        calls["cutoffs"].append(cutoff(*a, **kw))
        return calls["cutoffs"][-1]

    def spy_top_k(survival, max_drafts, k):
        calls["allocated"].append(k)
        return top_k(survival, max_drafts, k)

    def spy_above(survival, max_drafts, c):
        calls["above"].append(c)
        return above(survival, max_drafts, c)

    for name, spy in (("schedule_verification", spy_search), ("cost_budget", spy_budget), ("allocate", spy_top_k),
                      ("cost_cutoff", spy_cutoff), ("allocate_above", spy_above)):
        monkeypatch.setattr(spec_decode, name, spy)
    monkeypatch.setattr(spec.calibration, "apply", spy_apply)
    monkeypatch.setattr(spec.calibration, "map", spy_map)
    monkeypatch.setattr(spec_decode, "CALIBRATE_EVERY", 1)
    monkeypatch.setattr(spec_decode, "BUDGET_EVERY", every)
    try:
        spec.set_policy(VerifyPolicy(kind="cost", lagged=True), LatencyModel.affine(0.001, 2e-4, 64),
                        online_latency=False)
        spec.explore_every = 0
        spec.reset_stats()
        got = _ids(v41_spec.generate(PROMPTS, params, use_tqdm=False))
        assert [got[0], got[2]] == [v41_reference[0], v41_reference[2]]
        rounds = spec.stats.steps
        # each round either searches in the round or applies a carried value of its class
        assert calls["in_round"] + len(calls["allocated"]) + len(calls["above"]) == rounds
        greedy_rounds = calls["greedy_in_round"] + len(calls["above"])
        sampled_rounds = rounds - greedy_rounds
        assert calls["allocated"] and calls["above"]  # both classes carried a value
        assert calls["in_round"] - calls["greedy_in_round"] >= 1 and calls["greedy_in_round"] >= 1  # first rounds
        for searched, n in ((calls["budgets"], sampled_rounds), (calls["cutoffs"], greedy_rounds)):
            assert len(searched) == n if every == 1 else 0 < len(searched) < n
        assert set(calls["allocated"]) <= set(calls["budgets"]) and set(calls["above"]) <= set(calls["cutoffs"])
        assert spec.timing.lag_s > 0
        assert len(calls["applied"]) >= len(calls["budgets"])  # every search prices through the map
        assert spec.calibration.drafts.sum() == spec.stats.num_verified_tokens > 0
        assert min(spec.calibration.drafts.sum(1)) > 0  # both classes learned
    finally:
        spec.calibration = kept
        spec.explore_every = 32
        _use_policy(v41_spec, "verify_all")


def test_greedy_rounds_of_the_lagged_cost_policy_carry_a_cutoff_not_a_count(v41_reference, v41_spec,
                                                                            monkeypatch) -> None:
    """A round whose requests are all greedy verifies the drafts above the survival cutoff an earlier greedy round
    searched (`cost_cutoff`, priced through the greedy calibration), so the count follows the round's own
    survivals: a planted count is ignored, a planted cutoff of 0 verifies every draft and one past every
    survival none, and the output stays the target's whatever the cutoff."""
    from deepinfer_dspark import LatencyModel, SurvivalCalibration, VerifyPolicy
    from deepinfer_engine.worker import spec_decode

    spec = v41_spec.engine.runner.spec
    seen = {"search": [], "cutoff": [], "above": []}
    search, cutoff, above = spec_decode.schedule_verification, spec_decode.cost_cutoff, spec_decode.allocate_above

    def spy_search(policy, *a, **kw):
        if policy.kind == "cost":
            seen["search"].append((kw["deterministic"], kw["price"] is not None))
        return search(policy, *a, **kw)

    def spy_cutoff(*a, **kw):
        seen["cutoff"].append(kw["price"] is not None)
        return cutoff(*a, **kw)

    def spy_above(survival, max_drafts, c):
        got = above(survival, max_drafts, c)
        seen["above"].append((c, got.tolist(), [int(x) for x in max_drafts]))
        return got

    def no_allocate(*a, **kw):
        raise AssertionError("a greedy round allocated a carried count")

    def no_budget(*a, **kw):
        raise AssertionError("a greedy round searched a count for later rounds")

    monkeypatch.setattr(spec_decode, "schedule_verification", spy_search)
    monkeypatch.setattr(spec_decode, "cost_cutoff", spy_cutoff)
    monkeypatch.setattr(spec_decode, "allocate_above", spy_above)
    monkeypatch.setattr(spec_decode, "allocate", no_allocate)
    monkeypatch.setattr(spec_decode, "cost_budget", no_budget)
    monkeypatch.setattr(spec_decode, "BUDGET_EVERY", 1)
    kept = spec.calibration
    spec.calibration = SurvivalCalibration()
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    try:
        spec.set_policy(VerifyPolicy(kind="cost", lagged=True), LatencyModel.affine(0.001, 2e-4, 64),
                        online_latency=False)
        spec.explore_every = 0
        spec._carried[0] = ((4, 0, None), 0)  # a carried count of no drafts would verify nothing
        spec.reset_stats()
        assert _ids(v41_spec.generate(PROMPTS, sp, use_tqdm=False)) == v41_reference
        rounds = spec.stats.steps
        assert len(seen["search"]) + len(seen["above"]) == rounds and seen["above"]
        assert set(seen["search"]) == {(True, True)} and set(seen["cutoff"]) == {True}
        assert len(seen["cutoff"]) == rounds  # searched after every launch (BUDGET_EVERY = 1)
        assert spec.stats.num_verified_tokens > 0
        for c, want in ((0.0, "all"), (float("inf"), "none")):
            seen["above"].clear()
            monkeypatch.setattr(spec_decode, "cost_cutoff", lambda *a, c=c, **kw: c)
            spec.set_policy(VerifyPolicy(kind="cost", lagged=True))
            spec._carried[1] = None
            assert _ids(v41_spec.generate(PROMPTS, sp, use_tqdm=False)) == v41_reference
            assert seen["above"] and all(x == c for x, _, _ in seen["above"])
            assert all(got == (m if want == "all" else [0] * len(m)) for _, got, m in seen["above"])
    finally:
        spec.calibration = kept
        spec.explore_every = 32
        _use_policy(v41_spec, "verify_all")


def test_engine_cost_policy_is_lagged(ckpts) -> None:
    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark", "policy": "cost", "latency": "affine:0.01,0.001"})
    assert llm.engine.runner.spec.policy.kind == "cost" and llm.engine.runner.spec.policy.lagged


def test_a_round_bound_by_the_host_times_the_floor_not_the_forward() -> None:
    """A synchronous round on a device: the host's own launch time is the floor's observation; the span times the
    forward only when the read waited for the device, or when the curve predicts a longer forward than the whole
    span took (an overstated profile comes down even while the host is the bound)."""
    from deepinfer_dspark import LatencyModel
    from deepinfer_engine.worker.spec_decode import DEVICE_BOUND_WAIT_S, round_observations

    lat = LatencyModel([1, 100], [1e-3, 3e-3])
    host = 2.5e-3
    assert round_observations(lat, 100, host, host + 2 * DEVICE_BOUND_WAIT_S) == (host, host + 2 * DEVICE_BOUND_WAIT_S)
    assert round_observations(lat, 10, host, host + DEVICE_BOUND_WAIT_S / 2) == (host, None)  # forward 1.2 ms: hidden
    assert round_observations(lat, 100, host, host + DEVICE_BOUND_WAIT_S / 2) == (host, host + DEVICE_BOUND_WAIT_S / 2)


@pytest.mark.parametrize("busy", [True, False])
def test_the_policy_warms_with_its_previous_call_while_the_device_drafts(ckpts, v41_reference, busy) -> None:
    """While the device still drafts (`device_busy`), `begin` runs the policy's previous call and throws it away
    (its code into the caches before this round's call). It changes nothing the round decides: the same drafts
    verified, the same greedy output; with the device idle it does not run. (An engine of its own, without a
    prefix cache: the runs must start from the same state; the decision stays on the host, `decide_on_device`.)"""
    from deepinfer_dspark import LatencyModel, SurvivalCalibration, VerifyPolicy

    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark", "policy": "cost"}, enable_prefix_caching=False)
    spec = llm.engine.runner.spec
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    verified = {}
    spec.explore_every = 0
    spec.decide_on_device = False
    for name in ("plain", "warmed"):
        spec.set_policy(VerifyPolicy(kind="cost", lagged=True), LatencyModel.affine(0.001, 2e-4, 64),
                        online_latency=False)
        spec.calibration = SurvivalCalibration()  # each run learns from its own rounds only
        spec.device_busy = (lambda: busy) if name == "warmed" else None
        spec._warm.clear()
        spec.reset_stats()
        assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == v41_reference
        verified[name] = spec.stats.num_verified_tokens
        warmed, rounds = spec.timing.warmed, spec.timing.rounds
    assert verified["warmed"] == verified["plain"] > 0
    assert (warmed == rounds - 1 and spec.timing.warm_s > 0) if busy else warmed == 0
