"""The prefill_truncation engine options end to end on the tiny V4.1 checkpoint (window 8, 3 decoder layers:
exact from KEEP 22 on, docs/prefill_truncation.md): greedy outputs and prompt logprobs under compact equal those
of a full prefill with chunked prefill mixing requests in one step; bad options are ConfigErrors."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.errors import ConfigError

PROMPTS = [
    torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (45, 30, 9)
]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("v41")


def _run(path, **options):
    # a 16-token budget splits the long prompts over several steps, their kept rectangles across chunks
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              **options)
    rows: list[int] = []  # rows the last decoder layer ran on, per step
    last = llm.engine.runner.model.layers[-1]
    hook = last.register_forward_pre_hook(lambda mod, inp: rows.append(inp[0].shape[0]))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hook.remove()
    llm.decoder_rows = sum(rows)
    plp = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)
    return [o.outputs[0].token_ids for o in greedy], plp[0].prompt_logprobs, llm


@pytest.mark.slow  # ~15 s on 2 busy cores: two engines, chunked prefill + decode + prompt logprobs
def test_compact_equals_full_prefill_through_the_engine(ckpt) -> None:
    ref_tokens, ref_plp, ref_llm = _run(ckpt)
    tokens, plp, llm = _run(ckpt, prefill_truncation="compact", prefill_truncation_keep=22)
    assert llm.engine.runner.model.decoder_split.keep == 22
    # the decoder ran 22 rows of each long prompt (+ every decode token): 45 + 30 - 2 x 22 rows fewer
    assert ref_llm.decoder_rows - llm.decoder_rows == 45 + 30 - 2 * 22
    assert tokens == ref_tokens
    # prompt-logprobs requests run every row (known_len 0): the same values as without truncation
    assert len(plp) == len(ref_plp) == len(PROMPTS[0])
    for got, ref in zip(plp[1:], ref_plp[1:]):
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (ref.token_id, ref.rank, [t for t, _ in ref.top])
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)


def test_bad_options_fail_before_loading(ckpt, tiny_ckpt) -> None:
    with pytest.raises(ConfigError, match="prefill_truncation_keep: found 13"):
        LLM(str(ckpt), device="cpu", prefill_truncation="compact", prefill_truncation_keep=13)
    with pytest.raises(ConfigError, match="prefill_truncation: found 'mask'"):
        LLM(str(ckpt), device="cpu", prefill_truncation="mask")
    v4 = tiny_ckpt("v4")
    with pytest.raises(ConfigError, match="arch 'v4'"):
        LLM(str(v4), device="cpu", prefill_truncation="compact")
