"""Runner + scheduler + sampler against the stand-in model: greedy outputs over a mixed batch (chunked prefill,
preemption from a tiny cache) equal a dense cache-free recompute; seeded sampling ignores batch composition;
logprobs and penalties agree with formulas applied to dense logits."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4], [12, 13, 14, 15, 16, 17, 18], [20]]


def _dense_greedy(model, prompt: list[int], n: int, eos: int = 1) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        tok = int(model.dense_logits(ids)[-1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


@pytest.mark.parametrize("num_pages,budget", [(200, 64), (6, 5)])
def test_greedy_mixed_batch_equals_dense_recompute(fake_model, make_fake_engine, num_pages: int, budget: int) -> None:
    eng = make_fake_engine(fake_model, num_pages=num_pages, max_num_batched_tokens=budget)
    llm = LLM.from_engine(eng)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == _dense_greedy(fake_model, prompt, 6)
    if num_pages == 6:  # 24 cached tokens for five sequences of up to 17: must have preempted
        assert eng.scheduler.num_preemptions > 0


def _sample_run(make_fake_engine, model, prompts, params, **kw) -> list[list[int]]:
    llm = LLM.from_engine(make_fake_engine(model, **kw))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_reproducible_and_batch_independent(fake_model, make_fake_engine) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=1234, ignore_eos=True)
    alone = _sample_run(make_fake_engine, fake_model, [PROMPTS[0]], sp)[0]
    again = _sample_run(make_fake_engine, fake_model, [PROMPTS[0]], sp)[0]
    others = [SamplingParams(temperature=0.7, max_tokens=5, seed=s) for s in (1, 2, 3)]
    mixed = _sample_run(make_fake_engine, fake_model, [PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[4]],
                        [others[0], sp, others[1], others[2]], num_pages=7, max_num_batched_tokens=6)
    assert alone == again == mixed[1]
    other_seed = _sample_run(make_fake_engine, fake_model, [PROMPTS[0]], sp.replace(seed=99))[0]
    assert other_seed != alone
    # unseeded requests: derived from the engine seed and arrival order -> reproducible per engine seed
    a = _sample_run(make_fake_engine, fake_model, PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    b = _sample_run(make_fake_engine, fake_model, PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    c = _sample_run(make_fake_engine, fake_model, PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True), seed=7)
    assert a == b and a != c


def test_n_samples_are_distinct_and_reproducible(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model))
    sp = SamplingParams(n=3, temperature=1.5, max_tokens=6, seed=5, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[3]], sp, use_tqdm=False)
    toks = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2] and len({tuple(t) for t in toks}) == 3
    (again,) = LLM.from_engine(make_fake_engine(fake_model)).generate([PROMPTS[3]], sp, use_tqdm=False)
    assert [o.token_ids for o in again.outputs] == toks


def test_logprobs_and_prompt_logprobs_match_dense(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model, max_num_batched_tokens=4))  # prompt of 7 is chunked 4 + 3
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[3]], sp, use_tqdm=False)
    seq = PROMPTS[3] + out.outputs[0].token_ids
    dense = torch.log_softmax(fake_model.dense_logits(seq).double(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[3])
    for j, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == PROMPTS[3][j]
        assert lp.logprob == pytest.approx(dense[j - 1, PROMPTS[3][j]].item(), abs=1e-4)
        assert len(lp.top) == 1
    co = out.outputs[0]
    total = 0.0
    for k, lp in enumerate(co.logprobs):
        row = dense[len(PROMPTS[3]) - 1 + k]
        assert lp.token_id == co.token_ids[k] and lp.rank == 1  # greedy picks the top token
        assert lp.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
        total += lp.logprob
    assert co.cumulative_logprob == pytest.approx(total)


def test_greedy_with_penalties_matches_formula_on_dense_logits(fake_model, make_fake_engine) -> None:
    sp = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.7, frequency_penalty=0.6,
                        presence_penalty=0.4, ignore_eos=True)
    got = _sample_run(make_fake_engine, fake_model, [PROMPTS[0], PROMPTS[2]], sp)
    for prompt, toks in zip([PROMPTS[0], PROMPTS[2]], got):
        ids, out = list(prompt), []
        for _ in range(6):
            logits = fake_model.dense_logits(ids)[-1].double()
            for v in range(logits.shape[0]):
                x = logits[v].item()
                if v in prompt or v in out:
                    x = x / 1.7 if x > 0 else x * 1.7
                x -= 0.6 * out.count(v) + (0.4 if v in out else 0.0)
                logits[v] = x
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
        assert toks == out


def test_stops_min_tokens_and_eos(fake_model, make_fake_engine, fake_tokenizer) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model, tokenizer=fake_tokenizer))
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (ref,) = llm.generate([PROMPTS[1]], base, use_tqdm=False)
    toks, text = ref.outputs[0].token_ids, ref.outputs[0].text
    assert len(text) == 8 and ref.outputs[0].finish_reason == "length"
    stop = text[3:5]
    (o,) = llm.generate([PROMPTS[1]], base.replace(stop=[stop]), use_tqdm=False)
    cut = text.find(stop)
    assert o.outputs[0].text == text[:cut] and o.outputs[0].finish_reason == "stop"
    assert o.outputs[0].stop_reason == stop
    (o,) = llm.generate([PROMPTS[1]], base.replace(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert o.outputs[0].text == text[: cut + 2]
    (o,) = llm.generate([PROMPTS[1]], base.replace(stop_token_ids=[toks[2]]), use_tqdm=False)
    first = toks.index(toks[2])
    assert o.outputs[0].token_ids == toks[: first + 1] and o.outputs[0].stop_reason == toks[2]
    assert o.outputs[0].text == text[:first]
    (o,) = llm.generate([PROMPTS[1]], base.replace(stop_token_ids=[toks[0]], min_tokens=2), use_tqdm=False)
    assert toks[0] not in o.outputs[0].token_ids[:2]


def test_eos_ends_generation_unless_ignored(fake_model, make_fake_engine) -> None:
    # make the model's greedy continuation the EOS id by declaring its first greedy token as EOS
    first = _dense_greedy(fake_model, PROMPTS[0], 1)[0]
    llm = LLM.from_engine(make_fake_engine(fake_model, eos=(first,)))
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert o.outputs[0].token_ids == [first] and o.outputs[0].finish_reason == "stop"
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 5
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, min_tokens=3), use_tqdm=False)
    assert first not in o.outputs[0].token_ids[:3]


def test_impossible_requests_error_alone(fake_model, make_fake_engine) -> None:
    llm = LLM.from_engine(make_fake_engine(fake_model, num_pages=4, max_model_len=30))
    outs = llm.generate([PROMPTS[0], list(range(2, 32)), [7] * 17, PROMPTS[2]],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "max_model_len" in outs[1].error and "kv_cache_memory_bytes" in outs[2].error
    assert outs[0].error is None
    assert outs[3].outputs[0].token_ids == _dense_greedy(fake_model, PROMPTS[2], 3, eos=-1)


def test_abort_request(fake_model, make_fake_engine) -> None:
    eng = make_fake_engine(fake_model)
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    eng.abort_request("a")
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["a"].outputs[0].finish_reason == "abort" and len(finished["a"].outputs[0].token_ids) == 1
    assert finished["b"].outputs[0].finish_reason == "length"
    assert eng.scheduler.kv.num_free_pages == eng.plan.num_pages


def test_prompt_logprobs_survive_preemption_without_duplicates(fake_model, make_fake_engine) -> None:
    eng = make_fake_engine(fake_model, num_pages=6, max_num_batched_tokens=5)
    llm = LLM.from_engine(eng)
    sp = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.prompt_logprobs) == len(prompt)
        dense = torch.log_softmax(fake_model.dense_logits(prompt).double(), -1)
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        want = [dense[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
        assert got == pytest.approx(want, abs=1e-4)
