"""Prefix caching end to end on tiny V4.1 and V4 checkpoints (CPU, fp32): multi-turn conversations that hit at
unaligned lengths give the greedy outputs of a run without the cache (exact replay), also with eviction forced
by a small cache and with the host tier; approximate replay runs, replays at most a window, leaves the cached
pages untouched and its divergence is measured; n > 1 samples share their prompt and sample as unshared."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
BASE = list(range(100, 137))  # 37 ids


@pytest.fixture(scope="module")
def llms(tiny_ckpt):
    """`(arch, **options) -> LLM`, one per distinct configuration and module (loading dominates the runtime)."""
    made: dict[tuple, LLM] = {}

    def get(arch: str, **kw) -> LLM:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LLM(str(tiny_ckpt(arch)), device="cpu", dtype="float32", page_size=4 if arch == "v41" else 8,
                            **kw)
        return made[key]

    return get


def _conversation(llm: LLM) -> list:
    """A fresh prompt, an unrelated one (evicts the first from a small cache), an extension of the first, one
    sharing only a part of it, the first turn's prompt + its answer + more (multi-turn). Hits land at unaligned
    prompt lengths. Returns each turn's RequestOutput."""
    outs = []
    for prompt in ([0] + BASE, [0] + list(range(300, 339)), [0] + BASE + list(range(200, 211)),
                   [0] + BASE[:21] + [7, 8, 9]):
        (o,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        outs.append(o)
    first = outs[0]
    (o,) = llm.generate([first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]], GREEDY, use_tqdm=False)
    outs.append(o)
    return outs


@pytest.mark.slow  # ~10-20 s per arch on 2 busy cores (3 engines): the main proof of exact replay
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_exact_replay_equals_no_cache_with_eviction_and_host_tier(llms, arch: str) -> None:
    ref = [o.outputs[0].token_ids for o in _conversation(llms(arch, enable_prefix_caching=False))]
    page = 4 if arch == "v41" else 8
    # 64 tokens of pages: the unrelated turn evicts the first turn's tail pages (to the host tier when it is on)
    small = {"num_kv_pages": 64 // page, "num_prefix_state_slots": 32}
    # (dropping evicted pages without a host tier is bookkeeping only: tests/core/test_prefix_cache.py)
    for kw in ({}, {**small, "prefix_cache_host_bytes": 2**20}):
        llm = llms(arch, **kw)
        kv = llm.engine.scheduler.kv
        before = (kv.stats.hits, kv.stats.host_loaded_pages, kv.pool.num_evicted)
        outs = _conversation(llm)
        assert [o.outputs[0].token_ids for o in outs] == ref, kw
        cached = [o.num_cached_tokens for o in outs]
        assert cached[0] == 0 and all(c % page == 0 for c in cached) and kv.stats.hits - before[0] >= 2, (kw, cached)
        assert cached[2] > 0 and cached[4] > 0, (kw, cached)
        assert all(o.metrics.num_replayed_tokens == 0 for o in outs)  # exact: resumes at the state block
        if "num_kv_pages" in kw:  # evicted to the host tier and loaded back
            assert kv.pool.num_evicted > before[2] and kv.stats.host_loaded_pages > before[1], kw


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_approximate_replay_bounds_and_leaves_cached_pages_alone(llms, arch: str) -> None:
    llm = llms(arch, prefix_replay="approximate")
    window, page = int(llm.engine.args.sliding_window), llm.engine.plan.page_size
    cache = llm.engine.runner.cache
    (first,) = llm.generate([[0] + BASE], GREEDY, use_tqdm=False)
    pool = llm.engine.scheduler.kv.pool
    cached = [p for p in range(llm.engine.plan.num_pages) if pool.hash_of(p) is not None]
    before = {k: t[cached].clone() for k, t in cache._paged_stores()}
    (o,) = llm.generate([[0] + BASE + [3, 4, 5]], GREEDY, use_tqdm=False)
    assert o.num_cached_tokens > 0 and 0 < o.metrics.num_replayed_tokens <= min(window, o.num_cached_tokens)
    assert o.metrics.num_replayed_tokens <= window + page
    for k, t in cache._paged_stores():  # the replayed rows never rewrote a shared page
        assert torch.equal(t[cached], before[k]), k
    assert len(o.outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_n_samples_share_the_prompt_and_sample_as_unshared(llms, mode: str) -> None:
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=5, ignore_eos=True)
    prompt = [0] + list(range(500, 518))  # 19 tokens: 4 full pages of 4
    (off,) = llms("v41", enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)
    llm = llms("v41") if mode == "exact" else llms("v41", prefix_replay="approximate")
    hits, forks = llm.engine.scheduler.kv.stats.hits, llm.engine.scheduler.kv.stats.forks
    (on,) = llm.generate([prompt], sp, use_tqdm=False)
    assert [c.token_ids for c in on.outputs] == [c.token_ids for c in off.outputs]
    # the other two samples forked the first one's live state after its prefill: its slot cloned, 4 full pages
    # shared, the page of position 18 copied, one token (the prompt's last) computed each
    assert on.num_cached_tokens == 18
    assert llm.engine.scheduler.kv.stats.hits - hits == 2 and llm.engine.scheduler.kv.stats.forks - forks == 2


def test_prompt_logprobs_are_computed_not_served_from_the_cache(llms) -> None:
    prompt = [0] + list(range(600, 630))
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm = llms("v41")
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the whole prompt is cached now
    (on,) = llm.generate([prompt], sp, use_tqdm=False)
    (off,) = llms("v41", enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)
    assert on.num_cached_tokens == 0 and len(on.prompt_logprobs) == len(prompt)
    got = [(x.token_id, round(x.logprob, 4)) for x in on.prompt_logprobs if x is not None]
    want = [(x.token_id, round(x.logprob, 4)) for x in off.prompt_logprobs if x is not None]
    assert got == want and len(got) == len(prompt) - 1


def test_a_batch_mixing_hits_and_forks_equals_no_cache(llms) -> None:
    """Prompts that share only their BOS with requests admitted in the same step (whose slots are restored in
    that step) must not fork from them; every first-token distribution equals the uncached one."""
    prompts = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    got = {}
    for name, llm in (("on", llms("v41")), ("off", llms("v41", enable_prefix_caching=False))):
        llm.generate(prompts, GREEDY, use_tqdm=False)  # cache them (on)
        got[name] = [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs]
                     for o in llm.generate(prompts, sp, use_tqdm=False)]
    for on, off in zip(got["on"], got["off"]):
        assert [t for t, _ in on] == [t for t, _ in off]
        assert max(abs(a - b) for (_, a), (_, b) in zip(on, off)) < 1e-4


