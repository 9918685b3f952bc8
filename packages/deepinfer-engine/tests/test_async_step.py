"""Asynchronous scheduling on real tiny checkpoints (V4.1 with Engram, hashed on the device from the placeholder ids
resolved there: no launch waits for the previous step's ids; V4), CPU float32: every output equals the synchronous engine's over a mixed batch with chunked
prefill and forced preemption, late stops by stop id and stop string, max_tokens, n > 1 seeded sampling with
penalties, logprobs; an abort in flight leaves the engine clean. GPU: the same equality on CUDA."""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.worker.async_runner import AsyncModelRunner

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]


def _llm(ckpt, arch: str, async_scheduling: bool, device: str = "cpu") -> LLM:
    # 5 pages x 4 (3 x 8) tokens: preemption is forced; a budget of 7 tokens chunks the long prompts
    page = 4 if arch == "v41" else 8
    return LLM(str(ckpt), device=device, dtype="float32", page_size=page, num_kv_pages=5 if arch == "v41" else 3,
               max_num_batched_tokens=7, max_num_seqs=4, async_scheduling=async_scheduling)


def _count_placeholders(llm: LLM) -> list[int]:
    runner = llm.engine.runner
    assert isinstance(runner, AsyncModelRunner)
    seen, inner = [0], runner._placeholder_rows

    def counted(chunks):
        rows, rids = inner(chunks)
        seen[0] += len(rows)
        return rows, rids

    runner._placeholder_rows = counted
    return seen


def _forbid_early_ids(monkeypatch) -> None:
    """No launch may wait for the previous step's host ids (V4.1 included: Engram hashes on the device)."""
    from deepinfer_engine.worker.async_output import AsyncOutput

    def no_early_ids(self):
        raise AssertionError("a launch waited for the previous step's host ids")

    monkeypatch.setattr(AsyncOutput, "token_ids", no_early_ids)


def _view(outs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] + [o.error] for o in outs]


def _assert_same(a, b) -> None:
    """Ids, text, finish / stop reasons exactly; logprobs to 1e-5: the async scheduler admits and preempts on
    different steps (a finished request frees its pages one scheduling later), and float32 rounding on CPU
    depends on the batch a row was computed in."""
    assert _view(a) == _view(b)
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa.outputs, ob.outputs):
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for la, lb in zip(ca.logprobs or (), cb.logprobs or ()):
                assert (la.token_id, la.rank, [t for t, _ in la.top]) == (lb.token_id, lb.rank, [t for t, _ in lb.top])
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-5)
                assert [v for _, v in la.top] == pytest.approx([v for _, v in lb.top], abs=1e-5)


def _params(ref) -> list[SamplingParams]:
    """Late stops picked from a plain greedy run: a stop id (3rd token of prompt 1), a stop string (inside prompt
    3's text), max_tokens; n = 2 seeded sampling with penalties and logprobs."""
    toks = [o.outputs[0].token_ids for o in ref]
    text = ref[3].outputs[0].text
    stop_str = text[len(text) // 3: len(text) // 3 + 2] if len(text) >= 6 else None
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [greedy,
            greedy.replace(stop_token_ids=[toks[1][2]]),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=5, seed=3, n=2, repetition_penalty=1.3,
                           frequency_penalty=0.4, min_tokens=2, logprobs=2),
            greedy.replace(stop=[stop_str] if stop_str else None),
            greedy.replace(max_tokens=3, logprobs=1)]


@pytest.mark.slow  # ~10 s per arch on 2 busy CPU cores: three generate calls on a tiny model
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_async_equals_sync_on_tiny_checkpoints(tiny_ckpt, arch: str, monkeypatch) -> None:
    ckpt = tiny_ckpt(arch)
    sync = _llm(ckpt, arch, False)
    ref = sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    sps = _params(ref)
    a = sync.generate(PROMPTS, sps, use_tqdm=False)
    asy = _llm(ckpt, arch, True)
    seen = _count_placeholders(asy)
    _forbid_early_ids(monkeypatch)
    b = asy.generate(PROMPTS, sps, use_tqdm=False)
    _assert_same(a, b)
    assert seen[0] > 0 and asy.engine.scheduler.num_preemptions > 0
    assert b[1].outputs[0].finish_reason == "stop" and b[1].outputs[0].stop_reason == sps[1].stop_token_ids[0]
    if sps[3].stop:
        assert b[3].outputs[0].finish_reason == "stop" and b[3].outputs[0].stop_reason == sps[3].stop[0]
    # an abort while a step is in flight: final "abort", everything freed
    eng = asy.engine
    eng.add_request("x", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while not eng.scheduler.requests["x"].output_token_ids:
        eng.step()
    eng.abort_request("x")
    finals = []
    while eng.has_unfinished_requests():
        finals += [o for o in eng.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["abort"]
    assert not eng.scheduler.requests and eng.scheduler.kv.num_free_pages == eng.plan.num_pages


@pytest.mark.gpu
def test_async_equals_sync_on_cuda(tiny_ckpt, monkeypatch) -> None:
    ckpt = tiny_ckpt("v41")
    sps = SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=3, n=2, repetition_penalty=1.3,
                         ignore_eos=True, logprobs=1)
    a = _llm(ckpt, "v41", False, "cuda").generate(PROMPTS, sps, use_tqdm=False)
    asy = _llm(ckpt, "v41", True, "cuda")
    seen = _count_placeholders(asy)
    _forbid_early_ids(monkeypatch)
    b = asy.generate(PROMPTS, sps, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert seen[0] > 0
