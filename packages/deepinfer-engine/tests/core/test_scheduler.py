"""Scheduler: token budget, chunked prefill, LCFS preemption + recompute, over-long prompts, cancellation."""

from __future__ import annotations

from deepinfer_engine.core.kv_cache import KVCacheManager
from deepinfer_engine.core.request import Request, RequestStatus
from deepinfer_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from deepinfer_engine.core.scheduler import Scheduler

EOS = 1


def _sched(*, pages=100, slots=8, page_size=4, budget=16, seqs=8, max_len=64, chunked=True) -> Scheduler:
    kv = KVCacheManager(page_size=page_size, num_pages=pages, num_slots=slots)
    return Scheduler(kv=kv, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     enable_chunked_prefill=chunked)


def _req(rid: str, n: int, max_tokens: int = 3, **kw) -> Request:
    return Request(rid, [10 + i for i in range(n)], max_tokens=max_tokens, eos_token_ids=(EOS,), **kw)


def _next_token(chunk) -> int:
    # a deterministic stand-in for the model: depends only on the request's position
    return 100 + chunk.start_position + chunk.num_tokens


def _step(s: Scheduler) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    sampled = {c.req_id: _next_token(c) for c in out.chunks if c.sample}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def _run(s: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    steps = []
    while s.has_unfinished_requests() or s.has_pending_updates():
        out, _ = _step(s)
        steps.append(out)
        assert len(steps) < max_steps
    return steps


def test_budget_and_chunked_prefill() -> None:
    s = _sched(budget=10)
    s.add_request(_req("a", 7))
    s.add_request(_req("b", 12))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 7, "b": 3}
    assert [c.sample for c in out.chunks] == [True, False]
    assert [c.start_position for c in out.chunks] == [0, 0]
    assert out.chunks[1].token_ids == (10, 11, 12)
    out, _ = _step(s)
    # a decodes 1 token, b continues its prefill with the rest of the budget
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.chunks[1].start_position == 3 and out.chunks[1].sample
    assert out.chunks[0].token_ids == (107,)  # a's sampled token is fed back at position 7
    assert out.total_num_scheduled_tokens <= 10
    steps = _run(s)
    assert all(o.total_num_scheduled_tokens <= 10 for o in steps)
    a, b = s.get_request("a"), s.get_request("b")
    assert a.output_token_ids == [107, 108, 109] and a.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [112, 113, 114]


def test_without_chunked_prefill_prompts_go_whole() -> None:
    s = _sched(budget=10, chunked=False)
    s.add_request(_req("a", 7))
    s.add_request(_req("b", 6))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 7}
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    s.add_request(_req("c", 11))
    assert s.get_request("c").status is RequestStatus.FINISHED_ERROR
    assert "max_num_batched_tokens=10" in s.get_request("c").error


def test_max_num_seqs_limits_running() -> None:
    s = _sched(seqs=2)
    for i in range(4):
        s.add_request(_req(f"r{i}", 2))
    out, _ = _step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_eos_stop_tokens_and_min_tokens() -> None:
    s = _sched()
    s.add_request(_req("a", 2, max_tokens=10, stop_token_ids=(103,)))
    s.add_request(_req("b", 3, max_tokens=10, min_tokens=5, stop_token_ids=(103, 104)))
    _run(s)
    a, b = s.get_request("a"), s.get_request("b")
    assert a.output_token_ids == [102, 103] and a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 103
    # min_tokens=5 suppresses the stop ids until 5 tokens exist; max_tokens ends it
    assert b.output_token_ids[:2] == [103, 104] and len(b.output_token_ids) == 10
    assert b.status is RequestStatus.FINISHED_LENGTH


def test_max_model_len_ends_generation_with_length() -> None:
    s = _sched(max_len=8)
    s.add_request(_req("a", 5, max_tokens=100))
    _run(s)
    a = s.get_request("a")
    assert a.num_tokens == 8 and a.status is RequestStatus.FINISHED_LENGTH


def test_preemption_recomputes_and_outputs_match_unconstrained_run() -> None:
    prompts = {"a": 5, "b": 6, "c": 3}

    def run(pages: int) -> tuple[dict, int, list]:
        s = _sched(pages=pages, page_size=2, budget=32)
        for rid, n in prompts.items():
            s.add_request(_req(rid, n, max_tokens=6))
        steps = _run(s)
        return ({r: s.get_request(r).output_token_ids for r in prompts}, s.num_preemptions, steps)

    free, n_free, _ = run(pages=100)
    tight, n_tight, steps = run(pages=8)  # 16 cached tokens for 3 sequences growing to 11/12/9 tokens
    assert n_free == 0 and n_tight > 0
    assert tight == free
    # the most recently admitted request is the victim and comes back with a recompute from position 0
    first = next(o for o in steps if o.preempted_req_ids)
    assert first.preempted_req_ids == {"c"}
    resumed = next(c for o in steps[steps.index(first) + 1 :] for c in o.chunks if c.req_id == "c")
    assert resumed.start_position == 0 and len(resumed.token_ids) > 3


