"""Asynchronous scheduling with speculative decoding (async_step.py, `collect_first`; docs/async_scheduling.md
"Speculative decoding"), tiny V4.1 and V4-0731 checkpoints, CPU float32: every output and every speculative metric
equals the synchronous speculative engine's, and greedy outputs equal plain decoding, over a mixed batch with
chunked prefill, forced preemption, the prefix cache, stops by max_tokens and stop id mid-round, seeded sampling,
logprobs rows decoding plainly beside verify rows and a stand-in drafter with mixed acceptance. Late stops (stop
string), an abort in flight, an inadmissible request and non-finite verify logits leave the loop clean.
V4's MTP block (drafts from the step's streams, after the step) under the same loop. GPU: the same equality with
CUDA graphs on."""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.async_step import AsyncStepLoop
from deepinfer_engine.core.async_scheduler import AsyncScheduler
from oracle_drafter import OracleDrafter

PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 20)), [0, 11, 12, 13, 14, 15, 16, 17, 18], [0, 5, 6, 7, 8, 40]]
# run one after the other after PROMPTS: the second hits the first one's cached pages (12 common tokens)
LATER = [list(range(3, 16)) + [7, 8], list(range(3, 16)) + [9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_0731(tiny_ckpt):
    return tiny_ckpt("v4", "tiny-dspark")


def _llm(path, arch: str, *, spec: bool = True, async_scheduling: bool = False, device: str = "cpu", **kw) -> LLM:
    # V4.1: 12 pages of 4 tokens are too few for the five requests at once (preemption + recompute); a 10-token
    # budget puts prefill chunks beside verify chunks
    page = 4 if arch == "v41" else 8
    kw.setdefault("num_kv_pages", 12 if arch == "v41" else None)
    kw.setdefault("max_num_seqs", 4)
    return LLM(str(path), device=device, dtype="float32", page_size=page, max_num_batched_tokens=10,
               speculative_config={"method": "dspark"} if spec else None, async_scheduling=async_scheduling, **kw)


def _run(llm: LLM, requests: dict, *, known: dict | None = None, abort_after: dict | None = None) -> dict:
    """Drive the engine step by step: {request id: final RequestOutput}. known: {id: full sequence} for the
    OracleDrafter; abort_after: {id: n} aborts the request once it has n output tokens."""
    eng = llm.engine
    if known is not None:
        def seq_of_slot(slot: int) -> list[int]:
            kv = eng.scheduler.kv
            (rid,) = [r for r in eng.scheduler.requests if r in kv._slots and kv.slot(r) == slot]
            return known.get(rid, [])

        eng.runner.spec.drafter = OracleDrafter(int(eng.args.vocab_size), seq_of_slot)
    for rid, (prompt, sp) in requests.items():
        eng.add_request(rid, prompt, sp)
    done, aborted = {}, set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            n = (abort_after or {}).get(o.request_id)
            if n is not None and not o.finished and o.request_id not in aborted and len(o.outputs[0].token_ids) >= n:
                eng.abort_request(o.request_id)
                aborted.add(o.request_id)
            if o.finished:
                done[o.request_id] = o
    return done


def _view(done: dict) -> dict:
    return {rid: [(tuple(c.token_ids), c.finish_reason, c.stop_reason, c.text) for c in o.outputs] + [o.error]
            for rid, o in done.items()}


def _spec_metrics(done: dict) -> dict:
    return {rid: (o.metrics.num_draft_tokens, o.metrics.num_verified_tokens, o.metrics.num_accepted_tokens,
                  o.metrics.num_spec_steps, o.num_cached_tokens) for rid, o in done.items()}


def _assert_same_stats(asy: dict, sync: dict) -> None:
    """Run statistics (`AcceptanceStats.as_dict`) equal, the survival sums within float32 rounding: the
    asynchronous engine drafts for requests that finish while a round is in flight (their rows are dropped), so
    the draft pass runs other batch shapes and the confidences of the others round differently."""
    floats = ("predicted_acceptance_by_position", "survival_calibration")
    # the survival bins are left out: rounding may move a survival across a bin edge, and their totals are the
    # verified and accepted counts and the survival sums compared here
    skip = (*floats, "survival_reliability")
    assert {k: v for k, v in asy.items() if k not in skip} == {k: v for k, v in sync.items() if k not in skip}
    for k in floats:
        assert (asy[k] is None) == (sync[k] is None) and (asy[k] is None or asy[k] == pytest.approx(sync[k], rel=1e-5))


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests
    assert eng.scheduler.kv.num_free_pages == eng.plan.num_pages


def _is_async_spec(llm: LLM) -> None:
    core = llm.engine.core
    assert isinstance(core._async, AsyncStepLoop) and core._async.collect_first
    assert not isinstance(core.scheduler, AsyncScheduler)


@pytest.mark.slow  # ~10-20 s on 2 busy CPU cores: three engines on a tiny model
def test_async_speculation_equals_sync_and_plain_with_mixed_acceptance(tiny_ckpt) -> None:
    """V4.1, the reference drafter: drafts accepted and rejected, chunked prefill, preemption, a prefix-cache hit
    (request 4 shares request 0's first page), stop id mid-round, max_tokens, seeded sampling, logprobs."""
    ckpt = tiny_ckpt("v41")
    plain = _llm(ckpt, "v41", spec=False)
    prompts = {str(i): p for i, p in enumerate(PROMPTS + LATER)}
    ref = _run(plain, {rid: (p, GREEDY) for rid, p in prompts.items()})
    known = {rid: p + list(ref[rid].outputs[0].token_ids) for rid, p in prompts.items()}
    stop_id = known["1"][len(PROMPTS[1]) + 5]
    sps = [GREEDY.replace(max_tokens=11),
           GREEDY.replace(stop_token_ids=[stop_id]),
           SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=9, ignore_eos=True),
           GREEDY.replace(max_tokens=5, logprobs=1),
           GREEDY.replace(max_tokens=7)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, sps))}
    later = [{str(len(PROMPTS) + i): (p, GREEDY.replace(max_tokens=8))} for i, p in enumerate(LATER)]
    want = _run(plain, requests) | _run(plain, later[0]) | _run(plain, later[1])
    runs, stats = [], []
    for async_scheduling in (False, True):
        llm = _llm(ckpt, "v41", async_scheduling=async_scheduling)
        if async_scheduling:
            _is_async_spec(llm)
        runs.append(_run(llm, requests, known=known) | _run(llm, later[0], known=known)
                    | _run(llm, later[1], known=known))
        stats.append((llm.engine.spec_stats().as_dict(), llm.engine.core.scheduler.num_preemptions))
    sync, asy = runs
    assert _view(asy) == _view(sync)
    assert _spec_metrics(asy) == _spec_metrics(sync)
    _assert_same_stats(stats[1][0], stats[0][0])
    assert stats[1][1] == stats[0][1]  # preemptions
    for rid in ("0", "1", "3", "4", "5", "6"):  # greedy: lossless against plain decoding
        assert _view(asy)[rid] == _view(want)[rid], rid
    assert asy["1"].outputs[0].finish_reason == "stop" and asy["1"].outputs[0].stop_reason == stop_id
    assert len(asy["1"].outputs[0].token_ids) < 14
    run_stats, preemptions = stats[1]
    hist = run_stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, run_stats  # drafts accepted and rejected
    assert preemptions > 0
    assert asy["6"].num_cached_tokens >= 8  # a prefix-cache hit
    for la, lb in zip(asy["3"].outputs[0].logprobs, sync["3"].outputs[0].logprobs):
        assert (la.token_id, la.rank) == (lb.token_id, lb.rank) and la.logprob == pytest.approx(lb.logprob, abs=1e-5)


