"""Bad input never breaks the engine (hypothesis, public API, tiny real checkpoint on CPU).

Every call mixes fixed valid greedy requests with random prompts and random SamplingParams values (many of them
invalid). After every call: nothing but a typed error escaped (construction of SamplingParams: its ValueError;
`LLM.generate`: InputError, raised only when one of the random requests is inadmissible on its own, and then
nothing of the call ran); when the call returned, the valid requests have exactly the outputs they have alone;
the engine is clean (no queued or tracked leftovers, every cache page free) and a fresh valid call works. The
random calls run on four engines: the default one, asynchronous scheduling, DSpark speculation (cost policy on a fixed latency curve: no start-up profile) and
DSpark with asynchronous scheduling (threshold policy); the valid requests' outputs are those of the default
engine alone on every one of them (fp32: speculation and asynchronous scheduling are exact).
CI runs 10 examples per engine; DEEPINFER_FUZZ_EXAMPLES=N runs N.
"""

from __future__ import annotations

import os

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.errors import DeepInferError, InputError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

MAX_MODEL_LEN = 24
VALID = [[0, 11, 12, 13], [0, 40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt) -> LLM:
    return LLM(tiny_ckpt("v41"), device="cpu", dtype="float32", page_size=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in VALID]


ENGINES = {
    "default": {},
    "async": dict(async_scheduling=True),
    "dspark": dict(speculative_config={"method": "dspark", "policy": "cost", "latency": "affine:0.02,0.0005"}),
    "dspark_async": dict(speculative_config={"method": "dspark", "policy": "threshold"}, async_scheduling=True),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def any_llm(request, llm: LLM, tiny_ckpt) -> LLM:
    """The default engine, or one with the scheduling / speculation options of ENGINES on the same checkpoint."""
    if not ENGINES[request.param]:
        return llm
    out = LLM(tiny_ckpt("v41"), device="cpu", dtype="float32", page_size=4, max_model_len=MAX_MODEL_LEN,
              **ENGINES[request.param])
    assert (out.engine.runner.spec is not None) == request.param.startswith("dspark")
    assert out.config.scheduler.async_scheduling == request.param.endswith("async")
    return out


def _vocab(llm: LLM) -> int:
    return llm.engine.input_processor.vocab_size


def _param_values(v: int, *, bad: bool) -> dict[str, st.SearchStrategy]:
    """Per field: admissible values, plus (bad=True) out-of-range, wrong-type and model-dependent bad ones."""
    good = {
        "n": [1, 2], "max_tokens": [1, 3], "min_tokens": [0, 2], "temperature": [0, 0.7, 1.5],
        "top_p": [1.0, 0.5], "top_k": [0, -1, 1, 50, v + 5], "min_p": [0.0, 0.2, 1.0],
        "repetition_penalty": [1.0, 1.3], "presence_penalty": [0.0, 1.5], "frequency_penalty": [0.0, -1.0],
        "seed": [None, 0, 2**63, 2**64 + 1, -1, 10**30], "stop": [None, "a", ["the", "x"]],
        "stop_token_ids": [None, [1], [v - 1]], "ignore_eos": [False, True], "logprobs": [None, 0, 2],
        "prompt_logprobs": [None, 0, 3], "include_stop_str_in_output": [False, True],
        "skip_special_tokens": [True, False],
    }
    wrong = {
        "n": [0, -1, True], "max_tokens": [None, 0, -2, 2.5], "min_tokens": [-1, 5],
        "temperature": [-1.0, float("nan"), float("inf"), "1"], "top_p": [0.0, 1.5], "top_k": [-2],
        "min_p": [-0.1], "repetition_penalty": [0.0, -1.0], "presence_penalty": [3.0], "frequency_penalty": [2.5],
        "seed": [1.5], "stop": [5, [""], ["\ud800"]], "stop_token_ids": [[v], [200000], 5, [-1]],
        "ignore_eos": [1], "logprobs": [v + 1, 10**6, -1], "prompt_logprobs": [v + 1],
    }
    return {k: st.sampled_from(vals + (wrong.get(k, []) if bad else [])) for k, vals in good.items()}


def _prompts(v: int, *, bad: bool) -> st.SearchStrategy:
    ids = st.lists(st.integers(1, 2000), min_size=0, max_size=6).map(lambda t: [0, *t])
    valid = [ids, st.text(max_size=12), st.sampled_from(
        ["", "héllo wörld", [], [0] * (MAX_MODEL_LEN + 3), {"prompt_token_ids": [0, 7]}, {"prompt": "dict text"}])]
    if bad:
        valid.append(st.sampled_from([
            "ab\ud800c", [0, 5.7], [0, True], [0, -3], [0, v], [0, 10**20], {"prompt_token_ids": [0, 5.7]},
            {"prompt": 5}, {"foo": 1}, {}, None, 3.5, b"bytes", ["a", "b"]]))
    return st.one_of(*valid)


@st.composite
def _random_request(draw, v: int):
    kw = draw(st.fixed_dictionaries({}, optional=_param_values(v, bad=draw(st.booleans()))))
    return draw(_prompts(v, bad=draw(st.booleans()))), kw


def _check_clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert not eng.output_processor.has_unfinished_requests()
    assert not eng.scheduler.waiting and not eng.scheduler.running and not eng.scheduler.requests
    assert eng.scheduler.kv.num_free_pages == eng.plan.num_pages


def _inadmissible(llm: LLM, prompt, sp) -> bool:
    try:
        llm.engine.process_input(prompt, sp)
    except InputError:
        return True
    return False


@settings(max_examples=int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "10")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_requests_never_break_the_engine(any_llm: LLM, alone: list[list[int]], data) -> None:
    llm = any_llm
    v = _vocab(llm)
    randoms = data.draw(st.lists(_random_request(v), min_size=1, max_size=3), label="random requests")
    built = []
    for prompt, kw in randoms:
        try:
            built.append((prompt, SamplingParams(**kw)))
        except DeepInferError as exc:  # typed, and a ValueError naming the field
            assert isinstance(exc, ValueError) and "SamplingParams." in str(exc)
    positions = data.draw(st.permutations(range(len(built) + len(VALID))), label="order")
    reqs = [None] * len(positions)
    for k, pos in enumerate(positions):
        reqs[pos] = (VALID[k], GREEDY) if k < len(VALID) else built[k - len(VALID)]
    try:
        outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    except InputError:
        event("call rejected at admission")
        assert any(_inadmissible(llm, p, sp) for p, sp in built)
    else:
        event("call served")
        assert len(outs) == len(reqs)
        for k in range(len(VALID)):
            out = outs[positions[k]]
            assert out.error is None and out.outputs[0].token_ids == alone[k]
        for (_p, sp), out in zip(reqs, outs):
            assert out.finished and len(out.outputs) == sp.n
            for co in out.outputs:
                assert co.finish_reason in ("stop", "length", "error")
                assert (co.finish_reason == "error") == (out.error is not None)
                assert sp.max_tokens is None or len(co.token_ids) <= sp.max_tokens
    _check_clean(llm)
    (fresh,) = llm.generate([VALID[0]], GREEDY, use_tqdm=False)
    assert fresh.outputs[0].token_ids == alone[0]
    _check_clean(llm)


def test_path_model_and_typed_prompt_errors(llm: LLM, alone: list[list[int]]) -> None:
    from pathlib import Path

    ckpt = Path(llm.engine.model_dir)
    other = LLM(ckpt, tokenizer=ckpt / "tokenizer.json", device="cpu", dtype="float32", page_size=4,
                max_model_len=MAX_MODEL_LEN)
    assert other.generate([VALID[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0]
    v = _vocab(llm)
    for prompt, msg in [("ab\ud800", r"lone surrogate U\+D800"), ({"prompt_token_ids": [0, 5.7]}, "found 5.7"),
                        ([0, v], f"expected an integer in \\[0, {v}\\)")]:
        with pytest.raises(InputError, match=msg):
            llm.generate([VALID[1], prompt], GREEDY, use_tqdm=False)
        _check_clean(llm)
    for kw, field in [(dict(logprobs=v + 1), "logprobs"), (dict(prompt_logprobs=v + 1), "prompt_logprobs"),
                      (dict(stop_token_ids=[200000], min_tokens=2), "stop_token_ids")]:
        with pytest.raises(InputError, match=rf"sampling_params\[1\]\.{field}: found"):
            llm.generate(VALID, [GREEDY, GREEDY.replace(**kw)], use_tqdm=False)
        _check_clean(llm)
    outs = llm.generate(VALID, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
