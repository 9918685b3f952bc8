"""The runtime features on CUDA together with CUDA graphs (on by default there), tiny V4.1 / V4 checkpoints, fp32
(gpu marker; the CPU suite proves each feature on its own):

- prefix cache (exact replay, a small cache with the host tier: pinned pages, side-stream copies) == cache off;
- asynchronous scheduling == synchronous;
- DSpark speculation (V4.1, V4-0731) and MTP speculation (V4) == plain greedy decoding;
- each of the above equals the same engine with `enforce_eager=True`.
Greedy token ids are compared; fp32 keeps near-ties from flipping between step shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.writer import make_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BASE = list(range(100, 137))
PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 20)), [0, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime_cuda")
    return {"v41": make_checkpoint(root / "v41", "v41", "tiny", 0),
            "v4": make_checkpoint(root / "v4", "v4", "tiny", 0),
            "v4-0731": make_checkpoint(root / "v4d", "v4", "tiny-dspark", 0)}


def _llm(path: Path, **kw) -> LLM:
    page = 4 if path.name == "v41" else 8  # a multiple of every compress ratio
    opts = dict(device="cuda", dtype="float32", page_size=page, max_num_seqs=8, max_model_len=128)
    return LLM(str(path), **{**opts, "num_kv_pages": 64, **kw})


def _ids(outs) -> list[list[int]]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _conversation(llm: LLM) -> list[list[int]]:
    """Turns that hit the prefix cache at unaligned lengths, one that evicts (small cache), a multi-turn one."""
    outs = []
    for prompt in ([0] + BASE, [0] + list(range(300, 339)), [0] + BASE + list(range(200, 211)),
                   [0] + BASE[:21] + [7, 8, 9]):
        outs += llm.generate([prompt], GREEDY, use_tqdm=False)
    first = outs[0]
    outs += llm.generate([first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]], GREEDY, use_tqdm=False)
    return _ids(outs)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_prefix_cache_with_host_tier_equals_no_cache_on_cuda(ckpts, arch: str) -> None:
    page = 4 if arch == "v41" else 8
    ref = _conversation(_llm(ckpts[arch], enable_prefix_caching=False, enforce_eager=True))
    llm = _llm(ckpts[arch], num_kv_pages=64 // page, num_prefix_state_slots=32, prefix_cache_host_bytes=2**20)
    assert _conversation(llm) == ref
    kv = llm.engine.scheduler.kv
    assert kv.stats.hits >= 2 and kv.pool.num_evicted > 0 and kv.stats.host_loaded_pages > 0


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_async_scheduling_equals_sync_on_cuda(ckpts, arch: str) -> None:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _ids(_llm(ckpts[arch], enforce_eager=True, async_scheduling=False).generate(PROMPTS, sp, use_tqdm=False))
    for kw in ({}, {"max_num_batched_tokens": 10}):  # graphs on; chunked prefill beside decode rows
        got = _ids(_llm(ckpts[arch], async_scheduling=True, **kw).generate(PROMPTS, sp, use_tqdm=False))
        assert got == ref, kw


@pytest.mark.parametrize(("arch", "method"), [("v41", "dspark"), ("v4-0731", "dspark"), ("v4", "mtp")])
def test_speculation_equals_plain_greedy_on_cuda(ckpts, arch: str, method: str) -> None:
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ref = _ids(_llm(ckpts[arch]).generate(PROMPTS, sp, use_tqdm=False))
    llm = _llm(ckpts[arch], speculative_config={"method": method})
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert _ids(outs) == ref
    assert sum(o.metrics.num_verified_tokens for o in outs) > 0