def test_exact_replay_under_prefill_truncation_equals_no_cache(llms) -> None:
    """With decoder truncation a prefill leaves decoder window rows only for its last KEEP positions: state blocks
    are then taken only where a chunk stops inside that tail (every decode boundary), never inside a truncated
    forward, and forks only from requests past their prompt; outputs still equal the uncached engine's."""
    trunc = {"prefill_truncation": "compact", "prefill_truncation_keep": 16}
    ref = [o.outputs[0].token_ids for o in _conversation(llms("v41", enable_prefix_caching=False, **trunc))]
    llm = llms("v41", **trunc)
    outs = _conversation(llm)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[4].num_cached_tokens > 0  # the multi-turn continuation resumes at a boundary its decode reached


def test_exact_replay_with_async_scheduling_equals_no_cache(llms, monkeypatch) -> None:
    """Asynchronous scheduling advances a request's progress when a step is planned and lands its sample one
    step late; hits, forks and state blocks still give the uncached outputs. No launch waits for the previous
    step's ids (Engram hashes on the device, from the device token ring the hits and forks set)."""
    from deepinfer_engine.worker.async_output import AsyncOutput

    ref = [o.outputs[0].token_ids for o in _conversation(llms("v41", enable_prefix_caching=False))]
    monkeypatch.setattr(AsyncOutput, "token_ids", lambda self: pytest.fail("a launch waited for host ids"))
    llm = llms("v41", async_scheduling=True)
    outs = _conversation(llm)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[2].num_cached_tokens > 0 and outs[4].num_cached_tokens > 0
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=5, ignore_eos=True)
    prompt = [0] + list(range(700, 718))
    (off,) = llms("v41", enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)
    (on,) = llm.generate([prompt], sp, use_tqdm=False)
    assert [c.token_ids for c in on.outputs] == [c.token_ids for c in off.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forks_under_preemption_equal_no_cache(tiny_ckpt, async_scheduling: bool) -> None:
    """n = 2 seeded sampling with penalties in a 5-page cache (preemption, forks from running requests, state
    blocks) gives the ids of the uncached engine. Here a request once forked 8 tokens behind an unrelated source
    that had been resumed from a state block at position 8 (its rings held nothing a step at 1 reads) and got a
    different first token: forks now respect the source's resume floor."""
    ckpt = tiny_ckpt("v41")
    prompts = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
    sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=3, n=2, repetition_penalty=1.3,
                        ignore_eos=True)

    def run(**kw) -> list:
        llm = LLM(str(ckpt), device="cpu", dtype="float32", page_size=4, num_kv_pages=5, max_num_batched_tokens=7,
                  max_num_seqs=4, async_scheduling=async_scheduling, **kw)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)]

    assert run() == run(enable_prefix_caching=False)
