"""Asynchronous scheduling on the stand-in model (conftest): every output equals the synchronous engine's
(tokens, finish and stop reasons, logprobs, prompt logprobs, text) over late stops (EOS, stop ids, stop strings,
max_tokens, max_model_len), n > 1, seeded sampling with penalties and min_tokens, preemption and chunked prefill;
an abort in flight, a failing launch, a failing read-back and non-finite logits fail only their requests; the
engine is clean afterwards. The placeholder rows are counted, so a test cannot pass by running synchronously."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.core.async_scheduler import PLACEHOLDER_TOKEN
from deepinfer_engine.core.request import EngineCoreRequest
from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams
from deepinfer_engine.worker.async_runner import AsyncModelRunner

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4], [20], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _spy(llm: LLM) -> list[int]:
    """Counts the placeholder rows the async runner resolves (rows fed from the previous step's device ids), and
    the steps that resolved them in place (row i from the previous step's row i) / by a gather: [rows, in place,
    gathered]."""
    runner = llm.engine.runner
    assert isinstance(runner, AsyncModelRunner)
    seen = [0, 0, 0]
    inner, source = runner._placeholder_rows, runner._source_rows
    last: list[list[int]] = [[]]

    def counted(chunks):
        rows, rids = inner(chunks)
        seen[0] += len(rows)
        last[0] = rows
        return rows, rids

    def sourced(rids):
        src = source(rids)
        seen[1 if src == last[0] == list(range(len(src))) else 2] += 1
        return src

    runner._placeholder_rows = counted
    runner._source_rows = sourced
    return seen


def _clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.waiting and not eng.scheduler.running and not eng.scheduler.requests
    assert eng.scheduler.kv.num_free_pages == eng.plan.num_pages
    assert eng.scheduler.kv.num_free_slots == eng.plan.num_slots


def _view(outs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs]
            + [o.prompt_logprobs, o.error] for o in outs]


def _pair(make_fake_engine, model, **kw) -> tuple[LLM, LLM]:
    return (LLM.from_engine(make_fake_engine(model, **kw)),
            LLM.from_engine(make_fake_engine(model, async_scheduling=True, **kw)))


def _both(make_fake_engine, model, prompts, sp, **kw):
    sync, asy = _pair(make_fake_engine, model, **kw)
    seen = _spy(asy)
    a = sync.generate(prompts, sp, use_tqdm=False)
    b = asy.generate(prompts, sp, use_tqdm=False)
    assert seen[0] > 0, "no placeholder row: the async path did not run"
    _clean(sync)
    _clean(asy)
    return a, b, sync, asy, seen


CASES = {
    "greedy": (GREEDY, {}),
    "sampled_penalties_min_tokens_n2": (SamplingParams(temperature=1.0, top_k=12, max_tokens=7, seed=5, n=2,
                                                       repetition_penalty=1.4, frequency_penalty=0.6,
                                                       presence_penalty=0.3, min_tokens=4, logprobs=3,
                                                       prompt_logprobs=2), {}),
    "preemption_and_chunked_prefill": (SamplingParams(temperature=0.8, max_tokens=8, seed=9, ignore_eos=True,
                                                      logprobs=1, prompt_logprobs=1),
                                       dict(num_pages=8, max_num_batched_tokens=5, max_num_seqs=4)),
    "max_model_len": (SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), dict(max_model_len=16)),
    "one_sequence_per_step": (GREEDY.replace(n=3, temperature=1.0, seed=1), dict(max_num_seqs=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_outputs_equal_sync(make_fake_engine, fake_model, fake_tokenizer, case: str) -> None:
    sp, kw = CASES[case]
    a, b, sync, asy, seen = _both(make_fake_engine, fake_model, PROMPTS, sp, tokenizer=fake_tokenizer, **kw)
    assert _view(a) == _view(b)
    assert seen[1] > 0, "no step resolved its placeholders in place"
    if case in ("sampled_penalties_min_tokens_n2", "preemption_and_chunked_prefill", "max_model_len"):
        assert seen[2] > 0, "no step gathered its placeholders from other rows"
    assert asy.engine.scheduler.num_preemptions > 0 if case == "preemption_and_chunked_prefill" else True
    if case == "max_model_len":  # length stops are known when scheduling: no extra row is ever computed
        assert {c.finish_reason for o in b for c in o.outputs} == {"length"}
        assert asy.engine.total.decode_tokens == sync.engine.total.decode_tokens


def test_late_stops_discard_the_extra_row(make_fake_engine, fake_model, fake_tokenizer) -> None:
    """EOS, a stop id and a stop string found one step late: same outputs; each such stop computed one extra
    decode row (dropped), a max_tokens stop none. A stop id allowed from exactly min_tokens on: the count of
    outputs must include the one in flight."""
    ref = LLM.from_engine(make_fake_engine(fake_model)).generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in ref]
    k = next(i for i in range(2, 6) if toks[3][i] not in toks[3][:i])
    min_stop = toks[3][k]
    eos = toks[0][2]  # prompt 0 stops on EOS at its 3rd token
    stop_id = toks[1][3]
    text = fake_tokenizer.decode(toks[2])
    stop_str = text[1:3]
    sps = [SamplingParams(temperature=0, max_tokens=6),
           SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id], ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=6, stop=[stop_str], ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[min_stop], min_tokens=k, ignore_eos=True)]
    a, b, sync, asy, _ = _both(make_fake_engine, fake_model, PROMPTS[:4], sps, tokenizer=fake_tokenizer, eos=(eos,))
    assert _view(a) == _view(b)
    assert [o.outputs[0].finish_reason for o in b] == ["stop"] * 4
    assert b[1].outputs[0].stop_reason == stop_id and b[2].outputs[0].stop_reason == stop_str
    assert b[3].outputs[0].token_ids == toks[3][: k + 1]
    assert asy.engine.total.decode_tokens - sync.engine.total.decode_tokens == 4


def test_step_n_plus_1_is_launched_before_step_n_is_read(make_fake_engine, fake_model, monkeypatch) -> None:
    """The order that makes the overlap: every launch after the first comes before the host read of the step
    before it, and nothing reads a step's ids before that (no model waits for them: tests/test_async_step.py checks
    the same on V4.1, whose Engram row ids are computed on the device)."""
    from deepinfer_engine.worker.async_output import AsyncOutput

    llm = LLM.from_engine(make_fake_engine(fake_model, async_scheduling=True))
    runner = llm.engine.runner
    log: list[tuple[str, int]] = []
    launch = runner.execute_async

    def logged_launch(sched):
        out = launch(sched)
        out.step_no = sum(1 for e, _ in log if e == "launch")
        log.append(("launch", out.step_no))
        return out

    def logged_read(self, *drop, _inner=AsyncOutput.result):
        log.append(("read", self.step_no))
        return _inner(self, *drop)

    def no_early_ids(self):
        raise AssertionError("a launch must not wait for the previous step's ids")

    monkeypatch.setattr(runner, "execute_async", logged_launch)
    monkeypatch.setattr(AsyncOutput, "result", logged_read)
    monkeypatch.setattr(AsyncOutput, "token_ids", no_early_ids)
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    reads = [n for e, n in log if e == "read"]
    assert reads == sorted(reads) and len(reads) >= 6
    for n in reads:
        if n + 1 in {m for e, m in log if e == "launch"}:
            assert log.index(("launch", n + 1)) < log.index(("read", n))


def test_abort_in_flight_frees_everything(make_fake_engine, fake_model) -> None:
    eng = make_fake_engine(fake_model, async_scheduling=True)
    eng.add_request("r", PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True, seed=1))
    eng.add_request("s", PROMPTS[1], GREEDY)
    for _ in range(3):
        assert not any(o.finished for o in eng.step())
    assert eng.core._async.busy  # a step holding r's rows is in flight
    eng.abort_request("r")
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert [c.finish_reason for c in finals["r"].outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) == 2 for c in finals["r"].outputs)  # the in-flight third token is dropped
    alone = LLM.from_engine(make_fake_engine(fake_model)).generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert finals["s"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    _clean(LLM.from_engine(eng))


class _Poisoned:
    """Wraps an async runner: the step feeding `poison` raises `exc` at launch (`at="launch"`) or when its
    results are read back (`at="result"`)."""

    def __init__(self, runner, poison: int, at: str, exc: BaseException | None = None) -> None:
        self.runner, self.poison, self.at = runner, poison, at
        self.exc = exc if exc is not None else RuntimeError("boom")
        self.states = runner.states

    def execute_async(self, sched):
        hit = any(self.poison in c.token_ids for c in sched.chunks)
        if hit and self.at == "launch":
            raise self.exc
        out = self.runner.execute_async(sched)
        if hit:
            def fail():
                raise RuntimeError("boom")
            out.result = fail
        return out


@pytest.mark.parametrize("at", ["launch", "result"])
def test_a_failing_step_fails_only_its_requests(make_fake_engine, fake_model, at: str) -> None:
    alone = [o.outputs[0].token_ids for o in
             LLM.from_engine(make_fake_engine(fake_model)).generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)]
    eng = make_fake_engine(fake_model, max_num_seqs=1, async_scheduling=True)
    eng.core.runner = _Poisoned(eng.core.runner, 33, at)
    llm = LLM.from_engine(eng)
    outs = llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "RuntimeError: boom" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    _clean(llm)
    # batched: the requests of the failing step fail, the others complete as alone
    eng = make_fake_engine(fake_model, max_num_batched_tokens=3, async_scheduling=True)
    eng.core.runner = _Poisoned(eng.core.runner, 33, at)
    llm = LLM.from_engine(eng)
    outs = llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert outs[2].outputs[0].token_ids == alone[1]
    _clean(llm)


def test_an_interrupted_call_leaves_the_engine_clean(make_fake_engine, fake_model) -> None:
    eng = make_fake_engine(fake_model, async_scheduling=True)
    eng.core.runner = _Poisoned(eng.core.runner, 33, "launch", KeyboardInterrupt())
    llm = LLM.from_engine(eng)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY.replace(n=2), use_tqdm=False)
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert not eng.output_processor.has_unfinished_requests()
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)
    alone = LLM.from_engine(make_fake_engine(fake_model)).generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    _clean(llm)
    assert len(eng.scheduler._owners) <= 4


class _NanModel:
    def __init__(self, model, mark: int) -> None:
        self.model, self.mark = model, mark

    def __call__(self, batch, cache) -> torch.Tensor:
        logits = self.model(batch, cache)
        marked = batch.input_ids[batch.logits_indices] == self.mark
        return torch.where(marked[:, None], torch.full_like(logits, float("nan")), logits)


def test_non_finite_logits_mid_decode_fail_only_that_request(make_fake_engine, fake_model) -> None:
    ref = LLM.from_engine(make_fake_engine(fake_model)).generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    others = set(PROMPTS[0] + PROMPTS[1] + PROMPTS[2] + ref[0].outputs[0].token_ids + ref[2].outputs[0].token_ids)
    mine = ref[1].outputs[0].token_ids
    # the row fed request 1's output i (a token nobody else feeds) gives NaN logits: output i + 1 is invalid
    i = next(k for k in range(1, 4) if mine[k] not in others and mine[k] not in mine[:k])
    mark = mine[i]
    sync, asy = (LLM.from_engine(make_fake_engine(_NanModel(fake_model, mark), async_scheduling=a))
                 for a in (False, True))
    a = sync.generate(PROMPTS[:3], GREEDY.replace(logprobs=1), use_tqdm=False)
    b = asy.generate(PROMPTS[:3], GREEDY.replace(logprobs=1), use_tqdm=False)
    assert _view(a) == _view(b)
    assert b[1].outputs[0].finish_reason == "error" and f"output position {i + 1}" in b[1].error
    assert b[1].outputs[0].token_ids == mine[: i + 1]
    _clean(asy)


def test_a_reused_id_never_gets_a_stale_result(make_fake_engine, fake_model) -> None:
    """A request that stops on a stop id has an extra row in flight when its final delta is returned; a new
    request under the same id, added right then, is unaffected by that row."""
    ref = LLM.from_engine(make_fake_engine(fake_model)).generate([PROMPTS[0], PROMPTS[4]], GREEDY, use_tqdm=False)
    stop_id = ref[0].outputs[0].token_ids[1]
    core = make_fake_engine(fake_model, async_scheduling=True).core
    sp = GREEDY.replace(stop_token_ids=[stop_id])
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=tuple(PROMPTS[0]), sampling=sp, seed=0,
                                       max_tokens=6, stop_token_ids=(stop_id,), ignore_eos=True))
    while not any(d.finished for d in core.step()):
        pass
    assert core._async.busy
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=tuple(PROMPTS[4]), sampling=GREEDY,
                                       seed=0, max_tokens=6, ignore_eos=True))
    got = []
    while core.has_unfinished_requests():
        got += [t for d in core.step() for t in d.new_token_ids]
    assert got == ref[1].outputs[0].token_ids


def test_async_option_needs_an_async_runner_and_one_rank(make_fake_engine, fake_model) -> None:
    from deepinfer_engine.core.async_scheduler import AsyncScheduler
    from deepinfer_engine.engine import EngineCore
    from deepinfer_engine.errors import ConfigError

    core = make_fake_engine(fake_model).core
    with pytest.raises(ConfigError, match="async_scheduling: found True with a ModelRunner"):
        EngineCore(config=core.config.replace(async_scheduling=True), runner=core.runner, plan=core.plan,
                   max_model_len=core.max_model_len)
    runner = make_fake_engine(fake_model, async_scheduling=True).core.runner
    # speculation runs asynchronously by reading each round back before scheduling the next (no placeholders)
    spec = EngineCore(config=core.config.replace(async_scheduling=True, speculative_method="dspark"), runner=runner,
                      plan=core.plan, max_model_len=core.max_model_len)
    assert spec._async.collect_first and not isinstance(spec.scheduler, AsyncScheduler)
    with pytest.raises(ConfigError, match="async_scheduling: found True with data_parallel_size=2"):
        EngineCore(config=core.config.replace(async_scheduling=True, data_parallel_size=2), runner=runner,
                   plan=core.plan, max_model_len=core.max_model_len)


def test_placeholder_is_never_a_vocabulary_id() -> None:
    assert PLACEHOLDER_TOKEN < 0
