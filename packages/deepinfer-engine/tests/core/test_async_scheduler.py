"""AsyncScheduler: step N+1 planned before step N's outputs land. Placeholders in budgets, pages, `sample` and
`output_index`; results one step late; length stops never scheduled past; an output in flight when its request
is preempted is kept; a stale result never reaches a request that reuses a finished one's id. Driven by a pure
stand-in model with one step in flight, checked against the synchronous scheduler on the same stand-in."""

from __future__ import annotations

from deepinfer_engine.core.async_scheduler import PLACEHOLDER_TOKEN, AsyncScheduler
from deepinfer_engine.core.kv_cache import KVCacheManager
from deepinfer_engine.core.request import Request, RequestStatus
from deepinfer_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from deepinfer_engine.core.scheduler import Scheduler

EOS = 1


def _make(cls, *, pages=100, page_size=4, budget=16, seqs=8, max_len=64):
    kv = KVCacheManager(page_size=page_size, num_pages=pages, num_slots=seqs)
    return cls(kv=kv, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len)


def _req(rid: str, n: int, max_tokens: int | None = 3, **kw) -> Request:
    return Request(rid, [10 + i for i in range(n)], max_tokens=max_tokens, eos_token_ids=(EOS,), **kw)


def _token(req: Request, chunk, fed: list[int]) -> int:
    """Stand-in model: the next id depends on the request's whole sequence as fed (placeholders resolved)."""
    return 20 + (sum(fed) * 7 + chunk.start_position + chunk.num_tokens) % 50