def test_async_speculation_with_the_cost_policy_carries_its_values_and_stays_lossless(tiny_ckpt, monkeypatch) -> None:
    """The lagged cost policy under asynchronous scheduling (a fixed affine curve that prunes): the values it carries
    are searched in `collect_verify`, which the asynchronous loop runs too. All-greedy rounds verify above a carried
    survival cutoff, rounds with the sampled request allocate a carried count, and the greedy outputs equal plain
    decoding."""
    from deepinfer_engine.worker import spec_decode

    ckpt = tiny_ckpt("v41")
    plain = _llm(ckpt, "v41", spec=False)
    sps = [GREEDY, GREEDY.replace(max_tokens=9), SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
           GREEDY.replace(max_tokens=11)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, sps))}
    want = _run(plain, requests)
    calls = {"allocate_above": 0, "allocate": 0}

    def counted(name: str):
        original = getattr(spec_decode, name)

        def spy(*a, **kw):
            calls[name] += 1
            return original(*a, **kw)
        return spy

    for name in calls:
        monkeypatch.setattr(spec_decode, name, counted(name))
    monkeypatch.setattr(spec_decode, "BUDGET_EVERY", 1)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", page_size=4, max_num_seqs=4, async_scheduling=True,
              speculative_config={"method": "dspark", "policy": "cost", "latency": "affine:0.001,0.002"})
    _is_async_spec(llm)
    llm.engine.runner.spec.explore_every = 0
    got = _run(llm, requests)
    for rid in ("0", "1", "3"):
        assert _view(got)[rid] == _view(want)[rid], rid
    assert calls["allocate_above"] > 0 and calls["allocate"] > 0, calls
    stats = llm.engine.spec_stats()
    assert 0 < stats.num_verified_tokens < stats.num_draft_tokens  # the policy pruned
    _assert_clean(llm)


