"""Decode CUDA graphs on the GPU (gpu marker): greedy outputs with graphs equal graphs off (`enforce_eager`),
with mixed prompt lengths and requests finishing / joining between steps so that the batch bucket changes; a
graph-replayed engine decode step makes one host synchronization (the sampled-id read) and its replay none."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from engine_testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["v41", "v4"])
def ckpt(request, tmp_path_factory):
    return request.param, make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)


def _generate(llm: LLM) -> list[list[int]]:
    # lengths across the window and compressed-entry boundaries; max_tokens differ so requests finish at
    # different steps (buckets 8 -> 4 -> 2 -> 1); a second call joins new requests to a fresh batch
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((7, 12, 3, 30, 17, 1, 9))]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 6, 13, 9, 16, 3, 11)]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:3]],
                          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in first + second]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_with_graphs_equals_eager(ckpt, dtype: str) -> None:
    arch, path = ckpt
    eager = _generate(LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=8, enforce_eager=True))
    llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=8)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None
    out = _generate(llm)
    assert out == eager, (arch, dtype)
    st = graphs.stats  # measured on the H200: 28 replays over the 4 shapes (8|4|2|1, 256), 2 eager steps
    assert st.replays >= 20 and {b for b, _ in st.shapes} >= {1, 2, 4, 8}, st
    assert graphs.pool_bytes() != 0  # the captures live in the shared pool (-1: this torch does not say)


def test_graph_decode_step_reads_the_host_once(ckpt) -> None:
    import warnings

    _, path = ckpt
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=False)  # synchronous loop
    eng, graphs = llm.engine, llm.engine.runner.cuda_graphs
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=9, ignore_eos=True, seed=1)
    for i, n in enumerate((7, 12, 3)):
        eng.add_request(f"r{i}", [5 + j for j in range(n)], sp)
    while graphs.stats.replays < 2:  # prefill, then decode steps until the (3 -> 4, 256) graph was captured
        eng.step()
    run = graphs.run

    def replay_guarded(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    graphs.run = replay_guarded
    for _ in range(3):
        before = graphs.stats.replays
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert graphs.stats.replays == before + 1
        # (the first warning of a process is a notice that the mode is a prototype: not a synchronization)
        syncs = [w for w in seen if "called a synchronizing" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_roofline_sets_the_engine_step_against_its_graph_replayed_alone(ckpt) -> None:
    from deepinfer_engine.bench import decode_roofline, format_roofline

    _, path = ckpt
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=4, async_scheduling=False)
    r = decode_roofline(llm, batch_sizes=[1, 4], input_len=16, steps=4)
    for row in r["rows"]:
        # the replay is the forward alone: never slower than the whole engine step that contains it
        assert 0 < row["forward_s"] <= row["step_s"] and row["engine_overhead"] >= 0, row
    assert "overhead" in format_roofline(r)


@pytest.fixture(scope="module")
def records_ckpt(tmp_path_factory):
    """Tiny V4.1 with index_head_dim 32, so that kv_cache_dtype="auto" stores every family as records (tiny's 16
    is not a multiple of MXFP4's 32-channel block)."""
    from deepinfer_engine.model.presets import preset_config
    from deepinfer_engine.model.writer import write_checkpoint

    cfg = preset_config("v41", "tiny")
    cfg["text_config"]["index_head_dim"] = 32
    return write_checkpoint(tmp_path_factory.mktemp("v41rec"), cfg, 0)


def test_record_cache_greedy_with_graphs_equals_eager(records_ckpt) -> None:
    """kv_cache_dtype="auto" on a model whose cache stores records: the decode graphs capture the record writes
    (encode) and the attention's in-place record reads, and give the eager outputs."""
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, kv_cache_dtype="auto")
    eager = _generate(LLM(str(records_ckpt), enforce_eager=True, **kw))
    llm = LLM(str(records_ckpt), **kw)
    assert llm.engine.runner.cache.entry_format() is not None
    out = _generate(llm)
    assert out == eager
    graphs = llm.engine.runner.cuda_graphs
    assert graphs.stats.replays >= 20 and not graphs.failed, (graphs.stats, graphs.failed)