def test_pages_never_double_booked() -> None:
    s = _sched(pages=6, page_size=2, budget=8)
    for i in range(5):
        s.add_request(_req(f"r{i}", 3 + i % 3, max_tokens=5))
    tables: dict[str, list[int]] = {}  # the runner's view, rebuilt from the diffs alone
    while s.has_unfinished_requests():
        out = s.schedule()
        for rid in out.finished_req_ids | out.preempted_req_ids:
            tables.pop(rid, None)
        for nr in out.new_requests:
            tables[nr.req_id] = []
        for c in out.chunks:
            tables[c.req_id].extend(c.new_page_ids)
            assert tables[c.req_id] == s.kv.page_ids(c.req_id)  # diffs add up to the manager's table
        owned = [p for c in out.chunks for p in tables[c.req_id]]
        assert len(owned) == len(set(owned))
        assert len({c.slot for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            assert len(tables[c.req_id]) * 2 >= c.start_position + c.num_tokens
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={
            c.req_id: _next_token(c) for c in out.chunks if c.sample}))
    assert s.kv.num_free_pages == 6 and s.kv.num_free_slots == 8


def test_never_fitting_requests_fail_alone() -> None:
    s = _sched(pages=4, page_size=4, max_len=30)
    s.add_request(_req("ok", 4, max_tokens=2))
    s.add_request(_req("too_long", 30))
    s.add_request(_req("too_big_for_cache", 17))
    s.add_request(Request("empty", [], max_tokens=2))
    out, updates = _step(s)
    assert set(out.num_scheduled_tokens) == {"ok"}
    errors = {u.req_id: u for u in updates if u.finish_reason == "error"}
    assert set(errors) == {"too_long", "too_big_for_cache", "empty"}
    assert "max_model_len is 30" in errors["too_long"].error
    assert "4 pages" in errors["too_big_for_cache"].error and "kv_cache_memory_bytes" in errors["too_big_for_cache"].error
    _run(s)
    assert s.get_request("ok").status is RequestStatus.FINISHED_LENGTH


def test_sequence_outgrowing_the_whole_cache_finishes_with_error() -> None:
    s = _sched(pages=2, page_size=4, max_len=64)
    s.add_request(_req("grow", 6, max_tokens=20))
    s.add_request(_req("small", 1, max_tokens=1))
    _run(s)
    g = s.get_request("grow")
    assert g.status is RequestStatus.FINISHED_ERROR and "whole cache" in g.error
    assert g.num_tokens == 9  # 8 cached tokens fit; the 9th would need a third page
    assert s.get_request("small").status is RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_pages == 2


def test_abort_waiting_and_running() -> None:
    s = _sched(seqs=1)
    s.add_request(_req("run", 3, max_tokens=10))
    s.add_request(_req("wait", 3))
    out, _ = _step(s)
    s.abort_requests(["run", "wait", "unknown"])
    assert not s.has_unfinished_requests()
    out, updates = _step(s)
    assert out.is_empty and out.finished_req_ids == {"run", "wait"}
    assert {u.req_id: u.finish_reason for u in updates} == {"run": "abort", "wait": "abort"}
    assert s.kv.num_free_pages == 100 and s.kv.num_free_slots == 8


def test_abort_during_a_step_drops_its_result() -> None:
    s = _sched()
    s.add_request(_req("a", 3))
    out = s.schedule()
    s.abort_requests(["a"])
    updates = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 5}))
    assert [u.finish_reason for u in updates] == ["abort"]
    assert s.get_request("a").output_token_ids == []


def _spec_sched(**kw) -> Scheduler:
    kv = KVCacheManager(page_size=4, num_pages=kw.pop("pages", 100), num_slots=8)
    return Scheduler(kv=kv, max_num_seqs=8, max_num_batched_tokens=kw.pop("budget", 32), max_model_len=64,
                     num_spec_tokens=kw.pop("spec", 3))