@pytest.mark.slow  # ~10-20 s on 2 busy CPU cores: three engines on a tiny model
def test_async_speculation_with_the_checkpoint_drafter_late_stops_aborts_and_bad_requests(v4_0731) -> None:
    """V4-0731 with its own DSpark stages: a stop string (found after the next round was launched: that row is
    dropped), an abort in flight, a prompt longer than max_model_len beside valid requests: outputs equal the
    synchronous engine's, greedy ones equal plain decoding, and the engine ends clean."""
    plain = _llm(v4_0731, "v4", spec=False, max_model_len=40)
    ref = _run(plain, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS[:4])})
    text = ref["3"].outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 2]
    requests = {"0": (PROMPTS[0], GREEDY.replace(max_tokens=8)),
                "1": (PROMPTS[1], GREEDY),  # aborted in flight
                "2": (PROMPTS[2], SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)),
                "3": (PROMPTS[3], GREEDY.replace(stop=[stop])),
                "bad": ([0] + list(range(100, 160)), GREEDY)}  # 61 tokens >= max_model_len: finished with an error
    runs, stats, dropped = [], [], set()
    for async_scheduling in (False, True):
        llm = _llm(v4_0731, "v4", async_scheduling=async_scheduling, max_model_len=40)
        if async_scheduling:  # record the rows of requests that finished while their round was in flight
            loop = llm.engine.core._async
            inner = loop._finish

            def finish(sched, out, drop=frozenset(), _inner=inner):
                dropped.update(drop)
                return _inner(sched, out, drop)

            loop._finish = finish
        runs.append(_run(llm, requests, abort_after={"1": 3}))
        _assert_clean(llm)
        stats.append(llm.engine.spec_stats().as_dict())
    assert stats[0]["num_verified_tokens"] > 0
    assert dropped == {"1", "3"}  # the abort and the stop string landed while a round of theirs was in flight
    sync, asy = runs
    _assert_same_stats(stats[1], stats[0])
    assert _view(asy) == _view(sync)
    assert _spec_metrics(asy) == _spec_metrics(sync)
    assert asy["bad"].outputs[0].finish_reason == "error" and "max_model_len" in asy["bad"].error
    assert asy["1"].outputs[0].finish_reason == "abort"
    assert asy["3"].outputs[0].finish_reason == "stop" and asy["3"].outputs[0].stop_reason == stop
    want = _run(plain, {k: requests[k] for k in ("0", "3")})
    assert _view(asy)["0"] == _view(want)["0"] and _view(asy)["3"] == _view(want)["3"]


def test_async_speculation_fails_only_the_request_with_non_finite_verify_logits(tiny_ckpt) -> None:
    llm = _llm(tiny_ckpt("v41"), "v41", async_scheduling=True, num_kv_pages=None)
    model = llm.engine.runner.model
    orig, calls = model.forward_features, []

    def poisoned(batch, cache, capture=()):
        out = orig(batch, cache, capture=capture)
        calls.append(batch.query_lens)
        if len(calls) == 3:  # a verify step of both requests (the first two calls prefill)
            bad = out.logits.clone()
            bad[: batch.query_lens[0]] = float("nan")  # the first request's rows only
            out.logits = bad
        return out

    model.forward_features = poisoned
    try:
        done = _run(llm, {"a": (PROMPTS[3], GREEDY.replace(max_tokens=6)), "b": (PROMPTS[1], GREEDY.replace(max_tokens=6))})
    finally:
        del model.forward_features
    assert len(calls[2]) == 2 and max(calls[2]) > 1  # the poisoned step verified drafts of both requests
    assert done["a"].outputs[0].finish_reason == "error" and "not finite" in done["a"].error
    assert done["b"].error is None and len(done["b"].outputs[0].token_ids) == 6
    _assert_clean(llm)
    again = _run(llm, {"c": (PROMPTS[3], GREEDY.replace(max_tokens=6))})  # the loop stays usable
    assert again["c"].error is None and len(again["c"].outputs[0].token_ids) == 6