class _Device:
    """Keeps what the runner would: each request's fed ids by position, the last step's samples."""

    def __init__(self) -> None:
        self.fed: dict[str, dict[int, int]] = {}
        self.last: dict[str, int] = {}

    def run(self, s, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for c in sched.chunks:
            ids = [self.last[c.req_id] if t == PLACEHOLDER_TOKEN else t for t in c.token_ids]
            seq = self.fed.setdefault(c.req_id, {})
            for k, t in enumerate(ids):
                seq[c.start_position + k] = t
            if c.sample:
                prefix = [seq[p] for p in range(c.start_position + c.num_tokens)]
                sampled[c.req_id] = _token(s.requests[c.req_id], c, prefix)
        self.last = sampled
        return ModelRunnerOutput(sampled_token_ids=sampled)


def _drive_sync(s: Scheduler) -> list[SchedulerOutput]:
    dev, steps = _Device(), []
    while s.has_unfinished_requests() or s.has_pending_updates():
        sched = s.schedule()
        s.update_from_output(sched, dev.run(s, sched))
        steps.append(sched)
        assert len(steps) < 200
    return steps


def _drive_async(s: AsyncScheduler, on_step=None) -> list[SchedulerOutput]:
    dev, steps, flight = _Device(), [], None
    while s.has_unfinished_requests() or s.has_pending_updates() or flight is not None:
        sched = s.schedule()
        out = dev.run(s, sched)
        if flight is not None:
            s.update_from_output(*flight)
        flight = (sched, out) if not sched.is_empty else None
        if sched.is_empty:
            s.update_from_output(sched, out)
        steps.append(sched)
        if on_step is not None:
            on_step(s, sched)
        assert len(steps) < 200
    return steps


def _outputs(s) -> dict[str, list[int]]:
    return {rid: list(r.output_token_ids) for rid, r in s.requests.items()}


def test_decode_row_is_planned_before_the_previous_token_lands() -> None:
    s = _make(AsyncScheduler)
    s.add_request(_req("a", 5, max_tokens=4))
    first = s.schedule()
    assert first.chunks[0].sample and first.chunks[0].output_index == 0 and s.num_in_flight("a") == 1
    second = s.schedule()  # before the first step's token is known
    (c,) = second.chunks
    assert (c.start_position, c.token_ids, c.sample, c.output_index) == (5, (PLACEHOLDER_TOKEN,), True, 1)
    assert s.num_in_flight("a") == 2 and s.get_request("a").num_computed_tokens == 6
    assert len(s.kv.page_ids("a")) == 2  # the page of position 5 is allocated for the placeholder row
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": 33}))
    assert s.get_request("a").output_token_ids == [33] and s.num_in_flight("a") == 1
    third = s.schedule()
    # position 5 is now known; position 6 is the second step's (still unknown) sample
    assert third.chunks[0].token_ids == (PLACEHOLDER_TOKEN,) and third.chunks[0].start_position == 6


def test_same_outputs_as_synchronous_with_chunking_and_preemption() -> None:
    def fill(s):
        s.add_request(_req("a", 7, max_tokens=6))
        s.add_request(_req("b", 12, max_tokens=5))
        s.add_request(_req("c", 3, max_tokens=8, ignore_eos=True))
        return s

    kw = dict(pages=7, budget=6)
    sync = fill(_make(Scheduler, **kw))
    asy = fill(_make(AsyncScheduler, **kw))
    keep = {}
    for s in (sync, asy):
        orig = s._finish

        def finish(req, status, *, error=None, emit=True, _orig=orig, _keep=keep, _s=s):
            _keep.setdefault(id(_s), {})[req.request_id] = (list(req.output_token_ids), status)
            _orig(req, status, error=error, emit=emit)

        s._finish = finish
    steps = _drive_async(asy, lambda s, sched: _check_pages(s))
    _drive_sync(sync)
    assert keep[id(sync)] == keep[id(asy)]
    assert asy.num_preemptions > 0
    assert all(o.total_num_scheduled_tokens <= 6 for o in steps)
    assert asy.kv.num_free_pages == 7 and not asy.has_in_flight()


def _check_pages(s: AsyncScheduler) -> None:
    for r in s.running:  # pages cover every computed position, placeholders included
        assert len(s.kv.page_ids(r.request_id)) * s.kv.page_size >= r.num_computed_tokens


def test_length_stops_are_not_scheduled_past() -> None:
    s = _make(AsyncScheduler, max_len=9)
    s.add_request(_req("a", 5, max_tokens=2))
    s.add_request(_req("b", 6, max_tokens=None, ignore_eos=True))  # ends at max_model_len = 9
    steps = _drive_async(s)
    fed = {}
    for sched in steps:
        for c in sched.chunks:
            fed[c.req_id] = c.start_position + c.num_tokens
    assert fed == {"a": 6, "b": 8}  # a: prompt + 1 fed output; b: positions < max_model_len - 1
    assert all(len(s.kv.page_ids(r)) == 0 for r in ("a", "b"))


def test_an_output_in_flight_survives_the_preemption_of_its_request() -> None:
    s = _make(AsyncScheduler, pages=3, page_size=4, budget=16)
    s.add_request(_req("a", 4, max_tokens=10, ignore_eos=True))
    s.add_request(_req("b", 4, max_tokens=10, ignore_eos=True))
    first = s.schedule()  # both prefills (2 pages), each samples
    second = s.schedule()  # both need a new page for position 4: b (last admitted) is preempted
    assert second.preempted_req_ids == frozenset({"b"}) and s.get_request("b").status is RequestStatus.PREEMPTED
    assert s.num_in_flight("b") == 1
    third = s.schedule()  # b may not come back before its in-flight output landed
    assert "b" not in third.num_scheduled_tokens
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": 40, "b": 41}))
    b = s.get_request("b")
    assert b.output_token_ids == [41] and b.num_computed_tokens == 0 and s.num_in_flight("b") == 0


def test_a_finished_request_drops_its_extra_row_and_a_reused_id_is_untouched() -> None:
    s = _make(AsyncScheduler)
    s.add_request(_req("a", 3, max_tokens=5))
    first = s.schedule()
    second = s.schedule()  # a's extra row (placeholder) in flight
    (upd,) = s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": EOS}))
    assert upd.finish_reason == "stop" and s.kv.num_free_pages == 100  # freed now: later steps run after it
    s.release("a")
    s.add_request(_req("a", 2, max_tokens=5))  # the id is free again
    assert s.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": 77})) == []
    new = s.get_request("a")
    assert new.output_token_ids == [] and new.status is RequestStatus.WAITING and s.num_in_flight("a") == 0
