"""LLM.generate on real tiny checkpoints (V4.1 and V4, written by make_checkpoint): greedy outputs over a mixed
batch with chunked prefill and preemption forced by a tiny cache equal a dense cache-free recompute; seeded
sampling is reproducible and independent of batch composition; option and parameter errors are typed."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def v41_llm(tiny_ckpt) -> LLM:
    return LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32", page_size=4, max_model_len=24)


def _dense_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    """No scheduler, no paging reuse: a fresh cache and a full forward over the whole sequence each step."""
    ids, out = list(prompt), []
    for _ in range(n):
        cache, bt = ModelCache.allocate_dense(model.args, [len(ids)], dtype=torch.float32)
        with torch.inference_mode():
            logits = model(ForwardBatch.single(torch.tensor(ids), block_table=bt[0], all_logits=False), cache)
        tok = int(logits[-1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


@pytest.mark.slow  # ~5-8 s each on 2 busy CPU cores: 25 dense recomputes; the main end-to-end proof
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_greedy_mixed_batch_with_chunking_and_preemption_equals_dense(tiny_ckpt, arch: str) -> None:
    ckpt = tiny_ckpt(arch)
    page = 4 if arch == "v41" else 8
    # 5 pages x 4 (3 x 8) tokens hold the longest sequence (19 tokens) but not two at once: preemption is forced;
    # a budget of 7 tokens splits the long prompts over several steps
    llm = LLM(str(ckpt), device="cpu", dtype="float32", page_size=page, num_kv_pages=5 if arch == "v41" else 3,
              max_num_batched_tokens=7, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    eos = llm.engine.eos_token_ids[0]
    model = llm.engine.runner.model
    for prompt, out in zip(PROMPTS, outs):
        assert out.error is None
        assert out.outputs[0].token_ids == _dense_greedy(model, prompt, MAX_TOKENS, eos), prompt


def test_seeded_sampling_is_batch_independent(v41_llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, top_k=50, max_tokens=4, seed=42, ignore_eos=True)
    llm = v41_llm
    (alone,) = llm.generate([PROMPTS[1]], sp, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                         [SamplingParams(max_tokens=3, seed=1), sp, SamplingParams(max_tokens=2, temperature=0)],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (other,) = llm.generate([PROMPTS[1]], sp.replace(seed=43), use_tqdm=False)
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_text_prompt_order_and_errors(v41_llm: LLM, tiny_ckpt) -> None:
    llm = v41_llm
    outs = llm.generate(["Hello", [0] * 30, "The capital of France is"], SamplingParams(temperature=0, max_tokens=2),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", None, "The capital of France is"]
    assert outs[0].prompt_token_ids[0] == 0 and len(outs[0].outputs[0].token_ids) == 2
    assert outs[1].outputs[0].finish_reason == "error" and "max_model_len is 24" in outs[1].error
    assert outs[2].error is None and isinstance(outs[2].outputs[0].text, str)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(str(tiny_ckpt("v41")), max_num_seq=4)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("max_tokens", 0), ("top_k", -2), ("min_p", 1.5),
                                         ("repetition_penalty", 0), ("presence_penalty", 3), ("n", 0),
                                         ("stop", [""]), ("logprobs", -1), ("seed", 1.5)])
def test_invalid_sampling_params_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.gpu
def test_cuda_mixed_batch_equals_dense_and_sampling_is_batch_independent(tiny_ckpt) -> None:
    llm = LLM(str(tiny_ckpt("v41")), device="cuda", dtype="float32", page_size=4, num_kv_pages=5,
              max_num_batched_tokens=7, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    model, eos = llm.engine.runner.model, llm.engine.eos_token_ids[0]
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _dense_greedy_on(model, prompt, MAX_TOKENS, eos, "cuda"), prompt
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=7, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[3]], sp, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], PROMPTS[3]], [SamplingParams(max_tokens=2, seed=3), sp], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


def _dense_greedy_on(model, prompt: list[int], n: int, eos: int, device: str) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        cache, bt = ModelCache.allocate_dense(model.args, [len(ids)], dtype=torch.float32, device=device)
        batch = ForwardBatch.single(torch.tensor(ids, device=device), block_table=bt[0].to(device), all_logits=False)
        with torch.inference_mode():
            tok = int(model(batch, cache)[-1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out


def test_incremental_text_equals_full_decode(v41_llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)
    outs = v41_llm.generate([PROMPTS[0], PROMPTS[3]], [sp, sp.replace(seed=12, skip_special_tokens=False)],
                            use_tqdm=False)
    tok = v41_llm.tokenizer
    for out, skip in zip(outs, (True, False)):
        co = out.outputs[0]
        assert co.text == tok.decode(co.token_ids, skip_special_tokens=skip)
    # a stop string cut at its first occurrence, searched across token boundaries
    text = outs[0].outputs[0].text
    stop = text[5:8]
    (cut,) = v41_llm.generate([PROMPTS[0]], sp.replace(stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].text == text[: text.find(stop)] and cut.outputs[0].stop_reason == stop


def test_engine_options_are_one_flat_validated_table() -> None:
    import argparse

    from deepinfer_engine import EngineConfig
    from deepinfer_engine.config import add_engine_args, engine_option_names

    cfg = EngineConfig.from_options(max_num_seqs=3, kv_cache_memory_bytes=2**20, page_size=8)
    assert (cfg.scheduler.max_num_seqs, cfg.cache.kv_cache_memory_bytes, cfg.cache.page_size) == (3, 2**20, 8)
    with pytest.raises(ConfigError, match=r"'max_num_seq' \(did you mean max_num_seqs"):
        EngineConfig.from_options(max_num_seq=3)
    for bad, msg in [(dict(max_num_seqs="4"), "max_num_seqs: found '4'"), (dict(dtype="fp8"), "dtype: found 'fp8'"),
                     (dict(max_num_seqs=0), "max_num_seqs: found 0"),
                     (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization")]:
        with pytest.raises(ConfigError, match=msg):
            EngineConfig.from_options(**bad)
    # the CLI flags are generated from the same fields
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert flags == set(engine_option_names())
    ns = parser.parse_args(["--max-num-seqs", "5", "--kv-cache-memory-bytes", "1MiB", "--no-enable-chunked-prefill"])
    cfg = EngineConfig.from_cli(ns)
    assert cfg.scheduler.max_num_seqs == 5 and cfg.cache.kv_cache_memory_bytes == 2**20
    assert cfg.scheduler.enable_chunked_prefill is False and cfg.scheduler.max_num_batched_tokens == 8192


def test_pdl_option_reaches_the_model_and_changes_no_output(tiny_ckpt) -> None:
    """The engine options `pdl` and `side_streams` (default on) reach the loaded model; greedy outputs are the
    same with it off (on the CPU no kernel uses PDL: this proves the plumbing; the numbers on the GPU:
    worker/test_cuda_graph_pdl_cuda.py)."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32", page_size=4, max_model_len=24, pdl=on,
                  side_streams=on)
        assert llm.config.model.pdl is on and llm.config.model.side_streams is on
        assert {m.pdl for m in llm.engine.runner.model.modules()} == {on}
        assert llm.engine.runner.model.overlap is on  # side streams (CPU: the model never makes any)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp, use_tqdm=False)]
    assert outs[True] == outs[False]
