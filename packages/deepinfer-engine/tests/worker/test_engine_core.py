"""Engine core + input / output processors on the stand-in model (conftest): token deltas, token state stored once,
admission errors, failing steps, non-finite logits, interrupted calls — and after each, the engine is clean and a
fresh call gives the outputs a request has alone."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.core.request import EngineCoreRequest
from deepinfer_engine.errors import DeepInferError, InputError
from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4], [20]]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
NAN_MARK = 39  # the stand-in below returns NaN logits for a row whose input token is this id


def _clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert not eng.output_processor.has_unfinished_requests()
    assert not eng.scheduler.waiting and not eng.scheduler.running and not eng.scheduler.requests
    assert eng.scheduler.kv.num_free_pages == eng.plan.num_pages


def _alone(make_fake_engine, fake_model, prompts, sp=GREEDY) -> list[list[int]]:
    llm = LLM.from_engine(make_fake_engine(fake_model))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_core_step_returns_deltas_and_stores_tokens_once(fake_model, make_fake_engine) -> None:
    core = make_fake_engine(fake_model).core
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=(5, 6, 7), sampling=GREEDY, seed=0,
                                       max_tokens=3))
    deltas = []
    while core.has_unfinished_requests():
        step = core.step()
        assert all(len(d.new_token_ids) <= 1 for d in step)
        if len(deltas) == 0 and step:
            req = core.scheduler.requests["a"]
            state = core.runner.states["a"]
            # the runner reads the scheduler's lists: one store of the sampled ids
            assert state.output_ids is req.output_token_ids and state.prompt_ids is req.prompt_token_ids
        deltas.extend(step)
    assert [t for d in deltas for t in d.new_token_ids] == _alone(make_fake_engine, fake_model, [[5, 6, 7]],
                                                                   GREEDY.replace(max_tokens=3))[0]
    assert deltas[-1].finish_reason == "length" and "a" not in core.scheduler.requests
    with pytest.raises(InputError, match="already in use"):
        core.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=(1,), sampling=GREEDY, seed=0,
                                           max_tokens=1))
        core.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=(1,), sampling=GREEDY, seed=0,
                                           max_tokens=1))


def test_invalid_request_raises_before_anything_is_queued(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model))
    assert llm.engine.input_processor.vocab_size == 40
    alone = _alone(make_fake_engine, fake_model, PROMPTS)
    bad_cases = [
        (PROMPTS[:1] + [[3, 40]] + PROMPTS[1:], GREEDY, r"prompts\[1\]\[1\]: found token id 40, expected an "
                                                        r"integer in \[0, 40\)"),
        ([PROMPTS[0], {"prompt_token_ids": [0, 5.7]}], GREEDY, r"prompts\[1\]\['prompt_token_ids'\]\[1\]: found 5.7"),
        ([PROMPTS[0], {"prompt_token_ids": [0, True]}], GREEDY, r"found True \(bool\)"),
        ([PROMPTS[0], [1, -2]], GREEDY, "found token id -2"),
        ([0, 5.7], GREEDY, r"prompts\[0\]\[1\]: found 5.7 \(float\)"),
        ([PROMPTS[0], {"prompt": 5}], GREEDY, r"prompts\[1\]\['prompt'\]: found int"),
        ([PROMPTS[0], PROMPTS[1]], [GREEDY, GREEDY.replace(logprobs=41)],
         r"sampling_params\[1\].logprobs: found 41, expected None or an integer in \[0, 40\]"),
        ([PROMPTS[0], PROMPTS[1]], [GREEDY, GREEDY.replace(prompt_logprobs=10**6)], "prompt_logprobs: found 1000000"),
        ([PROMPTS[0], PROMPTS[1]], [GREEDY, GREEDY.replace(stop_token_ids=[200000], min_tokens=2)],
         r"stop_token_ids: found 200000, expected token ids in \[0, 40\)"),
        ([PROMPTS[0], PROMPTS[1]], [GREEDY, "greedy"], r"sampling_params\[1\]: found str"),
    ]
    for prompts, sp, msg in bad_cases:
        with pytest.raises(InputError, match=msg):
            llm.generate(prompts, sp, use_tqdm=False)
        _clean(llm)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == alone
        _clean(llm)
    # text prompts: a lone surrogate is an input error, not a tokenizer TypeError
    llm.engine.input_processor.tokenizer = object()
    with pytest.raises(InputError, match=r"prompts\[0\]: found a lone surrogate U\+D800 at character 2"):
        llm.generate(["ab\ud800c"], GREEDY, use_tqdm=False)
    _clean(llm)


def test_batch_files_get_admission_errors_as_outputs(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model))
    alone = _alone(make_fake_engine, fake_model, PROMPTS[:2])
    outs = llm.generate_chat([None] * 3, [GREEDY, GREEDY.replace(logprobs=1000000), GREEDY],
                             prompts=[PROMPTS[0], PROMPTS[2], PROMPTS[1]], use_tqdm=False, on_invalid="error")
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == alone
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "error"
    assert "sampling_params[1].logprobs: found 1000000" in outs[1].error
    _clean(llm)


class _FailingRunner:
    """Wraps a runner; the step that feeds `poison` raises (an internal bug in that step)."""

    def __init__(self, runner, poison: int, exc: BaseException) -> None:
        self.runner, self.poison, self.exc = runner, poison, exc
        self.states = runner.states

    def execute(self, sched):
        if any(self.poison in c.token_ids for c in sched.chunks):
            raise self.exc
        return self.runner.execute(sched)


def test_a_failing_step_fails_only_its_requests(fake_model, make_fake_engine) -> None:
    alone = _alone(make_fake_engine, fake_model, [PROMPTS[0], PROMPTS[2]])
    # one sequence per step: the step that raises holds only the poisoned request
    eng = make_fake_engine(fake_model, max_num_seqs=1)
    eng.core.runner = _FailingRunner(eng.core.runner, 33, RuntimeError("boom"))
    llm = LLM.from_engine(eng)
    outs = llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "RuntimeError: boom" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].error is None and outs[2].error is None
    _clean(llm)
    # batched: every request computed in the failing step fails (its cache rows are suspect), the rest completes
    eng = make_fake_engine(fake_model, max_num_batched_tokens=3)
    eng.core.runner = _FailingRunner(eng.core.runner, 33, RuntimeError("boom"))
    llm = LLM.from_engine(eng)
    outs = llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert outs[2].outputs[0].token_ids == alone[1]
    _clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)] == alone[:1]


def test_an_interrupted_call_leaves_the_engine_clean(fake_model, make_fake_engine) -> None:
    eng = make_fake_engine(fake_model)
    eng.core.runner = _FailingRunner(eng.core.runner, 33, KeyboardInterrupt())
    llm = LLM.from_engine(eng)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], [33, 34], PROMPTS[2]], GREEDY.replace(n=2), use_tqdm=False)
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert not eng.output_processor.has_unfinished_requests()
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _alone(make_fake_engine, fake_model, [PROMPTS[0], PROMPTS[2]])
    _clean(llm)


class _NanModel:
    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, batch, cache) -> torch.Tensor:
        logits = self.model(batch, cache)
        marked = batch.input_ids[batch.logits_indices] == NAN_MARK
        return torch.where(marked[:, None], torch.full_like(logits, float("nan")), logits)


def test_non_finite_logits_finish_the_request_with_an_error(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(_NanModel(fake_model)))
    alone = _alone(make_fake_engine, fake_model, [PROMPTS[0], PROMPTS[2]])
    outs = llm.generate([PROMPTS[0], [3, NAN_MARK], PROMPTS[2]], GREEDY.replace(logprobs=1), use_tqdm=False)
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "not finite (NaN or Inf) at output position 0" in bad.error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    _clean(llm)


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(fake_model, make_fake_engine,
                                                                  fake_tokenizer) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model, tokenizer=fake_tokenizer))
    (ref,) = llm.generate([PROMPTS[1]], GREEDY.replace(max_tokens=5), use_tqdm=False)
    text = ref.outputs[0].text
    assert len(text) == 5 and ref.outputs[0].finish_reason == "length"
    stop = text[3:5]  # completed by token 5, the last one max_tokens allows
    assert text.find(stop) == 3
    (o,) = llm.generate([PROMPTS[1]], GREEDY.replace(max_tokens=5, stop=[stop]), use_tqdm=False)
    co = o.outputs[0]
    assert (co.finish_reason, co.stop_reason, co.text) == ("stop", stop, text[:3])
    _clean(llm)


def test_seeds_beyond_63_bits_do_not_collide(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model))
    base = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    seeds = [0, 2**63, 2**64, -1, 2**64 - 1, 10**30, -(10**30)]
    outs = llm.generate([PROMPTS[3]] * len(seeds), [base.replace(seed=s) for s in seeds], use_tqdm=False)
    runs = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(runs)) == len(seeds)
    again = llm.generate([PROMPTS[3]], base.replace(seed=10**30), use_tqdm=False)[0].outputs[0].token_ids
    assert tuple(again) == runs[5]


def test_n_samples_fan_in_and_abort(fake_model, make_fake_engine) -> None:
    eng = make_fake_engine(fake_model)
    eng.add_request("r", PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=1))
    eng.step()
    eng.step()
    eng.abort_request("r")
    finals = [o for o in eng.step() if o.finished]
    assert len(finals) == 1 and [c.finish_reason for c in finals[0].outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 2 for c in finals[0].outputs)
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests


def test_sampling_params_type_errors_are_typed() -> None:
    for kw, field in [(dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
                      (dict(stop=["\ud800"]), "stop"), (dict(seed=2.0), "seed")]:
        with pytest.raises(DeepInferError, match=f"SamplingParams.{field}: found"):
            SamplingParams(**kw)


def test_a_colliding_sample_id_adds_nothing(fake_model, make_fake_engine) -> None:
    eng = make_fake_engine(fake_model)
    eng.add_request("r#1", PROMPTS[0], GREEDY)
    with pytest.raises(InputError, match="'r#1' is already in use"):
        eng.add_request("r", PROMPTS[1], GREEDY.replace(n=2))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(outs) == ["r#1"] and outs["r#1"].outputs[0].finish_reason == "length"
    assert not eng.scheduler.requests and not eng.output_processor.has_unfinished_requests()
