"""kv_cache_dtype="auto" end to end on a tiny V4.1 whose cache stores every family as records (CPU, fp32): the
attention reads MXFP8 window and NVFP4 entry records in place, the indexer decodes MXFP4 keys. Greedy outputs of
a batch equal each request run alone; the prefix cache (exact replay: pages and state blocks of records) equals
a run without it; DSpark speculation equals plain decoding."""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[0] + list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((5, 23, 2, 37, 14))]


@pytest.fixture(scope="module")
def records_ckpt(tmp_path_factory):
    """Tiny V4.1 with index_head_dim 32 (tiny's 16 is not a multiple of MXFP4's 32-channel block, so its "auto"
    runs the deployed numerics over a plain cache instead)."""
    from deepinfer_engine.model.presets import preset_config
    from deepinfer_engine.model.writer import write_checkpoint

    cfg = preset_config("v41", "tiny")
    cfg["text_config"]["index_head_dim"] = 32
    return write_checkpoint(tmp_path_factory.mktemp("v41rec"), cfg, 0)


def _llm(path, **kw) -> LLM:
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, kv_cache_dtype="auto", **kw)
    cache = llm.engine.runner.cache
    assert cache.window_format() is not None and cache.entry_format() is not None  # records, not rounding
    return llm


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_batched_and_prefix_cached_equal_alone_without_cache(records_ckpt) -> None:
    alone = _llm(records_ckpt, enable_prefix_caching=False)
    ref = [_tokens(alone, [p])[0] for p in PROMPTS]
    assert _tokens(alone, PROMPTS) == ref
    cached = _llm(records_ckpt)  # exact replay by default
    first = _tokens(cached, PROMPTS)
    assert first == ref
    # the same prompts again hit the cached record pages and state blocks
    hits = cached.engine.scheduler.kv.stats.hits
    assert _tokens(cached, PROMPTS) == ref
    assert cached.engine.scheduler.kv.stats.hits > hits


def test_dspark_speculation_equals_plain_decoding(records_ckpt) -> None:
    plain = _tokens(_llm(records_ckpt, enable_prefix_caching=False), PROMPTS)
    spec = _llm(records_ckpt, enable_prefix_caching=False, speculative_config={"method": "dspark"})
    outs = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    assert sum(o.metrics.num_verified_tokens for o in outs) > 0  # drafts were verified, not only planned


def test_decode_roofline_counts_the_stored_records(records_ckpt, tiny_ckpt) -> None:
    """The bytes bound of `bench latency` follows what the cache stores: records (smaller KV reads) here, bf16 for
    the tiny preset whose "auto" only rounds through the formats into a plain cache."""
    from deepinfer_engine.bench import decode_roofline, kv_storage
    from deepinfer_engine.roofline import decode_step_bytes

    llm = _llm(records_ckpt, enable_prefix_caching=False)
    assert kv_storage(llm) == "auto"
    r = decode_roofline(llm, batch_sizes=[2], input_len=8, steps=2)
    assert r["kv_format"] == "auto"
    args = llm.engine.args
    assert r["rows"][0]["bytes"] == decode_step_bytes(args, 2, 9, "auto").as_dict()
    assert decode_step_bytes(args, 2, 9, "auto").kv < decode_step_bytes(args, 2, 9, "bfloat16").kv
    plain = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32", kv_cache_dtype="auto")
    assert kv_storage(plain) == "bfloat16"