def test_spec_tokens_reserved_for_decode_chunks_only() -> None:
    from deepinfer_engine.core.sched_output import SpecResult

    s = _spec_sched(budget=10)
    s.add_request(_req("a", 5, max_tokens=10))
    out = s.schedule()  # prefill: no drafts
    assert [c.num_spec_tokens for c in out.chunks] == [0]
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 50}))
    out = s.schedule()
    (c,) = out.chunks
    assert (c.num_tokens, c.num_spec_tokens, c.start_position) == (1, 3, 5)
    assert len(s.kv.page_ids("a")) == s.kv.pages_for(5 + 1 + 3)  # pages for the drafts are reserved
    # 2 accepted drafts + 1 correction: the computed tokens advance past the accepted drafts only
    res = SpecResult(token_ids=(51, 52, 53), num_draft_tokens=5, num_verified_tokens=3, num_accepted_tokens=2)
    (delta,) = s.update_from_output(out, ModelRunnerOutput(spec={"a": res}))
    req = s.get_request("a")
    assert delta.new_token_ids == (51, 52, 53) and (delta.num_verified_tokens, delta.num_accepted_tokens) == (3, 2)
    assert req.num_computed_tokens == 5 + 1 + 2 and req.num_tokens == 5 + 4
    assert s.schedule().chunks[0].token_ids == (53,)


def test_spec_tokens_bounded_by_max_tokens_and_stop_truncates() -> None:
    from deepinfer_engine.core.sched_output import SpecResult

    s = _spec_sched()
    s.add_request(_req("a", 3, max_tokens=3))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 50}))
    out = s.schedule()
    assert out.chunks[0].num_spec_tokens == 1  # 2 more tokens may be emitted: 1 draft + the bonus
    s.add_request(_req("b", 3, max_tokens=20))
    s.update_from_output(out, ModelRunnerOutput(spec={"a": SpecResult(
        token_ids=(51, 52), num_draft_tokens=5, num_verified_tokens=1, num_accepted_tokens=1)}))
    assert s.get_request("a").output_token_ids == [50, 51, 52]
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"b": 60}))
    out = s.schedule()
    # EOS in the middle of a round ends the request there; the tokens after it are dropped
    (delta,) = s.update_from_output(out, ModelRunnerOutput(spec={"b": SpecResult(
        token_ids=(61, EOS, 63), num_draft_tokens=5, num_verified_tokens=3, num_accepted_tokens=2)}))
    assert delta.new_token_ids == (61, EOS) and delta.finish_reason == "stop"
    assert s.get_request("b").output_token_ids == [60, 61, EOS]


def test_spec_tokens_off_without_budget_or_pages() -> None:
    s = _spec_sched(budget=1)
    s.add_request(_req("a", 1, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 50}))
    assert s.schedule().chunks[0].num_spec_tokens == 0  # the budget holds only the decode token
    s = _spec_sched(pages=1)
    s.add_request(_req("a", 2, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 50}))
    out = s.schedule()
    # 3 tokens fit the one page; the drafts would need a second page, so the chunk decodes plainly
    assert out.chunks[0].num_spec_tokens == 0 and s.num_preemptions == 0


def test_a_rounds_ids_stop_where_an_id_by_id_check_stops() -> None:
    """`_append_outputs` answers a whole round at once when no id can stop it: the ids kept, the status and the
    stop reason equal the id-by-id check's on rounds that stop on EOS, a stop id, max_tokens or max_model_len,
    with min_tokens, ignore_eos and none of them."""
    import itertools
    import random

    def by_id(s: Scheduler, req: Request, toks: tuple[int, ...]):
        for i, tok in enumerate(toks):
            req.output_token_ids.append(tok)
            status = s._stop_status(req, tok)
            if status is not None:
                return toks[: i + 1], status
        return toks, None

    rng = random.Random(0)
    s = _sched(max_len=14)
    cases = itertools.product((None, 5, 7), (0, 4), (False, True), (3, 4, 5), range(6))
    for max_tokens, min_tokens, ignore_eos, done, _ in cases:
        toks = tuple(rng.choice((EOS, 7, 8, 9, 20, 21)) for _ in range(rng.randint(1, 5)))
        reqs = [_req("r", 4, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                     stop_token_ids=(7, 8)) for _ in range(2)]
        for r in reqs:
            r.output_token_ids.extend([30] * done)
        got, want = s._append_outputs(reqs[0], toks), by_id(s, reqs[1], toks)
        assert got == want and reqs[0].output_token_ids == reqs[1].output_token_ids, (toks, max_tokens, done)
        assert reqs[0].stop_reason == reqs[1].stop_reason