def test_a_failing_read_back_fails_only_its_requests(tiny_ckpt) -> None:
    """The read-back of one speculative step raises: its request fails; the request admitted into the next step
    (launched after the failure) completes as alone, and the engine ends clean."""
    llm = _llm(tiny_ckpt("v41"), "v41", async_scheduling=True, num_kv_pages=None, max_num_seqs=1)
    runner = llm.engine.runner
    inner, calls = runner.collect, []

    def collect(step, drop=frozenset()):
        calls.append(step)
        if len(calls) == 3:  # a's second verify round
            raise RuntimeError("boom")
        return inner(step, drop)

    runner.collect = collect
    try:
        done = _run(llm, {"a": (PROMPTS[0], GREEDY.replace(max_tokens=8)), "b": (PROMPTS[1], GREEDY.replace(max_tokens=4))})
    finally:
        del runner.collect
    alone = _run(llm, {"b2": (PROMPTS[1], GREEDY.replace(max_tokens=4))})
    assert done["a"].outputs[0].finish_reason == "error" and "RuntimeError: boom" in done["a"].error
    assert done["b"].error is None and done["b"].outputs[0].token_ids == alone["b2"].outputs[0].token_ids
    _assert_clean(llm)


@pytest.mark.slow  # ~10-20 s on 2 busy CPU cores: three engines on a tiny model
def test_async_mtp_speculation_equals_sync_and_plain(tiny_ckpt) -> None:
    """V4's MTP block drafts from the step's final streams after the step (`after_sampling`, in `collect`): under
    asynchronous scheduling that runs one call later, before the next launch; outputs and metrics are unchanged."""
    ckpt = tiny_ckpt("v4")
    sps = [GREEDY.replace(max_tokens=m) for m in (7, 4, 9)]
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[:3], sps))}
    want = _run(_llm(ckpt, "v4", spec=False), requests)
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(str(ckpt), device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=8,
                  speculative_config={"method": "mtp"}, async_scheduling=async_scheduling)
        runs.append((_run(llm, requests), llm.engine.spec_stats().as_dict()))
    (sync, sync_stats), (asy, asy_stats) = runs
    assert _view(asy) == _view(sync) == _view(want)
    assert _spec_metrics(asy) == _spec_metrics(sync)
    _assert_same_stats(asy_stats, sync_stats)
    # the MTP block drafted (its draft of a round comes from the previous step's deferred collect)
    assert asy_stats["num_verified_tokens"] > 0


@pytest.mark.gpu
def test_async_speculation_equals_sync_and_plain_on_cuda_with_graphs(tiny_ckpt) -> None:
    """CUDA float32 with CUDA graphs (verify steps, the draft pass and the draft-ring writes replayed), prefix
    cache on: async speculation == synchronous speculation (ids, finish reasons, metrics; seeded sampling
    included) and greedy == plain decoding, with mixed prompt lengths and requests finishing at different steps."""
    ckpt = tiny_ckpt("v41")
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((7, 12, 3, 30, 17, 1))]
    sps = [GREEDY.replace(max_tokens=m) for m in (20, 6, 13, 9, 16, 3)]
    sps[2] = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=13, ignore_eos=True)
    requests = {str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))}

    def make(spec: bool, async_scheduling: bool) -> LLM:
        # the plain reference runs eagerly (as in tests/worker/test_spec_graphs_cuda.py)
        return LLM(str(ckpt), device="cuda", dtype="float32", max_num_seqs=4, enforce_eager=not spec,
                   speculative_config={"method": "dspark"} if spec else None, async_scheduling=async_scheduling)

    want = _run(make(False, False), requests)
    sync = _run(make(True, False), requests)
    llm = make(True, True)
    _is_async_spec(llm)
    asy = _run(llm, requests)
    assert _view(asy) == _view(sync)
    assert _spec_metrics(asy) == _spec_metrics(sync)
    greedy = [k for k in requests if k != "2"]
    assert {k: _view(asy)[k] for k in greedy} == {k: _view(want)[k] for k in greedy}
    st = llm.engine.runner.cuda_graphs.stats
    assert st.verify_replays >= 5 and st.draft_replays >= 5 and st.insert_replays >= 5, st
    assert llm.engine.spec_stats().num_verified_tokens > 0
